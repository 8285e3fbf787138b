"""Per-pixel metrics of segmentation predictions, streamed batch by batch.

Every pixel whose mask is not ``ignore_index`` is one input of the classification protocol
(:mod:`bayescli.metrics.classification`): pixel accuracy, NLL (exact from log-probabilities where
given), Brier (sum over classes, mean over pixels), ECE (15 equal-width right-closed bins of the
top-label confidence, confidence 1.0 in the last bin). Intersection-over-union per class
``IoU_k = TP_k / (TP_k + FP_k + FN_k)`` from the confusion matrix of arg-max predictions; mean IoU
averages the classes whose union is non-empty (a class neither present nor predicted is left out,
as mmsegmentation and the VOC/Cityscapes evaluations do).

:class:`SegmentationMetrics` keeps sums only (the ``[K, K]`` confusion counts, float64 NLL/Brier
sums, ECE bin sums) on the predictions' device; ignored pixels get weight 0 instead of being
filtered out, so no update waits for the device.
"""

from __future__ import annotations

import torch

from bayescli.errors import require
from bayescli.metrics.classification import ECE_BINS, log_probabilities

PROTOCOL = {
    "pixels": "every pixel whose mask is not ignore_index counts once",
    "mean_iou": "mean over classes with TP+FP+FN > 0 of TP/(TP+FP+FN), arg-max predictions",
    "ece_bins": ECE_BINS,
    "ece_binning": "equal-width, right-closed, top-label confidence, per pixel",
    "brier": "sum over classes, mean over pixels",
    "nll": "mean -log p(y) over pixels, exact",
}


class SegmentationMetrics:
    """Streamed per-pixel metrics of ``K``-class predictions against masks (module docs)."""

    def __init__(self, num_classes: int, ignore_index: int | None = 255, bins: int = ECE_BINS) -> None:
        self.k, self.ignore_index, self.bins = num_classes, ignore_index, bins
        self._sums: dict[str, torch.Tensor] | None = None

    def _zeros(self, device: torch.device) -> dict[str, torch.Tensor]:
        f64 = {"dtype": torch.float64, "device": device}
        return {
            "confusion": torch.zeros(self.k * self.k, dtype=torch.int64, device=device),  # [label·K + pred]
            "pixels": torch.zeros((), **f64),
            "nll": torch.zeros((), **f64),
            "brier": torch.zeros((), **f64),
            "bin_count": torch.zeros(self.bins, **f64),
            "bin_correct": torch.zeros(self.bins, **f64),
            "bin_conf": torch.zeros(self.bins, **f64),
        }

    def update(self, probs: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor | None = None) -> None:
        """Add a batch: ``probs [N, K, H, W]``, ``mask [N, H, W]`` (class indices or ``ignore_index``)
        and optionally the link's exact ``log_probs [N, K, H, W]`` (else the float64 log of ``probs``)."""
        require(
            probs.dim() == 4
            and probs.shape[1] == self.k
            and tuple(mask.shape) == (probs.shape[0], *probs.shape[2:]),
            f"segmentation metrics need probs [N, {self.k}, H, W] and masks [N, H, W]; got "
            f"{list(probs.shape)} and {list(mask.shape)}",
        )
        if self._sums is None:
            self._sums = self._zeros(probs.device)
        s = self._sums
        p = probs.double().permute(0, 2, 3, 1).reshape(-1, self.k)
        logp = (
            log_probabilities(p) if log_probs is None else log_probs.double().permute(0, 2, 3, 1)
        ).reshape(-1, self.k)
        labels = mask.reshape(-1).to(p.device)
        valid = (
            torch.ones_like(labels, dtype=torch.bool)
            if self.ignore_index is None
            else labels != self.ignore_index
        )
        weight = valid.double()
        y = torch.where(valid, labels, torch.zeros_like(labels))  # any class: its weight is 0
        conf, pred = p.max(-1)
        s["confusion"].index_add_(0, y * self.k + pred, valid.long())
        s["pixels"] += weight.sum()
        s["nll"] -= (logp.gather(1, y[:, None]).squeeze(1) * weight).sum()
        onehot = torch.nn.functional.one_hot(y, self.k).double()
        s["brier"] += ((p - onehot).pow(2).sum(-1) * weight).sum()
        idx = (torch.ceil(conf * self.bins) - 1).clamp(0, self.bins - 1).long()
        s["bin_count"].index_add_(0, idx, weight)
        s["bin_correct"].index_add_(0, idx, (pred == y).double() * weight)
        s["bin_conf"].index_add_(0, idx, conf * weight)

    def confusion(self) -> torch.Tensor:
        """Pixel counts ``[K, K]``: rows are the true classes, columns the arg-max predictions."""
        require(self._sums is not None, "no predictions were added")
        return self._sums["confusion"].reshape(self.k, self.k)

    def result(self) -> dict:
        """``pixels``, ``pixel_accuracy``, ``mean_iou``, ``iou`` (per class; ``None`` for a class with
        an empty union), ``nll``, ``brier``, ``ece`` and ``protocol``. Read once, at the end."""
        conf = self.confusion().double().cpu()
        s = {k: v.cpu() for k, v in self._sums.items()}
        n = float(s["pixels"])
        require(n > 0, "every pixel is ignored: no metric can be computed")
        tp = conf.diagonal()
        union = conf.sum(0) + conf.sum(1) - tp
        present = union > 0
        iou = [float(t / u) if u > 0 else None for t, u in zip(tp, union, strict=True)]
        return {
            "pixels": int(n),
            "pixel_accuracy": float(tp.sum()) / n,
            "mean_iou": float((tp[present] / union[present]).mean()),
            "iou": iou,
            "nll": float(s["nll"]) / n,
            "brier": float(s["brier"]) / n,
            "ece": float((s["bin_correct"] - s["bin_conf"]).abs().sum()) / n,
            "protocol": dict(PROTOCOL, ignore_index=self.ignore_index),
        }
