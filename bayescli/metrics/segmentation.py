"""Per-pixel metrics for segmentation, streamed: accumulators fed batch by batch, never holding a
set's pixels.

**Calibration and accuracy** (:class:`SegmentationMetrics`): per-pixel log-probabilities or
probabilities ``[B, K, H, W]`` against integer masks ``[B, H, W]``; pixels whose mask is
``ignore_index`` (default 255) count nowhere. Each valid pixel is one row of
:mod:`bayescli.metrics.classification`, with its protocol: pixel accuracy is the arg-max accuracy;
NLL the mean ``−log p(y)`` over pixels, exact from log-probabilities (else from the float64 log of
the probabilities); Brier ``Σ_k (p_k − y_k)²`` averaged over pixels; ECE 15 equal-width bins of the
top-label probability, right-closed ``(lo, hi]``, streamed as per-bin sums (count, hits,
confidence), so it equals :func:`~bayescli.metrics.classification.ece` on the pixels as rows; the
reliability diagram is those bins. IoU per class is ``TP / (TP + FP + FN)`` from the pixel
confusion matrix summed over the whole set (not averaged per image); mean IoU averages it over the
classes present in the ground truth *or* the prediction of some valid pixel: a class absent from
both has ``0/0``, reported as ``None`` and left out of the mean (mmsegmentation's ``nanmean``,
torchmetrics' ``MulticlassJaccardIndex`` macro average).

**Anomaly segmentation** (:class:`AnomalySegmentationMetrics`): per-pixel anomaly scores
``[B, H, W]`` against binary labels ``[B, H, W]`` (1 anomalous = the positive class, 0 normal,
``ignore_index`` void), as SegmentMeIfYouCan and Fishyscapes report them: AUROC, average precision
(scikit-learn's step-wise ``Σ_t (R_t − R_{t−1}) P_t``; SegmentMeIfYouCan's own code integrates
its binned PR curve by the trapezoid rule instead) and FPR at 95% TPR (the false-positive rate at
the highest threshold whose TPR reaches 0.95, every distinct threshold kept: scikit-learn's
``roc_curve(..., drop_intermediate=False)``), all with the convention *higher score = more
anomalous* (:func:`anomaly_scores` makes its scores so).

Streaming without the pixels: each score goes through a monotone non-decreasing map to a bin
(float32 bit patterns: the sign, the exponent and the top ``mantissa_bits`` of the mantissa, so a
bin spans a relative width ``2^−mantissa_bits`` at any magnitude, from the ``1e-30`` of a saturated
max-prob to an energy of −500; or equal-width bins over a given range, values outside it clipped
into the end bins) and per-bin counts of anomalous and normal pixels are summed (``2^(10 +
mantissa_bits)`` int64 per score: 8 MiB at the default 10 bits). Binning preserves
the order of any two scores in different bins and ties the scores in one bin, so against the exact
definition on the float64 scores (scikit-learn's ``roc_auc_score``, ``average_precision_score``):

* AUROC counts each (anomalous, normal) pair ordered right (1), tied (½) or wrong (0); a pair in
  one bin counts ½ instead of its exact 0, ½ or 1, so
  ``|ΔAUROC| ≤ ½ Σ_b p_b n_b / (P N)`` (``p_b``, ``n_b`` the bin's anomalous and normal counts,
  ``P``, ``N`` the totals) ``≤ ½ max_b n_b / N``;
* AP: with ``T``, ``F`` the anomalous and normal counts above bin ``b``, the exact thresholds
  inside it add ``(1/P) Σ_{i=1..p_b} (T + i) / (T + F + i + j_i)``, ``j_i`` the bin's normal pixels
  scoring at least the ``i``-th anomalous one's score: at most with ``j_i = 0`` (all normal pixels
  below), at least with ``j_i = n_b`` (all above); the binned AP adds
  ``(p_b/P) (T + p_b) / (T + F + p_b + n_b)``, so ``|ΔAP| ≤ Σ_b`` (the larger distance from the
  binned term to those two extremes), each sum in closed form through the digamma function;
* FPR95: the exact threshold lies in the bin ``b*`` where the cumulative TPR first reaches 0.95;
  the binned value counts all of that bin's normal pixels, the exact one some of them:
  ``0 ≤ FPR95_binned − FPR95_exact ≤ n_{b*} / N``.

These bounds are computed from the histograms and reported with the values (``error_bound``):
they are a posteriori and hold whatever the score distribution (they are 0 where no bin mixes
anomalous and normal pixels). ``exact=True`` keeps every valid pixel's score instead (for small
sets, and the tests) and reports bounds of 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from bayescli.errors import BayescliError
from bayescli.metrics.classification import ECE_BINS, entropy, entropy_of_log, log_probabilities

IGNORE_INDEX = 255
MANTISSA_BITS = 10  # 2^19 = 524,288 bins, relative width 2^-10 ≈ 0.1%
# Rows (pixels) per chunk times classes: bounds the float64 copies one update makes, whatever B·H·W.
CHUNK_ELEMENTS = 1 << 22
NO_CLASS = -(1 << 62)  # below any class a mask can hold: "no bad class seen yet"

PROTOCOL = {
    "pixels": "valid pixels only (mask != ignore_index); every metric sums over the set's pixels",
    "iou": "TP/(TP+FP+FN) per class from the set's confusion matrix; None where 0/0",
    "mean_iou": "mean over classes present in ground truth or prediction (0/0 classes left out)",
    "nll": "mean -log p(y) over pixels, exact from log-probabilities",
    "brier": "sum over classes, mean over pixels",
    "ece": f"{ECE_BINS} equal-width bins of the top-label probability, right-closed, streamed",
    "anomaly": "anomalous pixels positive; higher score = more anomalous; AP step-wise (sklearn); "
    "FPR at the highest threshold with TPR >= 0.95",
}


def _valid(mask: torch.Tensor, ignore_index: int | None) -> torch.Tensor:
    return torch.ones_like(mask, dtype=torch.bool) if ignore_index is None else mask != ignore_index


class SegmentationMetrics:
    """Streamed pixel accuracy, IoU, NLL, Brier, ECE and reliability bins of a ``K``-class
    segmentation, fed by :meth:`update`; :meth:`compute` gives the totals so far.

    The state (a ``[K, K]`` confusion matrix and float64 sums) lives on the device of the first
    batch, and :meth:`update` reads nothing back from it (no host sync per batch): a mask class
    outside ``0 … K−1`` is counted there and raised by :meth:`compute`. Only :meth:`compute`'s
    numbers come back to the host.
    """

    def __init__(
        self, num_classes: int, ignore_index: int | None = IGNORE_INDEX, bins: int = ECE_BINS
    ) -> None:
        if num_classes < 1 or bins < 1:
            raise BayescliError(f"segmentation metrics need ≥ 1 class and bin, got {num_classes} and {bins}")
        self.num_classes, self.ignore_index, self.bins = num_classes, ignore_index, bins
        self.confusion: torch.Tensor | None = None  # [K·K] int64, row-major: true class, predicted
        self._sums: torch.Tensor | None = None  # [4] float64: NLL, Brier, max-prob, entropy
        self._bins: torch.Tensor | None = None  # [3, bins] float64: count, hits, confidence
        self._bad: torch.Tensor | None = None  # [2] int64: pixels of a class ≥ K or < 0, the largest

    def _state(self, device: torch.device) -> None:
        if self.confusion is None:
            k = self.num_classes
            self.confusion = torch.zeros(k * k, dtype=torch.int64, device=device)
            self._sums = torch.zeros(4, dtype=torch.float64, device=device)
            self._bins = torch.zeros(3, self.bins, dtype=torch.float64, device=device)
            self._bad = torch.tensor([0, NO_CLASS], dtype=torch.int64, device=device)

    def update(
        self, mask: torch.Tensor, log_probs: torch.Tensor | None = None, probs: torch.Tensor | None = None
    ) -> None:
        """Add a batch: ``mask [B, H, W]`` integer classes (or ``ignore_index``) and the per-pixel
        ``log_probs [B, K, H, W]`` and/or ``probs [B, K, H, W]``. With both, NLL comes from
        ``log_probs`` and the rest from ``probs`` (as
        :func:`~bayescli.metrics.classification.classification_summary`); with one, the other is
        its float64 ``exp`` / ``log``. Ignored pixels' predictions are never used (they may be
        anything, NaN included)."""
        pred = log_probs if log_probs is not None else probs
        if pred is None:
            raise BayescliError("segmentation metrics need log_probs or probs")
        k = self.num_classes
        if pred.dim() != 4 or pred.shape[1] != k or mask.shape != (pred.shape[0], *pred.shape[2:]):
            raise BayescliError(
                f"segmentation metrics need predictions [B, {k}, H, W] and masks [B, H, W]; "
                f"got {list(pred.shape)} and {list(mask.shape)}"
            )
        if probs is not None and log_probs is not None and probs.shape != log_probs.shape:
            raise BayescliError(
                f"probs {list(probs.shape)} and log_probs {list(log_probs.shape)} differ in shape"
            )
        self._state(pred.device)
        if not mask.numel():
            return
        mask = mask.to(pred.device).long()
        valid = _valid(mask, self.ignore_index)
        bad = valid & ((mask < 0) | (mask >= k))
        self._bad[0] += bad.sum()
        self._bad[1] = torch.maximum(self._bad[1], torch.where(bad, mask, NO_CLASS).max())
        use = valid & ~bad
        y_all = torch.where(use, mask, 0)  # a safe index where the pixel does not count
        chunk = max(1, CHUNK_ELEMENTS // k)
        for b in range(pred.shape[0]):
            y_img, use_img = y_all[b].reshape(-1), use[b].reshape(-1)
            # [K, H·W] views of image b; each chunk of pixels becomes rows [n, K]
            lp_img = None if log_probs is None else log_probs[b].reshape(k, -1)
            p_img = None if probs is None else probs[b].reshape(k, -1)
            for start in range(0, len(y_img), chunk):
                cols = slice(start, start + chunk)
                lp = None if lp_img is None else lp_img[:, cols].T.double()
                p = p_img[:, cols].T.double() if p_img is not None else lp.exp()
                self._add(y_img[cols], use_img[cols], p, log_probabilities(p) if lp is None else lp)

    def _add(self, y: torch.Tensor, use: torch.Tensor, p: torch.Tensor, logp: torch.Tensor) -> None:
        """Sums for the pixels ``y [n]`` that ``use [n]`` marks, with probabilities and
        log-probabilities ``[n, K]`` (float64); the others add nothing (``where``, not a product,
        so that a NaN there cannot leak)."""
        k = self.num_classes
        conf, pred = p.max(-1)
        conf = torch.where(use, conf, 0.0)
        # unused pixels go to one extra cell, dropped
        self.confusion += torch.bincount(torch.where(use, y * k + pred, k * k), minlength=k * k + 1)[:-1]
        onehot = torch.nn.functional.one_hot(y, k).double()
        terms = torch.stack(
            [-logp.gather(1, y[:, None]).squeeze(1), (p - onehot).pow(2).sum(-1), conf, entropy(p)]
        )
        self._sums += torch.where(use, terms, 0.0).sum(1)
        idx = (torch.ceil(conf * self.bins) - 1).clamp(0, self.bins - 1).long()
        per_bin = torch.stack([use.double(), (use & (pred == y)).double(), conf])  # [3, n]
        self._bins.index_add_(1, idx, per_bin)

    def merge(self, other: SegmentationMetrics) -> None:
        """Add ``other``'s totals (another shard of the same set, e.g. another process's)."""
        if (other.num_classes, other.bins, other.ignore_index) != (
            self.num_classes,
            self.bins,
            self.ignore_index,
        ):
            raise BayescliError(
                "cannot merge segmentation metrics of different classes, bins or ignore_index"
            )
        if other.confusion is None:
            return
        self._state(other.confusion.device)
        device = self.confusion.device
        self.confusion += other.confusion.to(device)
        self._sums += other._sums.to(device)
        self._bins += other._bins.to(device)
        self._bad[0] += other._bad[0].to(device)
        self._bad[1] = torch.maximum(self._bad[1], other._bad[1].to(device))

    def iou(self) -> list[float | None]:
        """IoU per class ``[K]`` (``None`` for a class in neither ground truth nor prediction)."""
        if self.confusion is None:
            return [None] * self.num_classes
        cm = self.confusion.view(self.num_classes, self.num_classes).double()
        tp = cm.diagonal()
        union = cm.sum(0) + cm.sum(1) - tp
        return [None if u == 0 else t / u for t, u in zip(tp.tolist(), union.tolist(), strict=True)]

    def compute(self) -> dict:
        """``pixels``, ``pixel_accuracy``, ``mean_iou``, ``iou`` (per class, ``None`` where 0/0),
        ``nll``, ``brier``, ``ece``, ``mmc``, ``entropy`` (mean per pixel, nats) and
        ``reliability`` (per-bin ``count``, mean ``confidence``, ``accuracy``)."""
        if self._bad is not None and int(self._bad[0]):
            k = self.num_classes
            raise BayescliError(
                f"mask holds class {int(self._bad[1])} ({int(self._bad[0])} pixels) but the model has {k} "
                f"classes (0–{k - 1}, ignore_index {self.ignore_index}); use masks with the model's "
                "classes or set ignore_index"
            )
        n = 0 if self.confusion is None else int(self.confusion.sum())
        if n == 0:
            raise BayescliError(
                "segmentation metrics need at least one labelled pixel (all were ignore_index)"
            )
        cm = self.confusion.view(self.num_classes, self.num_classes)
        iou = self.iou()
        present = [v for v in iou if v is not None]
        nll, brier, mmc, ent = (self._sums / n).tolist()
        count, hits, confidence = self._bins
        safe = count.clamp_min(1)
        return {
            "pixels": n,
            "pixel_accuracy": int(cm.diagonal().sum()) / n,
            "mean_iou": sum(present) / len(present),
            "iou": iou,
            "nll": nll,
            "brier": brier,
            "ece": ((hits - confidence).abs().sum() / n).item(),
            "mmc": mmc,
            "entropy": ent,
            "reliability": {
                "count": count.tolist(),
                "confidence": (confidence / safe).tolist(),
                "accuracy": (hits / safe).tolist(),
            },
        }


def anomaly_scores(
    log_probs: torch.Tensor | None = None,
    *,
    logits: torch.Tensor | None = None,
    sample_log_probs: torch.Tensor | None = None,
    mutual_information: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-pixel anomaly scores ``[B, H, W]`` (float64), each *higher = more anomalous*:

    * ``max_prob``: ``1 − max_k p_k``, taken as ``Σ_{j≠top} p_j`` from the log-probabilities so a
      saturated pixel keeps its tiny value (ranks as ``−max p``: low confidence is anomalous);
    * ``entropy``: the predictive entropy (nats);
    * ``mutual_information``: ``H(mean_s p_s) − mean_s H(p_s)`` of ``sample_log_probs
      [S, B, K, H, W]`` (log-probabilities per sample), or the given ``mutual_information [B, H, W]``;
    * ``energy``: ``−logsumexp_k`` of ``logits [B, K, H, W]`` (Liu et al. 2020; in-distribution
      pixels have low energy).

    ``log_probs [B, K, H, W]`` is the predictive; without it, the mean of the samples
    (``logsumexp_s − log S``) or the log-softmax of ``logits``. A score whose input is missing is
    left out.
    """
    if log_probs is None and sample_log_probs is not None:
        log_probs = sample_log_probs.double().logsumexp(0) - math.log(sample_log_probs.shape[0])
    if log_probs is None and logits is not None:
        log_probs = logits.double().log_softmax(1)
    out: dict[str, torch.Tensor] = {}
    if log_probs is not None:
        logp = log_probs.double()
        top = logp.argmax(1, keepdim=True)
        out["max_prob"] = logp.scatter(1, top, -math.inf).logsumexp(1).exp()
        out["entropy"] = entropy_of_log(logp.movedim(1, -1))
    if sample_log_probs is not None:
        samples = sample_log_probs.double()
        # the samples' own mean: MI is theirs, whatever predictive log_probs is
        mean = samples.logsumexp(0) - math.log(samples.shape[0])
        each = entropy_of_log(samples.movedim(2, -1)).mean(0)
        out["mutual_information"] = entropy_of_log(mean.movedim(1, -1)) - each
    elif mutual_information is not None:
        out["mutual_information"] = mutual_information.double()
    if logits is not None:
        out["energy"] = -logits.double().logsumexp(1)
    return out


