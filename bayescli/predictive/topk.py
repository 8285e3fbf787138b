"""Uncertainty-aware top-k (seed 004, Algorithm 1) and its summary.

Sort ``α`` descending (``α̃``); class ``i`` joins the set while the upper ``T/2`` quantile of its
Beta marginal ``Beta(α̃_i, α₀ − α̃_i)`` exceeds the lower ``T/2`` quantile of the previous class's
marginal; the first failure stops the scan. At least one class, at most ``max_k``.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.special import betaincinv


def topk_sizes(
    alpha: torch.Tensor, threshold: float = 0.05, max_k: int = 10
) -> tuple[np.ndarray, np.ndarray]:
    """``(order [N, max_k], k [N])``: classes by descending ``α`` and each input's set size."""
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    a = alpha.double().cpu().numpy()
    kmax = max(1, min(int(max_k), a.shape[1]))
    order = np.argsort(-a, axis=1, kind="stable")[:, :kmax]
    a_sorted = np.take_along_axis(a, order, axis=1)
    rest = a.sum(1, keepdims=True) - a_sorted
    lower = betaincinv(a_sorted[:, :-1], rest[:, :-1], threshold / 2)  # l_{i-1}
    upper = betaincinv(a_sorted[:, 1:], rest[:, 1:], 1 - threshold / 2)  # r_i
    overlap = upper > lower  # [N, kmax-1]: class i+1 overlaps class i
    k = 1 + np.cumprod(overlap, axis=1).sum(1) if kmax > 1 else np.ones(len(a), dtype=int)
    return order, k.astype(np.int64)


def uncertainty_topk(alpha: torch.Tensor, threshold: float = 0.05, max_k: int = 10) -> list[torch.Tensor]:
    """Algorithm 1 for each row of ``alpha [N, K]``: a list of class-index tensors (best first)."""
    order, k = topk_sizes(alpha, threshold, max_k)
    return [torch.from_numpy(order[i, : k[i]].copy()) for i in range(len(k))]


def topk_summary(
    sets: list[torch.Tensor], probs: torch.Tensor, labels: torch.Tensor | None, max_k: int = 10
) -> dict:
    """Set sizes (mean, histogram 1..max_k) and, with labels, top-1 accuracy, set accuracy
    (label ∈ set) and fixed top-k accuracy for k = 1..5."""
    sizes = np.array([len(s) for s in sets])
    out: dict = {
        "mean_k": float(sizes.mean()),
        "k_histogram": {str(i): int((sizes == i).sum()) for i in range(1, max_k + 1)},
    }
    if labels is not None:
        y = labels.cpu().numpy()
        out["top1_accuracy"] = float((probs.argmax(-1).cpu().numpy() == y).mean())
        out["set_accuracy"] = float(np.mean([int(y[i]) in set(s.tolist()) for i, s in enumerate(sets)]))
        ranked = probs.argsort(-1, descending=True).cpu().numpy()
        out["fixed_topk_accuracy"] = {
            str(k): float((ranked[:, :k] == y[:, None]).any(1).mean())
            for k in range(1, min(5, probs.shape[1]) + 1)
        }
    return out
