"""Metrics for multi-label classifiers: per-label probabilities ``probs [N, K]`` in ``[0, 1]``
(a sigmoid per label, or a posterior's predictive mean of it) and labels ``y [N, K]`` in ``{0, 1}``.

Protocol (the multi-label counterpart of :mod:`bayescli.metrics.classification`):

* a label is predicted present when ``p ≥ threshold`` (0.5 by default: logit ≥ 0);
* mAP is the mean over the labels *with at least one positive* of scikit-learn's step-wise
  average precision ``Σ_t (R_t − R_{t−1}) P_t`` (scikit-learn's ``average="macro"`` would count
  a label without positives as AP 0); ``per_label`` gives ``None`` for those labels;
* micro F1 is ``2 TP / (2 TP + FP + FN)`` over all ``N·K`` cells, macro F1 the mean of the
  per-label F1s, a label with neither true nor predicted positives counting 0 (scikit-learn's
  ``zero_division=0``);
* Hamming loss is the fraction of wrong cells; subset accuracy the fraction of inputs whose
  whole predicted label vector is right;
* per-label NLL is the binary cross-entropy ``−mean_n log p(y_nk)``: from the log-odds ``s``
  where the link has them (MAP's logits, the ``none`` and ``probit`` links' scaled means), as
  ``log σ(s)`` and ``log σ(−s)`` in float64, exact at any margin; else from ``p(1) = p``,
  ``p(0) = 1 − p`` in float64, a 0 counting as the smallest positive float64 (as
  :func:`bayescli.metrics.classification.log_probabilities`); per-label Brier is
  ``mean_n (p_nk − y_nk)²`` (range [0, 1]);
* per-label ECE is the binary reliability error of the *positive-value* probability: 15
  equal-width bins of ``p_k``, right-closed ``(lo, hi]`` with 0 in the first bin,
  ``ECE_k = Σ_b (n_b/N) |mean_b(y_k) − mean_b(p_k)|`` (the per-class term of
  :func:`bayescli.metrics.classification.classwise_ece`, not a top-label ECE of ``max(p, 1 − p)``);
* the summary's ``nll``, ``brier`` and ``ece`` are the means of the per-label values over all
  ``K`` labels; entropies are in nats.

Every metric runs on the device of ``probs`` (labels are moved there); only scalars or per-label
lists come back to the host.

OOD scores (:func:`ood_scores`) are oriented like :mod:`bayescli.evaluation.detectors`:
**higher means in-distribution**, the convention :func:`bayescli.metrics.classification.ood_metrics` expects
(in-distribution is its positive class), so ``ood_metrics(score_in, score_out)["auroc"]`` is the
probability that an in-distribution input outscores an OOD one.
"""

from __future__ import annotations

import math

import torch

from bayescli.errors import BayescliError
from bayescli.metrics.classification import ECE_BINS, PROB_TINY, _average_precision, _threshold_counts

THRESHOLD = 0.5
PROB_FLOOR = 1e-12  # the floor of the log-odds OOD score (bayescli.evaluation.multilabel), not the NLL's
PROTOCOL = {
    "threshold": "label present when p >= 0.5",
    "map": "mean over labels with a positive of step-wise average precision",
    "f1": "micro over all cells; macro mean over labels, 0 when a label has no true nor predicted positive",
    "nll": "per-label binary cross-entropy from log-sigmoid of the log-odds where known, mean over labels",
    "brier": "per-label mean (p - y)^2, mean over labels",
    "ece": "per label 15 equal-width right-closed bins of p vs frequency of y = 1, mean over labels",
    "selective_confidence": "mean over labels of max(p, 1 - p)",
    "entropy": "nats",
}


def check_multilabel(probs: torch.Tensor, y: torch.Tensor | None = None) -> None:
    """Raise :class:`BayescliError` unless ``probs`` is a finite ``[N, K]`` table in ``[0, 1]``
    and ``y`` (when given) a ``{0, 1}`` table of the same shape."""
    if probs.dim() != 2:
        raise BayescliError(f"multi-label probabilities must be [N, K], got shape {list(probs.shape)}")
    if not bool(((probs >= 0) & (probs <= 1)).all()):  # also false for NaN
        raise BayescliError("multi-label probabilities must lie in [0, 1] (sigmoid outputs), found others")
    if y is None:
        return
    if y.shape != probs.shape:
        raise BayescliError(
            f"multi-label labels must match the probabilities' shape {list(probs.shape)}, got {list(y.shape)}"
        )
    if not bool(((y == 0) | (y == 1)).all()):
        raise BayescliError("multi-label labels must be 0 or 1 in every cell")


