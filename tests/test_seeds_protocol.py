"""The seed-claim benchmark's protocol helpers (benchmarks/seeds_glm.py): seed 004's prior rule
(the δ whose validation MMC is closest to a target), per-method δ selection by validation NLL,
the count of choices at a grid's edge and the mean ± standard error over splits."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from seeds_glm import GLM_BNN_GRID, edge_counts, mean_se, mmc_matched_delta, select_by_nll  # noqa: E402


def test_mmc_matched_delta_picks_the_closest_grid_value() -> None:
    # MMC falls with the posterior's spread, i.e. rises with δ: 1 − 1/(1 + δ).
    grid = [0.1, 1.0, 3.0, 10.0, 100.0]
    calls: list[float] = []

    def mmc_at(d: float) -> float:
        calls.append(d)
        return 1 - 1 / (1 + d)

    values = np.array([1 - 1 / (1 + d) for d in grid])
    for target in (0.05, 0.5, 0.74, 0.76, 0.93, 0.999):
        calls.clear()
        delta, got = mmc_matched_delta(grid, mmc_at, target)
        i = int(np.argmin(np.abs(values - target)))  # brute force
        assert delta == grid[i] and got == pytest.approx(values[i], abs=1e-12)
        assert calls == grid  # one evaluation per grid value


def test_mmc_matched_delta_ties_go_to_the_first() -> None:
    delta, got = mmc_matched_delta([1.0, 2.0, 3.0], {1.0: 0.8, 2.0: 0.9, 3.0: 1.0}.__getitem__, 0.85)
    assert (delta, got) == (1.0, 0.8)


def test_select_by_nll_uses_the_validation_rows_only() -> None:
    gen = torch.Generator().manual_seed(0)
    y_val = torch.randint(0, 3, (50,), generator=gen)
    y_test = torch.randint(0, 3, (40,), generator=gen)
    logits = {d: d * torch.randn(50, 3, generator=gen) for d in (0.5, 1.0, 2.0)}
    tests = {d: torch.randn(40, 3, generator=gen).softmax(-1) for d in logits}
    delta, p_test = select_by_nll(list(logits), lambda d: (logits[d].softmax(-1), tests[d]), y_val)
    scores = {
        d: log_loss(y_val.numpy(), logits[d].double().softmax(-1).numpy(), labels=[0, 1, 2]) for d in logits
    }
    assert delta == min(scores, key=scores.get)
    assert p_test is tests[delta]
    # the test rows never decide: a perfect test prediction at another δ does not win
    one_hot = torch.nn.functional.one_hot(y_test, 3).float()
    others = [d for d in logits if d != delta]
    tests[others[0]] = one_hot
    assert select_by_nll(list(logits), lambda d: (logits[d].softmax(-1), tests[d]), y_val)[0] == delta


def test_select_by_nll_ties_go_to_the_first() -> None:
    y = torch.tensor([0, 1, 1])
    p = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5]])
    delta, _ = select_by_nll([3.0, 1.0, 2.0], lambda d: (p, torch.full((1, 2), d)), y)
    assert delta == 3.0


def test_norm_gain_is_the_normalised_bridge_scale_of_the_means() -> None:
    from seeds_glm import norm_gain

    from bayescli.posterior.gaussian import LogitGaussian
    from bayescli.predictive.dirichlet import laplace_bridge

    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    var = torch.rand(5, 4, generator=gen, dtype=torch.float64) + 0.05
    # diagonal Σ: the zero-sum correction gives Σ_kk − Σ_kk² / Σ_l Σ_ll (laplace-torch's form)
    corrected = var - var.pow(2) / var.sum(-1, keepdim=True)
    gains = (corrected.mean(-1) / math.sqrt(4 / 2)).rsqrt()
    assert norm_gain(LogitGaussian(mean, var)) == pytest.approx(float(gains.median()), rel=1e-12)
    # the gain is what separates the two corrections: μ/√c and Σ/c through eq. 7
    mu = mean - var * mean.sum(-1, keepdim=True) / var.sum(-1, keepdim=True)
    c = (1 / gains.pow(2))[:, None]
    k = 4
    alpha = (1 - 2 / k + (mu / c.sqrt()).exp() / k**2 * (-(mu / c.sqrt())).exp().sum(-1, keepdim=True)) / (
        corrected / c
    )
    torch.testing.assert_close(laplace_bridge(mean, var, "norm"), alpha, rtol=1e-10, atol=0)


def test_mean_se_matches_scipy_sem() -> None:
    from scipy.stats import sem

    gen = np.random.default_rng(0)
    for n in (2, 3, 10):
        values = gen.normal(0.1, 0.02, n).tolist()
        mean, se = mean_se(values)
        assert mean == pytest.approx(float(np.mean(values)), rel=1e-12)
        assert se == pytest.approx(float(sem(values)), rel=1e-12)  # ddof = 1
    assert mean_se([0.25]) == (0.25, 0.0)  # one split: no spread to estimate


def test_edge_counts_counts_each_end_of_the_grid() -> None:
    grid = [0.1, 1.0, 10.0, 100.0]
    assert edge_counts([0.1, 1.0, 100.0, 100.0, 10.0], grid) == (1, 2)
    assert edge_counts(iter([1.0, 10.0]), grid) == (0, 0)  # interior only; any iterable
    assert edge_counts([100.0], list(reversed(grid))) == (0, 1)  # the ends by value, not position


def test_glm_bnn_grid_continues_the_seeds_grid_at_its_spacing() -> None:
    seed_grid = np.logspace(-2, 2, 10)  # seed 003 App. B.3
    np.testing.assert_allclose(GLM_BNN_GRID[:10], seed_grid, rtol=1e-12)
    steps = np.diff(np.log10(GLM_BNN_GRID))
    np.testing.assert_allclose(steps, 4 / 9, rtol=1e-9)
