"""Per-label split conformal sets: thresholds and sets against a direct loop, the guaranteed
coverage band on exchangeable data drawn from a calibrated model, set semantics at the edges,
the summary against counting, and the errors users see."""

import math

import numpy as np
import pytest
import torch
from tolerance import assert_below, assert_close

from bayescli.errors import BayescliError
from bayescli.predictive import conformal_multilabel as cml
from bayescli.predictive.conformal import coverage_interval

F64 = 1e-12  # means of ≤ 1e3 booleans: rounding ≤ 1e-13


def _score(p: float, v: int) -> float:
    """``1 − p(v)`` with ``p(1) = p`` and ``p(0) = 1 − p``, one cell at a time."""
    return 1 - (p if v == 1 else 1 - p)


def test_thresholds_and_sets_against_a_loop():
    rng = np.random.default_rng(0)
    n, k, alpha = 57, 4, 0.15
    p = rng.random((n + 30, k))
    p[:5, 1] = 0.5  # ties, at the point where both values score the same
    y = (rng.random(p.shape) < p).astype(np.int64)
    q = cml.calibrate_per_label(torch.from_numpy(p[:n]), torch.from_numpy(y[:n]), alpha)
    rank = math.ceil((n + 1) * (1 - alpha))
    expected = [sorted(_score(p[i, j], y[i, j]) for i in range(n))[rank - 1] for j in range(k)]
    assert q.dtype == torch.float64 and q.tolist() == expected  # the same float operations
    sets = cml.per_label_sets(torch.from_numpy(p[n:]), q)
    loop = [[[_score(row[j], v) <= expected[j] for v in (0, 1)] for j in range(k)] for row in p[n:]]
    assert sets.dtype == torch.bool and sets.tolist() == loop


