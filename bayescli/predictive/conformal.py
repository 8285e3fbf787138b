"""Split conformal prediction sets from any method's probabilities ``probs [N, K]``.

A non-conformity score ``s(x, y)`` (larger = less plausible) is computed on a labelled
calibration split of ``n`` points; the threshold ``q̂`` is the ``⌈(n+1)(1−α)⌉``-th smallest
calibration score, and the set of a test input is ``{y : s(x, y) ≤ q̂}``. With exchangeable
calibration and test points (and no ties) coverage lies in ``[1−α, 1−α + 1/(n+1)]`` on average.

Scores, with classes ranked by descending probability (rank ``r(y)``, 1-based, ties by index):

* ``lac`` (least ambiguous classifier, Sadinle et al. 2019): ``1 − p_y``.
* ``aps`` (Romano et al. 2020), not randomised: ``Σ_{r(j) ≤ r(y)} p_j``.
* ``aps-random``: ``Σ_{r(j) < r(y)} p_j + u·p_y`` with ``u ~ U(0, 1)`` drawn once per input.
* ``raps`` (Angelopoulos et al. 2021), randomised: ``aps-random + λ·max(0, r(y) − k_reg)``.

Randomised scores give sets that can be empty (exact coverage); every score here is
non-decreasing along the ranking, so each set is the top-``m`` classes for some ``m``.

:class:`TopkCurve` puts uncertainty-aware top-k (seed 004) beside a conformal set at the same
mean set size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
from scipy.special import betaincinv

from bayescli.errors import BayescliError
from bayescli.predictive.topk import overlap_levels, sorted_marginals

T_RANGE = (1e-12, 1 - 1e-9)  # overlap levels searched by TopkCurve


class ConformalScore(str, Enum):
    LAC = "lac"
    APS = "aps"
    APS_RANDOM = "aps-random"
    RAPS = "raps"


@dataclass(frozen=True)
class ConformalConfig:
    """Score, miscoverage ``alpha`` and the RAPS penalty ``lam`` beyond rank ``k_reg``."""

    score: ConformalScore = ConformalScore.APS_RANDOM
    alpha: float = 0.1
    lam: float = 0.01
    k_reg: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise BayescliError(f"conformal alpha must be in (0, 1), got {self.alpha}")
        if self.lam < 0 or self.k_reg < 0:
            raise BayescliError(f"RAPS needs lambda ≥ 0 and k_reg ≥ 0, got {self.lam}, {self.k_reg}")

    @property
    def randomised(self) -> bool:
        return self.score in (ConformalScore.APS_RANDOM, ConformalScore.RAPS)

    def info(self) -> dict:
        out: dict = {"score": self.score.value, "alpha": self.alpha, "randomised": self.randomised}
        if self.score is ConformalScore.RAPS:
            out |= {"lambda": self.lam, "k_reg": self.k_reg}
        return out


def label_scores(probs: torch.Tensor, cfg: ConformalConfig, u: torch.Tensor | None = None) -> torch.Tensor:
    """The score of every candidate label ``[N, K]`` (float64); ``u [N]`` for randomised scores."""
    p = probs.double()
    if cfg.score is ConformalScore.LAC:
        return 1 - p
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
    inclusive = sorted_p.cumsum(-1)
    if cfg.randomised:
        if u is None:
            raise ValueError("randomised scores need u")
        by_rank = inclusive - sorted_p + u.double()[:, None] * sorted_p
    else:
        by_rank = inclusive
    if cfg.score is ConformalScore.RAPS:
        ranks = torch.arange(1, p.shape[-1] + 1, dtype=torch.float64, device=p.device)
        by_rank = by_rank + cfg.lam * (ranks - cfg.k_reg).clamp_min(0)
    return torch.empty_like(by_rank).scatter_(-1, order, by_rank)


def true_label_scores(
    probs: torch.Tensor, labels: torch.Tensor, cfg: ConformalConfig, u: torch.Tensor | None = None
) -> torch.Tensor:
    """``label_scores(...)`` at the labels only ``[N]``, without sorting: the classes ranked
    before ``y`` are those with a larger probability, or an equal one and a smaller index."""
    p = probs.double()
    labels = labels.to(p.device)
    p_y = p.gather(1, labels.view(-1, 1))
    if cfg.score is ConformalScore.LAC:
        return 1 - p_y.squeeze(1)
    index = torch.arange(p.shape[1], device=p.device)
    before = (p > p_y) | ((p == p_y) & (index < labels.view(-1, 1)))
    if cfg.randomised and u is None:
        raise ValueError("randomised scores need u")
    weight = u.double() if cfg.randomised else 1.0
    score = (p * before).sum(-1) + weight * p_y.squeeze(1)
    if cfg.score is ConformalScore.RAPS:
        rank = before.sum(-1).double() + 1  # float64: int · float would give float32
        score = score + cfg.lam * (rank - cfg.k_reg).clamp_min(0)
    return score


def uniforms(n: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The seeded ``U(0, 1)`` draws of randomised scores ``[n]`` (drawn on the host, so a seed gives
    the same sets on every device; ``n`` floats are a negligible copy)."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device)


def threshold(cal_scores: torch.Tensor, alpha: float) -> float:
    """``q̂``: the ``⌈(n+1)(1−α)⌉``-th smallest of ``cal_scores [n]``."""
    n = len(cal_scores)
    rank = math.ceil((n + 1) * (1 - alpha))
    if rank > n:
        raise BayescliError(
            f"{n} calibration points cannot give {1 - alpha:.0%} coverage with finite sets; "
            f"use at least {math.ceil(1 / alpha) - 1} points or a larger alpha"
        )
    return cal_scores.double().kthvalue(rank).values.item()


def calibrate(probs: torch.Tensor, labels: torch.Tensor, cfg: ConformalConfig, seed: int = 0) -> float:
    """``q̂`` from calibration ``probs [n, K]`` and ``labels [n]``."""
    if labels is None:
        raise BayescliError("conformal calibration needs labelled data")
    u = uniforms(len(probs), seed, probs.device) if cfg.randomised else None
    return threshold(true_label_scores(probs, labels, cfg, u), cfg.alpha)


def prediction_sets(probs: torch.Tensor, q_hat: float, cfg: ConformalConfig, seed: int = 1) -> torch.Tensor:
    """Membership ``[N, K]`` (bool) of each class in each input's set."""
    u = uniforms(len(probs), seed, probs.device) if cfg.randomised else None
    return label_scores(probs, cfg, u) <= q_hat