def _predict(probs: torch.Tensor, threshold: float) -> torch.Tensor:
    return probs >= threshold


def _truth(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return y.to(probs.device).bool()


def per_label_average_precision(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Average precision of each label ``[K]`` (float64), NaN for labels without positives."""
    truth = _truth(probs, y)
    out = torch.full((probs.shape[1],), math.nan, dtype=torch.float64, device=probs.device)
    for k in torch.nonzero(truth.any(0)).squeeze(1).tolist():
        out[k] = _average_precision(*_threshold_counts(probs[:, k].double(), truth[:, k]))
    return out


def mean_average_precision(probs: torch.Tensor, y: torch.Tensor) -> float:
    """mAP: mean of :func:`per_label_average_precision` over the labels with a positive."""
    ap = per_label_average_precision(probs, y)
    ap = ap[~ap.isnan()]
    if not len(ap):
        raise BayescliError("mAP needs at least one label with a positive example")
    return ap.mean().item()


def _confusion(
    probs: torch.Tensor, y: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-label true positives, false positives and false negatives ``([K], [K], [K])``."""
    pred, truth = _predict(probs, threshold), _truth(probs, y)
    tp = (pred & truth).sum(0).double()
    return tp, (pred & ~truth).sum(0).double(), (~pred & truth).sum(0).double()


def per_label_f1(probs: torch.Tensor, y: torch.Tensor, threshold: float = THRESHOLD) -> torch.Tensor:
    """``2 TP_k / (2 TP_k + FP_k + FN_k)`` ``[K]``; 0 where the denominator is 0."""
    tp, fp, fn = _confusion(probs, y, threshold)
    return 2 * tp / (2 * tp + fp + fn).clamp_min(1)  # denominator 0 means tp = 0: 0/1


def micro_f1(probs: torch.Tensor, y: torch.Tensor, threshold: float = THRESHOLD) -> float:
    """F1 of all ``N·K`` cells pooled (0 when there are neither true nor predicted positives)."""
    tp, fp, fn = (t.sum() for t in _confusion(probs, y, threshold))
    return (2 * tp / (2 * tp + fp + fn).clamp_min(1)).item()


def macro_f1(probs: torch.Tensor, y: torch.Tensor, threshold: float = THRESHOLD) -> float:
    """Mean of :func:`per_label_f1` over all labels."""
    return per_label_f1(probs, y, threshold).mean().item()


def hamming_loss(probs: torch.Tensor, y: torch.Tensor, threshold: float = THRESHOLD) -> float:
    """Fraction of the ``N·K`` cells predicted wrongly."""
    return (_predict(probs, threshold) != _truth(probs, y)).double().mean().item()


def subset_accuracy(probs: torch.Tensor, y: torch.Tensor, threshold: float = THRESHOLD) -> float:
    """Fraction of inputs whose every label is predicted right (exact match)."""
    return (_predict(probs, threshold) == _truth(probs, y)).all(-1).double().mean().item()


def per_label_nll(probs: torch.Tensor, y: torch.Tensor, log_odds: torch.Tensor | None = None) -> torch.Tensor:
    """Binary cross-entropy ``−mean_n log p(y_nk)`` of each label ``[K]`` (nats): from
    ``log_odds [N, K]`` (``p = σ(s)``) when given, exact where ``p`` rounds to 0 or 1; else from
    ``probs [N, K]``."""
    truth = _truth(probs, y)
    if log_odds is not None:
        s = log_odds.to(probs.device).double()
        return -torch.nn.functional.logsigmoid(torch.where(truth, s, -s)).mean(0)
    p = probs.double()
    return -torch.where(truth, p, 1 - p).clamp_min(PROB_TINY).log().mean(0)


def per_label_brier(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``mean_n (p_nk − y_nk)²`` of each label ``[K]``."""
    return (probs.double() - y.to(probs.device).double()).pow(2).mean(0)


def per_label_ece(probs: torch.Tensor, y: torch.Tensor, bins: int = ECE_BINS) -> torch.Tensor:
    """Binary reliability ECE of each label ``[K]``: ``Σ_b (n_b/N) |ȳ_b − p̄_b|`` over equal-width
    right-closed bins of ``p_k`` (``n_b |ȳ_b − p̄_b| = |Σ_{n∈b} (y_n − p_n)|``)."""
    p = probs.double()
    n, k = p.shape
    # one flat index per (label, bin), so a single index_add bins every label at once
    idx = (torch.ceil(p * bins) - 1).clamp(0, bins - 1).long() + bins * torch.arange(k, device=p.device)
    gap = p.new_zeros(k * bins).index_add(0, idx.reshape(-1), (y.to(p.device).double() - p).reshape(-1))
    return gap.view(k, bins).abs().sum(-1) / n


def binary_entropy(probs: torch.Tensor) -> torch.Tensor:
    """``H(p) = −p log p − (1−p) log(1−p)`` of every cell ``[N, K]`` (nats; 0 at p ∈ {0, 1})."""
    p = probs.double()
    q = 1 - p
    return -(p * p.clamp_min(1e-30).log() + q * q.clamp_min(1e-30).log())


def multilabel_summary(
    probs: torch.Tensor, y: torch.Tensor, threshold: float = THRESHOLD, log_odds: torch.Tensor | None = None
) -> dict:
    """The scalars ``map``, ``micro_f1``, ``macro_f1``, ``hamming_loss``, ``subset_accuracy``,
    ``nll``, ``brier``, ``ece`` (means over labels) and ``mean_entropy`` (mean over cells), with
    ``per_label`` lists ``positives``, ``average_precision`` (``None`` without positives),
    ``f1``, ``nll``, ``brier`` and ``ece``; the NLL from ``log_odds [N, K]`` when given
    (:func:`per_label_nll`)."""
    check_multilabel(probs, y)
    ap = per_label_average_precision(probs, y)
    per_label = {
        "positives": y.to(probs.device).long().sum(0),
        "f1": per_label_f1(probs, y, threshold),
        "nll": per_label_nll(probs, y, log_odds),
        "brier": per_label_brier(probs, y),
        "ece": per_label_ece(probs, y),
    }
    out: dict = {
        "map": mean_average_precision(probs, y),
        "micro_f1": micro_f1(probs, y, threshold),
        "macro_f1": per_label["f1"].mean().item(),
        "hamming_loss": hamming_loss(probs, y, threshold),
        "subset_accuracy": subset_accuracy(probs, y, threshold),
    }
    out |= {key: per_label[key].mean().item() for key in ("nll", "brier", "ece")}
    out["mean_entropy"] = binary_entropy(probs).mean().item()
    lists = {key: value.tolist() for key, value in per_label.items()}
    lists["average_precision"] = [None if math.isnan(a) else a for a in ap.tolist()]
    out["per_label"] = lists
    return out


def selective_confidence(probs: torch.Tensor) -> torch.Tensor:
    """``mean_k max(p_k, 1 − p_k)`` ``[N]``: the model's own expected fraction of right labels at
    threshold 0.5, i.e. one minus its expected Hamming loss. Other confidences (the negative
    mean binary entropy, a negative mutual information) go to :func:`selective` as ``confidence``."""
    p = probs.double()
    return torch.maximum(p, 1 - p).mean(-1)


def selective_curve(
    probs: torch.Tensor,
    y: torch.Tensor,
    confidence: torch.Tensor | None = None,
    threshold: float = THRESHOLD,
) -> dict[str, torch.Tensor]:
    """Risk–coverage curves ``[N]`` when the ``m`` most confident inputs are kept, ``m = 1..N``:
    ``coverage = m/N``, ``hamming_loss`` and ``subset_accuracy`` of the kept inputs.

    ``confidence [N]`` (higher = keep first) defaults to :func:`selective_confidence`; ties
    are kept in input order (a stable sort), so the curve is reproducible.
    """
    conf = selective_confidence(probs) if confidence is None else confidence.to(probs.device).double()
    if conf.shape != probs.shape[:1]:
        raise BayescliError(f"selective confidence must be [N = {len(probs)}], got {list(conf.shape)}")
    wrong = (_predict(probs, threshold) != _truth(probs, y))[conf.argsort(descending=True, stable=True)]
    kept = torch.arange(1, len(wrong) + 1, dtype=torch.float64, device=wrong.device)
    return {
        "coverage": kept / len(wrong),
        "hamming_loss": wrong.double().mean(-1).cumsum(0) / kept,
        "subset_accuracy": (~wrong.any(-1)).double().cumsum(0) / kept,
    }


def selective(
    probs: torch.Tensor,
    y: torch.Tensor,
    coverages: tuple[float, ...] = (0.5, 0.8, 0.9),
    confidence: torch.Tensor | None = None,
    threshold: float = THRESHOLD,
) -> dict[str, float]:
    """Subset accuracy and Hamming loss on the most confident ``⌈c·N⌉`` inputs for each coverage
    ``c`` (keys ``subset_accuracy_at_50``, ``hamming_loss_at_50``, ...), and the areas under the
    risk–coverage curves ``aurc_hamming = (1/N) Σ_m hamming(m)`` and
    ``aurc_subset = (1/N) Σ_m (1 − subset_accuracy(m))`` (lower is better), as
    :func:`bayescli.metrics.classification.selective` for single-label outputs."""
    check_multilabel(probs, y)
    curve = selective_curve(probs, y, confidence, threshold)
    n = len(probs)
    picks = [max(1, math.ceil(c * n)) - 1 for c in coverages]
    values = torch.stack(
        [
            *curve["subset_accuracy"][picks],
            *curve["hamming_loss"][picks],
            curve["hamming_loss"].mean(),
            (1 - curve["subset_accuracy"]).mean(),
        ]
    ).tolist()
    names = [f"subset_accuracy_at_{int(round(100 * c))}" for c in coverages]
    names += [f"hamming_loss_at_{int(round(100 * c))}" for c in coverages]
    return dict(zip([*names, "aurc_hamming", "aurc_subset"], values, strict=True))


def max_sigmoid(probs: torch.Tensor) -> torch.Tensor:
    """``max_k p_k`` ``[N]`` (higher = in-distribution: some label is confidently present)."""
    return probs.max(-1).values.double()


def joint_energy(logits: torch.Tensor) -> torch.Tensor:
    """JointEnergy (Wang et al. 2021) ``Σ_k log(1 + e^{f_k})`` ``[N]`` (higher = in-distribution).

    ``softplus(f) = max(f, 0) + log1p(e^{−|f|})`` is exact in float64 at any ``f`` (torch's
    ``softplus`` switches to ``f`` above 20, an error of ``e^{−20} ≈ 2e-9``).
    """
    f = logits.double()
    return (f.clamp_min(0) + torch.log1p(torch.exp(-f.abs()))).sum(-1)


def total_binary_entropy(probs: torch.Tensor) -> torch.Tensor:
    """``Σ_k H(p_k)`` ``[N]`` (nats; higher = more uncertain)."""
    return binary_entropy(probs).sum(-1)


def ood_scores(
    probs: torch.Tensor, logits: torch.Tensor | None = None, mutual_info: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Every multi-label OOD score ``[N]`` (float64), each oriented **higher = in-distribution**
    so that :func:`bayescli.metrics.classification.ood_metrics` takes it as is:

    * ``max_sigmoid``: ``max_k p_k``;
    * ``neg_total_entropy``: ``−Σ_k H(p_k)``;
    * ``joint_energy``: ``Σ_k softplus(f_k)`` (needs ``logits [N, K]``, e.g. the MAP network's);
    * ``neg_mi_sum`` / ``neg_mi_max``: ``−Σ_k I_k`` / ``−max_k I_k`` of the per-label mutual
      information ``mutual_info [N, K]`` (epistemic part of each label's binary entropy,
      computed by the posterior).
    """
    check_multilabel(probs)
    for name, extra in (("logits", logits), ("mutual information", mutual_info)):
        if extra is not None and extra.shape != probs.shape:
            raise BayescliError(
                f"multi-label {name} must match the probabilities' shape {list(probs.shape)}, "
                f"got {list(extra.shape)}"
            )
    out = {"max_sigmoid": max_sigmoid(probs), "neg_total_entropy": -total_binary_entropy(probs)}
    if logits is not None:
        out["joint_energy"] = joint_energy(logits)
    if mutual_info is not None:
        mi = mutual_info.double()
        out["neg_mi_sum"] = -mi.sum(-1)
        out["neg_mi_max"] = -mi.max(-1).values
    return out