def float_bins(score: torch.Tensor, mantissa_bits: int = MANTISSA_BITS) -> torch.Tensor:
    """Bin ``[...]`` (int64 in ``[0, 2^(9 + mantissa_bits))``) of each ``score``: its float32 bit
    pattern made monotone (negatives reflected), cut to sign, exponent and the top
    ``mantissa_bits``. Non-decreasing in the score; −0 and +0 share a bin."""
    if not 0 <= mantissa_bits <= 23:
        raise BayescliError(f"mantissa_bits must be in 0–23, got {mantissa_bits}")
    f = score.float()
    f = torch.where(f == 0, torch.zeros_like(f), f)
    bits = f.view(torch.int32).long()
    key = torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF) - 1)  # [-2^31, 2^31), ordered as the floats
    return (key >> (23 - mantissa_bits)) + (1 << (8 + mantissa_bits))


def range_bins(score: torch.Tensor, lo: float, hi: float, bins: int) -> torch.Tensor:
    """Equal-width bin ``[...]`` of each ``score`` over ``[lo, hi]``, values outside clipped into the
    end bins (still non-decreasing in the score)."""
    return ((score.double() - lo) * (bins / (hi - lo))).floor().clamp(0, bins - 1).long()


def _curve_metrics(pos: torch.Tensor, neg: torch.Tensor, exact: bool) -> dict:
    """AUROC, AP, FPR95 and their binning error bounds from per-bin anomalous and normal counts
    ``pos, neg [T]`` (float64), ordered from the highest score down; a bin is one threshold."""
    big_p, big_n = pos.sum(), neg.sum()
    tp, fp = pos.cumsum(0), neg.cumsum(0)
    tp_above, fp_above = tp - pos, fp - neg
    auroc = (neg * (tp_above + pos / 2)).sum() / (big_p * big_n)
    has = pos > 0
    precision = tp / (tp + fp).clamp_min(1)
    ap = (pos[has] * precision[has]).sum() / big_p
    star = int(torch.nonzero(tp >= 0.95 * big_p)[0, 0])
    fpr95 = fp[star] / big_n
    if exact:
        bounds = torch.zeros(3, dtype=torch.float64)
    else:
        # AP inside a bin: its anomalous pixels in any order among its normal ones add
        # Σ_{i=1..p} (T+i)/(C+i) = p − (C−T)(ψ(C+p+1) − ψ(C+1)), largest with all normal ones
        # last (C = T+F), smallest with them first (C = T+F+n); the binned AP adds p·(T+p)/(T+F+p+n)
        t, f, p, n = tp_above[has], fp_above[has], pos[has], neg[has]
        most = p - f * (torch.digamma(t + f + p + 1) - torch.digamma(t + f + 1))
        least = p - (f + n) * (torch.digamma(t + f + n + p + 1) - torch.digamma(t + f + n + 1))
        binned = p * (t + p) / (t + f + p + n)
        bounds = torch.stack(
            [
                (pos * neg).sum() / (2 * big_p * big_n),
                torch.maximum(most - binned, binned - least).clamp_min(0).sum() / big_p,
                neg[star] / big_n,
            ]
        )
    values = torch.stack([auroc, ap, fpr95]).tolist()
    bound = bounds.tolist()
    return {
        "auroc": values[0],
        "ap": values[1],
        "fpr95": values[2],
        "error_bound": {"auroc": bound[0], "ap": bound[1], "fpr95": bound[2]},
    }


