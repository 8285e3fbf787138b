"""Temperature scaling: the fitted T against a dense grid, and never a higher validation NLL.

NLL(β = 1/T) is convex, so the bounded Brent minimum is the grid minimum up to the grid's
spacing; tolerances are stated where used.
"""

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from tolerance import assert_below, assert_close

from bayescli.errors import BayescliError
from bayescli.evaluation.temperature import T_BOUNDS, fit_temperature, nll_at


def _problem(scale: float, n: int = 2000, k: int = 6, seed: int = 0):
    """Labels drawn from softmax(z); the model reports scale·z (over-confident for scale > 1)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 2, (n, k))
    p = np.exp(z - logsumexp(z, axis=1, keepdims=True))
    y = (p.cumsum(1) > rng.random((n, 1))).argmax(1)
    return torch.from_numpy(scale * z), torch.from_numpy(y)


def _nll_numpy(logits: np.ndarray, y: np.ndarray, t: float) -> float:
    z = logits / t
    return float(np.mean(logsumexp(z, axis=1) - z[np.arange(len(y)), y]))


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0])
def test_temperature_matches_grid_minimum_and_never_raises_nll(scale):
    logits, y = _problem(scale, seed=int(10 * scale))
    fit = fit_temperature(logits, y)
    coarse = np.linspace(np.log(T_BOUNDS[0]), np.log(T_BOUNDS[1]), 401)
    nlls = np.array([_nll_numpy(logits.numpy(), y.numpy(), t) for t in np.exp(coarse)])
    i = int(nlls.argmin())  # convex in 1/T: the minimum lies between the argmin's neighbours
    fine = np.exp(np.linspace(coarse[max(i - 1, 0)], coarse[min(i + 1, 400)], 401))
    nlls = np.array([_nll_numpy(logits.numpy(), y.numpy(), t) for t in fine])
    best = fine[nlls.argmin()]
    # fine spacing in log T is 7.5e-5, so the grid optimum is within 4e-5 relative of the true one
    assert_close(fit.temperature, best, rtol=1e-3, what=f"T vs grid (scale {scale})")
    assert fit.nll_after <= nlls.min() + 1e-9  # Brent beats any grid point up to its xatol
    assert fit.nll_after <= fit.nll_before
    assert_close(fit.nll_before, _nll_numpy(logits.numpy(), y.numpy(), 1.0), rtol=1e-12, what="NLL at T=1")
    assert_close(nll_at(logits, y, fit.temperature), fit.nll_after, rtol=1e-12, what="reported NLL")
    if scale != 1.0:
        # labels come from softmax(z), so T estimates the scale (MLE on 2000 points); its relative
        # spread over 40 seeds is 2.8%: 6 standard errors
        assert_close(fit.temperature, scale, rtol=0.17, what="T recovers the over/under-confidence")


def test_temperature_never_raises_nll_on_many_random_problems():
    for seed in range(30):
        rng = np.random.default_rng(seed)
        logits = torch.from_numpy(rng.normal(0, rng.uniform(0.01, 20), (int(rng.integers(2, 60)), 5)))
        y = torch.from_numpy(rng.integers(0, 5, len(logits)))
        fit = fit_temperature(logits, y)
        assert fit.nll_after <= fit.nll_before, seed
        assert T_BOUNDS[0] <= fit.temperature <= T_BOUNDS[1]


def test_temperature_at_bound_and_bad_input():
    # labels independent of huge logits: the NLL keeps falling as T grows, T stops at the bound
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.normal(0, 50, (500, 4)))
    fit = fit_temperature(logits, torch.from_numpy(rng.integers(0, 4, 500)))
    assert_below(abs(fit.temperature - T_BOUNDS[1]) / T_BOUNDS[1], 1e-5, what="T at its upper bound")
    with pytest.raises(BayescliError, match="bounds"):
        fit_temperature(logits, torch.zeros(500, dtype=torch.long), bounds=(2.0, 3.0))
