"""Metric functions on predicted probabilities ``probs [N, K]`` and labels ``y [N]``.

Protocol (DESIGN §4, recorded in every report): NLL is the mean negative log-probability of the
true class (probabilities clamped at 1e-12); Brier is Σ_k (p_k − y_k)² averaged over inputs;
ECE uses 15 equal-width bins of the top-label confidence, right-closed ``(lo, hi]`` with
confidence 1.0 in the last bin; MMC is the mean max probability; entropy is in nats.
"""

from __future__ import annotations

import torch

ECE_BINS = 15
PROTOCOL = {
    "ece_bins": ECE_BINS,
    "ece_binning": "equal-width, right-closed, top-label confidence",
    "brier": "sum over classes, mean over inputs",
    "nll": "mean -log p(y), p clamped at 1e-12",
    "entropy": "nats",
}


def accuracy(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of inputs whose arg-max class is the label."""
    return (probs.argmax(-1) == y).double().mean().item()


def nll(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Mean negative log-likelihood of the labels."""
    p = probs.double().gather(1, y.view(-1, 1)).clamp_min(1e-12)
    return -p.log().mean().item()


def brier(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Σ_k (p_k − 1[y=k])², averaged over inputs (range [0, 2])."""
    onehot = torch.nn.functional.one_hot(y, probs.shape[-1]).double()
    return (probs.double() - onehot).pow(2).sum(-1).mean().item()


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Predictive entropy per input ``[N]`` (nats)."""
    p = probs.double()
    return -(p * p.clamp_min(1e-30).log()).sum(-1)


def mmc(probs: torch.Tensor) -> float:
    """Mean max confidence."""
    return probs.max(-1).values.double().mean().item()


def ece(probs: torch.Tensor, y: torch.Tensor, bins: int = ECE_BINS) -> float:
    """Expected calibration error: Σ_b (n_b/N)·|acc_b − conf_b| over equal-width confidence bins."""
    conf, pred = probs.double().max(-1)
    correct = (pred == y).double()
    idx = (torch.ceil(conf * bins) - 1).clamp(0, bins - 1).long()
    acc_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, correct)
    conf_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, conf)
    return ((acc_sum - conf_sum).abs().sum() / len(conf)).item()


def classification_summary(probs: torch.Tensor, y: torch.Tensor | None) -> dict[str, float]:
    """Accuracy, NLL, Brier, ECE (when labels are known), MMC and mean entropy."""
    out: dict[str, float] = {}
    if y is not None:
        out |= {
            "accuracy": accuracy(probs, y),
            "nll": nll(probs, y),
            "brier": brier(probs, y),
            "ece": ece(probs, y),
        }
    out |= {"mmc": mmc(probs), "entropy": entropy(probs).mean().item()}
    return out