class AnomalySegmentationMetrics:
    """Streamed pixel-level anomaly detection (AUROC, AP, FPR95 with error bounds; see the module
    docstring) for any number of named scores, fed by :meth:`update`.

    ``exact=True`` keeps every valid pixel's float64 score (memory grows with the set); otherwise
    per-bin counts: equal-width ``bins`` over ``value_range`` when given, else :func:`float_bins`
    with ``mantissa_bits`` (no range needed).
    """

    def __init__(
        self,
        *,
        exact: bool = False,
        mantissa_bits: int = MANTISSA_BITS,
        value_range: tuple[float, float] | None = None,
        bins: int = 100_000,
        ignore_index: int | None = IGNORE_INDEX,
    ) -> None:
        if value_range is not None and not (
            math.isfinite(value_range[0]) and value_range[1] > value_range[0]
        ):
            raise BayescliError(f"value_range must be a finite (lo, hi) with lo < hi, got {value_range}")
        if value_range is not None and bins < 1:
            raise BayescliError(f"bins must be ≥ 1, got {bins}")
        float_bins(torch.zeros(1), mantissa_bits)  # validates mantissa_bits
        self.exact, self.mantissa_bits, self.value_range, self.bins = exact, mantissa_bits, value_range, bins
        self.ignore_index = ignore_index
        # name -> [2·bins + 1] int64: (normal, anomalous) count per bin, then one dropped cell
        self._hist: dict[str, torch.Tensor] = {}
        # exact: name -> [(scores [n] float64, anomalous [n] bool, counted [n] bool)]
        self._kept: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        # checked by compute, so that update reads nothing back: bad labels (count, largest), NaNs
        self._bad: torch.Tensor | None = None
        self._nan: dict[str, torch.Tensor] = {}

    @property
    def num_bins(self) -> int:
        """Bins per score (``bins`` over ``value_range``, else ``2^(9 + mantissa_bits)``)."""
        return self.bins if self.value_range is not None else 1 << (9 + self.mantissa_bits)

    def _bin(self, score: torch.Tensor) -> torch.Tensor:
        if self.value_range is not None:
            return range_bins(score, *self.value_range, self.bins)
        return float_bins(score, self.mantissa_bits)

    def update(self, scores: Mapping[str, torch.Tensor], anomaly: torch.Tensor) -> None:
        """Add a batch: ``scores`` maps names to ``[B, H, W]`` (higher = more anomalous, e.g.
        :func:`anomaly_scores`), ``anomaly [B, H, W]`` holds 1 (anomalous), 0 (normal) or
        ``ignore_index`` (void, left out), or is boolean. Reads nothing back from the device: a
        label other than 0, 1 or ``ignore_index`` and a NaN score on a counted pixel are raised
        by :meth:`compute`."""
        if not anomaly.numel():
            return
        if anomaly.dtype is torch.bool:
            valid, label = torch.ones_like(anomaly), anomaly
        else:
            valid, label = _valid(anomaly, self.ignore_index), anomaly == 1
            bad = valid & (anomaly != 0) & ~label
            found = torch.stack([bad.sum(), torch.where(bad, anomaly.long(), NO_CLASS).max()])
            self._bad = (
                found
                if self._bad is None
                else torch.stack(
                    [self._bad[0] + found[0].to(self._bad.device), torch.maximum(self._bad[1], found[1])]
                )
            )
            valid = valid & ~bad
        for name, score in scores.items():
            if score.shape != anomaly.shape:
                raise BayescliError(
                    f"anomaly score {name!r} is {list(score.shape)} "
                    f"but the anomaly mask is {list(anomaly.shape)}"
                )
            lab, use = label.to(score.device), valid.to(score.device)
            nan = (use & score.isnan()).sum()
            self._nan[name] = nan if name not in self._nan else self._nan[name] + nan
            use = use & ~score.isnan()
            if self.exact:
                kept = (score.reshape(-1).double(), lab.reshape(-1), use.reshape(-1))
                self._kept.setdefault(name, []).append(kept)
                continue
            hist = self._hist.get(name)
            if hist is None:
                size = 2 * self.num_bins + 1
                hist = self._hist[name] = torch.zeros(size, dtype=torch.int64, device=score.device)
            # index_add, not bincount: the cost follows the batch's pixels, not the number of bins;
            # pixels that do not count go to the last cell
            idx = torch.where(use, self._bin(score) * 2 + lab.long(), 2 * self.num_bins).reshape(-1)
            hist.index_add_(0, idx.to(hist.device), torch.ones_like(idx, device=hist.device))

    def merge(self, other: AnomalySegmentationMetrics) -> None:
        """Add ``other``'s counts or kept scores (same binning)."""
        same = (other.exact, other.mantissa_bits, other.value_range, other.bins, other.ignore_index)
        if same != (self.exact, self.mantissa_bits, self.value_range, self.bins, self.ignore_index):
            raise BayescliError("cannot merge anomaly metrics with different binning or ignore_index")
        for name, kept in other._kept.items():
            self._kept.setdefault(name, []).extend(kept)
        for name, hist in other._hist.items():
            mine = self._hist.get(name)
            self._hist[name] = hist.clone() if mine is None else mine + hist.to(mine.device)
        for name, nan in other._nan.items():
            self._nan[name] = (
                nan.clone() if name not in self._nan else self._nan[name] + nan.to(self._nan[name].device)
            )
        if other._bad is not None:
            theirs = other._bad if self._bad is None else other._bad.to(self._bad.device)
            self._bad = (
                theirs.clone()
                if self._bad is None
                else torch.stack([self._bad[0] + theirs[0], torch.maximum(self._bad[1], theirs[1])])
            )

    def _counts(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Anomalous and normal counts ``([T], [T])`` float64, from the highest score down."""
        if self.exact:
            s, lab, use = (torch.cat(part) for part in zip(*self._kept[name], strict=True))
            s, lab = s[use], lab[use].double()
            _, inverse = torch.unique(s, return_inverse=True)  # one threshold per distinct score
            size = int(inverse.max()) + 1 if len(s) else 0
            pos = torch.zeros(size, dtype=torch.float64, device=s.device).index_add_(0, inverse, lab)
            neg = torch.zeros_like(pos).index_add_(0, inverse, 1 - lab)
        else:
            both = self._hist[name][:-1].view(-1, 2)
            both = both[both.sum(1) > 0].double()  # an empty bin is no threshold: dropped
            neg, pos = both[:, 0], both[:, 1]
        return pos.flip(0), neg.flip(0)

    def compute(self) -> dict:
        """``pixels`` and ``anomalous`` (valid pixel counts), ``binning`` and, under ``scores``,
        per name: ``auroc``, ``ap``, ``fpr95`` and ``error_bound`` (of each, against the exact
        definition; 0 in exact mode)."""
        names = list(self._kept if self.exact else self._hist)
        if not names:
            raise BayescliError("anomaly metrics have no scores yet")
        if self._bad is not None and int(self._bad[0]):
            raise BayescliError(
                f"anomaly masks must hold 0 (normal), 1 (anomalous) or ignore_index {self.ignore_index}; "
                f"found {int(self._bad[1])} ({int(self._bad[0])} pixels)"
            )
        for name, nan in self._nan.items():
            if int(nan):
                raise BayescliError(f"anomaly score {name!r} is NaN on {int(nan)} counted pixels")
        out: dict = {"scores": {}}
        for name in names:
            pos, neg = self._counts(name)
            p, n = int(pos.sum()), int(neg.sum())
            if p == 0 or n == 0:
                raise BayescliError(
                    f"anomaly metrics need both anomalous and normal pixels; got {p} anomalous and {n} normal"
                )
            out["pixels"], out["anomalous"] = p + n, p
            out["scores"][name] = _curve_metrics(pos, neg, self.exact)
        if self.exact:
            out["binning"] = "exact"
        elif self.value_range is None:
            out["binning"] = f"float32 bits, {self.mantissa_bits} mantissa bits ({self.num_bins} bins)"
        else:
            out["binning"] = (
                f"{self.bins} equal-width bins over [{self.value_range[0]:g}, {self.value_range[1]:g}]"
            )
        return out