def _coverage_runs(p_of_label, splits: int, n_cal: int, n_test: int, alpha: float) -> np.ndarray:
    """Test coverage ``[splits, K]`` of each label over seeded splits; labels ``y ~ Bernoulli(p)``
    (the model is calibrated, so calibration and test points are exchangeable)."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(splits):
        p = p_of_label(rng, n_cal + n_test)
        y = (rng.random(p.shape) < p).astype(np.int64)
        probs, labels = torch.from_numpy(p), torch.from_numpy(y)
        q = cml.calibrate_per_label(probs[:n_cal], labels[:n_cal], alpha)
        summary = cml.per_label_summary(cml.per_label_sets(probs[n_cal:], q), labels[n_cal:])
        out.append(summary["per_label"]["coverage"])
    return np.asarray(out)


def _continuous(rng: np.random.Generator, n: int) -> np.ndarray:
    """Four labels unlike each other: uniform, confident (Beta(0.3, 0.3)), rare (sigmoid of
    N(−2, 1)) and near-coin-flip (U(0.4, 0.6)); continuous, so the scores have no ties."""
    return np.stack(
        [
            rng.random(n),
            rng.beta(0.3, 0.3, n),
            1 / (1 + np.exp(-rng.normal(-2, 1, n))),
            rng.uniform(0.4, 0.6, n),
        ],
        axis=1,
    )


def test_per_label_coverage_in_the_finite_sample_band():
    """The guarantee per label: mean coverage over calibration draws in ``[1−α, 1−α + 1/(n+1)]``.
    With n = 19 and α = 0.125 it is exactly ⌈20·0.875⌉/20 = 0.9 (continuous scores), the middle
    of the band [0.875, 0.925]. Each split's coverage spreads as Beta(18, 2) (sd 0.066) plus the
    500 test points' binomial noise (sd 0.013): over 300 splits the mean has a standard error
    ≈ 0.0039. The band is widened by 3 measured standard errors, and the mean must also lie within
    4 standard errors of the exact 0.9 (an off-by-one rank moves it by 0.05 ≈ 13 SE)."""
    n_cal, alpha, splits = 19, 0.125, 300
    cov = _coverage_runs(_continuous, splits, n_cal, 500, alpha)
    mean, se = cov.mean(0), cov.std(0, ddof=1) / math.sqrt(splits)
    low, high, exact = (
        1 - alpha,
        1 - alpha + 1 / (n_cal + 1),
        math.ceil((n_cal + 1) * (1 - alpha)) / (n_cal + 1),
    )
    for j in range(cov.shape[1]):
        assert low - 3 * se[j] <= mean[j] <= high + 3 * se[j], f"label {j}: {mean[j]:.4f} ± {se[j]:.4f}"
        assert_below(abs(mean[j] - exact), 4 * se[j], what=f"label {j}: mean coverage − exact 0.9")


def test_coverage_lower_bound_holds_with_tied_scores():
    """Probabilities on {0.2, 0.5, 0.8}: the scores tie, so only ``≥ 1 − α`` is guaranteed (sets
    include whole tied groups and over-cover). n = 49, α = 0.1; 300 splits of 500 test points."""

    def tied(rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice([0.2, 0.5, 0.8], size=(n, 2))

    cov = _coverage_runs(tied, 300, 49, 500, 0.1)
    mean, se = cov.mean(0), cov.std(0, ddof=1) / math.sqrt(len(cov))
    assert (mean >= 0.9 - 3 * se).all(), f"coverage {mean} below 0.9 − 3·{se}"


def test_set_semantics_at_the_edges():
    half = torch.full((3, 1), 0.5, dtype=torch.float64)
    # p = 1/2: both values score 1/2, so the set is {0, 1} or ∅, never a singleton
    assert cml.per_label_sets(half, torch.tensor([0.5], dtype=torch.float64)).all()
    assert not cml.per_label_sets(half, torch.tensor([0.5 - 1e-9], dtype=torch.float64)).any()
    p = torch.tensor([[0.0, 1.0, 0.25]], dtype=torch.float64)
    # q̂ = 1/4 (exact in binary): the values with p(v) ≥ 3/4 are in, p(v) = 3/4 included
    assert cml.per_label_sets(p, torch.full((3,), 0.25, dtype=torch.float64)).tolist() == [
        [[True, False], [False, True], [True, False]]
    ]

    # α = 2⁻¹⁰ and 1 − 2⁻¹⁰ with n = 1023: (n+1)(1−α) is exact in binary, so the ranks are n and 1
    # (with α = 0.999, 1 − α rounds to 0.0010000000000000009 and ⌈1000·(1−α)⌉ = 2)
    # 1 − (1 − p) ≠ p in float64 for these p: calibration and sets must score the same way, or
    # a calibration point at q̂ falls out of its own set
    p_cal = torch.tensor([[0.1], [0.2], [0.3]], dtype=torch.float64)
    q = cml.calibrate_per_label(p_cal, torch.zeros(3, 1, dtype=torch.long), 0.25)  # rank ⌈4·0.75⌉ = 3
    assert cml.per_label_sets(p_cal, q)[:, 0, 0].all()

    rng = np.random.default_rng(2)
    n, tiny = 1023, 2.0**-10
    probs = torch.from_numpy(rng.random((n, 3)))
    labels = (
        torch.rand(n, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64) < probs
    ).long()
    scores = cml.value_scores(probs).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    # α → 0: the largest calibration score; every calibration label is in its set
    q = cml.calibrate_per_label(probs, labels, tiny)
    assert torch.equal(q, scores.max(0).values)
    assert cml.per_label_sets(probs, q).gather(-1, labels.unsqueeze(-1)).all()
    with pytest.raises(BayescliError, match="calibration points"):
        cml.calibrate_per_label(probs[:-1], labels[:-1], tiny)  # rank 1023 > n = 1022
    # α → 1: the smallest calibration score; almost every set is empty
    q = cml.calibrate_per_label(probs, labels, 1 - tiny)
    assert torch.equal(q, scores.min(0).values)
    summary = cml.per_label_summary(cml.per_label_sets(probs, q), labels)
    assert summary["empty"] > 0.99 and summary["coverage"] < 0.01
    assert summary["mean_size"] < 0.01


def test_summary_against_counting():
    rng = np.random.default_rng(3)
    sets = rng.random((400, 3, 2)) < np.array([0.3, 0.6, 0.9])[None, :, None]
    y = rng.integers(0, 2, (400, 3))
    out = cml.per_label_summary(torch.from_numpy(sets), torch.from_numpy(y))
    sizes = sets.sum(-1)
    hit = np.take_along_axis(sets, y[..., None], -1)[..., 0]
    per = out["per_label"]
    assert_close(per["mean_size"], sizes.mean(0), atol=F64, what="mean size per label")
    assert_close(per["singleton"], (sizes == 1).mean(0), atol=F64, what="singletons per label")
    assert_close(per["empty"], (sizes == 0).mean(0), atol=F64, what="empty sets per label")
    assert_close(per["coverage"], hit.mean(0), atol=F64, what="coverage per label")
    assert per["coverage_ci"] == [coverage_interval(int(h), 400) for h in hit.sum(0)]
    for key in ("mean_size", "singleton", "empty", "coverage"):
        assert_close(out[key], np.mean(per[key]), atol=F64, what=f"mean {key} over labels")
    assert_close(out["mean_size"], sizes.mean(), atol=F64, what="mean size over all sets")
    unlabelled = cml.per_label_summary(torch.from_numpy(sets), None)
    assert set(unlabelled) == {"mean_size", "singleton", "empty", "per_label"}
    assert set(unlabelled["per_label"]) == {"mean_size", "singleton", "empty"}


def test_bad_inputs_raise_one_line():
    p = torch.full((10, 3), 0.4, dtype=torch.float64)
    y = torch.zeros(10, 3, dtype=torch.long)
    sets = torch.ones(10, 3, 2, dtype=torch.bool)
    cases = [
        (lambda: cml.calibrate_per_label(p, y, 0.0), "alpha"),
        (lambda: cml.calibrate_per_label(p, y, 1.0), "alpha"),
        (lambda: cml.calibrate_per_label(p[:, 0], y[:, 0], 0.2), "\\[N, K\\]"),
        (lambda: cml.calibrate_per_label(p, y[:, :2], 0.2), "shape"),
        (lambda: cml.calibrate_per_label(p, y + 2, 0.2), "0 or 1"),
        (lambda: cml.calibrate_per_label(p * 3, y, 0.2), "\\[0, 1\\]"),
        (lambda: cml.per_label_sets(p, torch.zeros(2)), "thresholds"),
        (lambda: cml.per_label_summary(sets[..., 0], y), "\\[N, K, 2\\]"),
        (lambda: cml.per_label_summary(sets.long(), y), "bool"),
        (lambda: cml.per_label_summary(sets, y[:5]), "labels"),
        (lambda: cml.per_label_summary(sets, y - 1), "0 or 1"),
    ]
    for call, pattern in cases:
        with pytest.raises(BayescliError, match=pattern) as info:
            call()
        assert "\n" not in str(info.value)