COVERAGE_LEVEL = 0.95


def coverage_interval(hits: int, n: int, level: float = COVERAGE_LEVEL) -> list[float]:
    """Clopper–Pearson (exact binomial) ``level`` interval ``[lo, hi]`` for a coverage of
    ``hits`` of ``n`` test points: ``lo`` = the ``(1−level)/2`` quantile of Beta(hits, n−hits+1),
    ``hi`` = the ``(1+level)/2`` quantile of Beta(hits+1, n−hits) (0 and 1 at the ends)."""
    if n <= 0:
        return [0.0, 1.0]
    tail = (1 - level) / 2
    lo = 0.0 if hits <= 0 else float(betaincinv(hits, n - hits + 1, tail))
    hi = 1.0 if hits >= n else float(betaincinv(hits + 1, n - hits, 1 - tail))
    return [lo, hi]


def set_summary(sets: torch.Tensor, labels: torch.Tensor | None) -> dict:
    """Mean size, size histogram ``{size: count}``; with labels also coverage with its 95 %
    Clopper–Pearson interval ``coverage_ci`` (the test points are a finite sample), coverage by
    set size and by class (sizes or classes without inputs are left out)."""
    sets = sets.cpu()  # a summary of N booleans per class: read once on the host
    sizes = sets.sum(-1)
    k = sets.shape[-1]
    counts = torch.bincount(sizes, minlength=k + 1)
    out: dict = {
        "mean_size": sizes.double().mean().item(),
        "size_histogram": {str(s): int(c) for s, c in enumerate(counts.tolist()) if c},
    }
    if labels is not None:
        labels = labels.cpu()
        hit = sets.gather(1, labels.view(-1, 1)).squeeze(1).double()
        out["coverage"] = hit.mean().item()
        out["coverage_ci"] = coverage_interval(int(hit.sum().item()), len(hit))
        by_size = torch.zeros(k + 1, dtype=torch.float64).index_add_(0, sizes, hit)
        out["coverage_by_size"] = {str(s): by_size[s].item() / c for s, c in enumerate(counts.tolist()) if c}
        per_class = torch.bincount(labels, minlength=k)
        by_class = torch.zeros(k, dtype=torch.float64).index_add_(0, labels, hit)
        out["coverage_by_class"] = {
            str(c): by_class[c].item() / n for c, n in enumerate(per_class.tolist()) if n
        }
    return out


class TopkCurve:
    """Uncertainty-aware top-k (seed 004 Alg. 1) as a function of its overlap level ``T``.

    Class ``i+1`` (by descending ``α``) overlaps class ``i`` while ``T < T*_i``: the upper
    ``T/2`` quantile of its Beta marginal decreases and the lower one of class ``i`` increases
    with ``T``. With ``m_j = min_{i ≤ j} T*_i`` the set size is ``k(T) = 1 + #{j : m_j > T}``,
    so the ``T`` that gives any mean set size is read off the sorted ``m``
    (:func:`~bayescli.predictive.topk.overlap_levels` finds every ``T*_i`` at once, ``O(NK)`` at
    any ``α``).
    """

    def __init__(self, alpha: torch.Tensor, labels: torch.Tensor | None, max_k: int = 20):
        self.order, marg = sorted_marginals(alpha, max_k)
        self.kmax = self.order.shape[1]
        t_star = overlap_levels(marg, T_RANGE) if self.kmax > 1 else np.zeros((len(self.order), 0))
        self.critical = np.minimum.accumulate(t_star, axis=1)  # m_j [N, kmax-1]
        self.labels = None if labels is None else labels.cpu().numpy()

    def sizes(self, t: float) -> np.ndarray:
        """Set size of every input at overlap level ``t`` ``[N]``."""
        return 1 + (self.critical > t).sum(1)

    def at_mean_size(self, mean_size: float) -> dict:
        """``T`` whose mean set size is closest to ``mean_size``, that size and, with labels,
        the coverage (label ∈ set)."""
        n = len(self.critical)
        # Σ_n (k_n(T) − 1) = #{m > T}: with the distinct m in descending order v_1 > v_2 > …, any
        # T in (v_{i+1}, v_i) gives the mean size 1 + (count of m ≥ v_i)/n
        values, counts = np.unique(self.critical.ravel(), return_counts=True)
        values, counts = values[::-1], counts[::-1]
        reachable = 1 + np.concatenate([[0], np.cumsum(counts)]) / n
        i = int(np.abs(reachable - mean_size).argmin())
        upper = values[i - 1] if i > 0 else T_RANGE[1]
        lower = values[i] if i < len(values) else T_RANGE[0]
        t = math.sqrt(max(lower, T_RANGE[0]) * min(upper, T_RANGE[1]))
        k = self.sizes(t)
        out = {"threshold": t, "mean_size": float(k.mean()), "max_k": self.kmax}
        if self.labels is not None:
            inside = (self.order == self.labels[:, None]) & (np.arange(self.kmax)[None, :] < k[:, None])
            out["coverage"] = float(inside.any(1).mean())
        return out
