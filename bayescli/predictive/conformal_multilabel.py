"""Per-label split conformal sets for multi-label outputs ``probs [N, K]`` (``p_k = P(y_k = 1)``).

Each label ``k`` is its own binary problem with the LAC score ``s(x, v) = 1 − p(v)``, where
``p(1) = p_k`` and ``p(0) = 1 − p_k``. On ``n`` labelled calibration inputs the threshold
``q̂_k`` is the ``⌈(n+1)(1−α)⌉``-th smallest ``s(x_i, y_ik)``
(:func:`bayescli.predictive.conformal.threshold`), and the set of a test input is
``C_k(x) = {v ∈ {0, 1} : s(x, v) ≤ q̂_k}``: one of ∅, {0}, {1}, {0, 1}.

Guarantee, per label and marginal over calibration and test draws (exchangeable inputs):
``P(y_k ∈ C_k(x)) ≥ 1 − α``, and ``≤ 1 − α + 1/(n+1)`` when the scores have no ties. Nothing
is claimed for the whole label vector (``P(y ∈ C_1 × … × C_K)`` can be as low as ``1 − Kα``).

Sets are stored as ``bool [N, K, 2]``, index ``v`` of the last axis = value ``v``. Since
``s(x, 0) + s(x, 1) = 1``, a set is ∅ only when ``q̂_k < 1/2`` and both values score above it,
and {0, 1} only when ``q̂_k ≥ max(p, 1 − p)``; ``p = 1/2`` gives ∅ or {0, 1}, never a singleton.
"""

from __future__ import annotations

import torch

from bayescli.errors import BayescliError
from bayescli.metrics.multilabel import check_multilabel
from bayescli.predictive.conformal import coverage_interval, threshold


def value_scores(probs: torch.Tensor) -> torch.Tensor:
    """``s(x, v) = 1 − p(v)`` for ``v = 0, 1`` ``[N, K, 2]`` (float64).

    Calibration reads its scores from here too, so a calibration score and the test score of
    the same ``(p, v)`` are the same float (``1 − (1 − p)`` need not equal ``p`` in rounding).
    """
    p = probs.double()
    return 1 - torch.stack([1 - p, p], dim=-1)


def calibrate_per_label(probs_cal: torch.Tensor, y_cal: torch.Tensor, alpha: float) -> torch.Tensor:
    """``q̂ [K]`` (float64, on the device of ``probs_cal``) from calibration ``probs_cal [n, K]``
    and ``y_cal [n, K]`` in {0, 1} at miscoverage ``alpha`` ∈ (0, 1)."""
    if not 0 < alpha < 1:
        raise BayescliError(f"conformal alpha must be in (0, 1), got {alpha}")
    check_multilabel(probs_cal, y_cal)
    observed = y_cal.to(probs_cal.device).long().unsqueeze(-1)
    scores = value_scores(probs_cal).gather(-1, observed).squeeze(-1)  # [n, K]
    # the scores are read once on the host: K rank selections would each sync a device
    q = [threshold(column, alpha) for column in scores.cpu().T]
    return torch.tensor(q, dtype=torch.float64, device=probs_cal.device)


def per_label_sets(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Membership ``bool [N, K, 2]`` of each value ``v`` in each label's set: ``1 − p(v) ≤ q̂_k``,
    for ``q [K]`` from :func:`calibrate_per_label` (float64: a float32 ``q̂`` is off by ~1e-8)."""
    check_multilabel(probs)
    if q.shape != probs.shape[1:]:
        raise BayescliError(
            f"per-label thresholds must be [K = {probs.shape[1]}] like the probabilities, got {list(q.shape)}"
        )
    return value_scores(probs) <= q.to(probs.device).double()[:, None]


def per_label_summary(sets: torch.Tensor, y: torch.Tensor | None) -> dict:
    """Per label (lists over ``K``): ``mean_size``, ``singleton`` and ``empty`` fractions; with
    labels also ``coverage`` (``y_k ∈ C_k``) and its 95 % Clopper–Pearson ``coverage_ci`` (the test
    inputs are a finite sample). Top-level scalars average those lists over labels (the sizes are
    also the mean over all ``N·K`` sets, every label having ``N`` of them)."""
    if sets.dim() != 3 or sets.shape[-1] != 2 or sets.dtype != torch.bool:
        raise BayescliError(f"per-label sets must be bool [N, K, 2], got {sets.dtype} {list(sets.shape)}")
    sets = sets.cpu()  # N·K·2 booleans, summarised once on the host
    sizes = sets.sum(-1)
    per_label: dict = {
        "mean_size": sizes.double().mean(0),
        "singleton": (sizes == 1).double().mean(0),
        "empty": (sizes == 0).double().mean(0),
    }
    if y is not None:
        if y.shape != sets.shape[:2]:
            raise BayescliError(
                f"labels must be [N, K] = {list(sets.shape[:2])} like the sets, got {list(y.shape)}"
            )
        y = y.cpu().long()
        if not bool(((y == 0) | (y == 1)).all()):
            raise BayescliError("multi-label labels must be 0 or 1 in every cell")
        hit = sets.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        hits = hit.sum(0).tolist()
        per_label["coverage"] = hit.double().mean(0)
        per_label["coverage_ci"] = [coverage_interval(h, len(hit)) for h in hits]
    out: dict = {
        key: value.mean().item() for key, value in per_label.items() if isinstance(value, torch.Tensor)
    }
    out["per_label"] = {
        key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in per_label.items()
    }
    return out
