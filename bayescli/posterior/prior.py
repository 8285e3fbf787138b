"""Choosing the prior precision ``δ``.

* ``marglik`` (``--prior-precision auto``): maximise the Laplace log marginal likelihood

      log p(D | δ) ≈ log p(D | θ*) + (P/2) log δ − (δ/2) ‖θ*‖² − ½ log det(H + δI),

  in closed form per structure (elementwise for diag, on the eigenvalues ``g_i a_j`` for kron,
  on the eigenvalues of ``H`` for full): a log-spaced grid, then the root of its slope between
  the best grid point's neighbours (a bounded scalar search if the slope does not change sign).
* ``val-nll``: any objective evaluated on a grid (the predictive layer supplies validation NLL).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from scipy.optimize import brentq, minimize_scalar

from bayescli.posterior.gaussian import WeightGaussian

LOG10_RANGE = (-6.0, 6.0)


def log_marglik(gaussian: WeightGaussian, log_lik: float, delta: float | torch.Tensor) -> torch.Tensor:
    """Laplace log marginal likelihood for prior precision ``δ`` (vectorised over ``δ``).

    ``log_lik = log p(D | θ*)`` is the classifier's own likelihood at the mode — softmax
    ``Σ_n log softmax(f_n)_{y_n}`` or Bernoulli ``Σ_nk [y log σ(f) + (1 − y) log(1 − σ(f))]`` —
    summed by the curvature accumulator that also gave ``H``; the rest depends on the Gaussian only.
    """
    d = torch.as_tensor(delta, dtype=torch.float64, device=gaussian.mean.device)
    theta2 = gaussian.mean.double().pow(2).sum()
    p = gaussian.num_params
    return log_lik + 0.5 * p * torch.log(d) - 0.5 * d * theta2 - 0.5 * gaussian.log_det_precision(d)


def optimise_marglik(
    gaussian: WeightGaussian, log_lik: float, grid_points: int = 49
) -> tuple[float, list[list[float]]]:
    """``argmax_δ log p(D | δ)`` and the objective curve ``[[δ, value], ...]`` on the grid."""
    grid = torch.logspace(*LOG10_RANGE, grid_points, dtype=torch.float64)
    # one δ at a time: vectorised over the grid, a 2048→1000 KFAC head needs [49, 2M] temporaries
    # (1.5 GiB); the values stay on the posterior's device until the one copy below
    values = torch.stack([log_marglik(gaussian, log_lik, float(d)) for d in grid]).cpu()
    best = int(values.argmax())
    lo = np.log10(grid[max(best - 1, 0)].item())
    hi = np.log10(grid[min(best + 1, grid_points - 1)].item())
    curve = [[g, v] for g, v in zip(grid.tolist(), values.tolist(), strict=True)]
    # The root of the slope, not the maximum of the value: near the optimum the objective is flat
    # to round-off over |Δ log δ| ~ 1e-7, its slope is not, so δ is fixed to ~1e-12 and does not
    # move with 1e-15 changes of the curvature (other batchings, other process counts).
    slope_lo, slope_hi = marglik_slope(gaussian, log_lik, lo), marglik_slope(gaussian, log_lik, hi)
    if slope_lo > 0 > slope_hi:
        t = brentq(lambda t: marglik_slope(gaussian, log_lik, t), lo, hi, xtol=1e-13, rtol=1e-15)
        return float(10.0**t), curve
    res = minimize_scalar(
        lambda t: -float(log_marglik(gaussian, log_lik, 10.0**t)),
        bounds=(lo, hi),
        method="bounded",
        options={"xatol": 1e-9},
    )
    delta = float(10.0**res.x) if -res.fun >= values[best].item() else grid[best].item()
    return delta, curve


def marglik_slope(gaussian: WeightGaussian, log_lik: float, log10_delta: float) -> float:
    """``d log p(D | δ) / d log₁₀ δ`` at ``δ = 10^log10_delta`` (automatic differentiation,
    float64): ``ln 10 · δ · (P/(2δ) − ‖θ*‖²/2 − ½ tr (H + δI)⁻¹)``."""
    d = torch.tensor(10.0**log10_delta, dtype=torch.float64, device=gaussian.mean.device, requires_grad=True)
    (grad,) = torch.autograd.grad(log_marglik(gaussian, log_lik, d).sum(), d)
    return float(grad) * float(d.detach()) * float(np.log(10.0))


def grid_search(
    objective: Callable[[float], float], grid: list[float], extensions: int = 2, extend_by: int = 8
) -> tuple[float, list[list[float]]]:
    """``argmin`` of ``objective`` over a log-spaced ``grid`` and the curve ``[[δ, value], ...]``.

    A minimum on the grid's first or last point is no minimum: the grid is extended beyond that end
    by ``extend_by`` points of the same log spacing, up to ``extensions`` times. If the minimum is
    still on the edge, :func:`edge_warning` says so.
    """
    grid = sorted(float(d) for d in grid)
    ratio = grid[1] / grid[0] if len(grid) > 1 else 10.0
    curve = [[d, float(objective(d))] for d in grid]

    def best() -> list[float]:
        return min(curve, key=lambda dv: dv[1] if np.isfinite(dv[1]) else np.inf)

    for _ in range(extensions):
        delta = best()[0]
        if delta == curve[0][0]:
            new = [curve[0][0] / ratio**i for i in range(extend_by, 0, -1)]
        elif delta == curve[-1][0]:
            new = [curve[-1][0] * ratio**i for i in range(1, extend_by + 1)]
        else:
            break
        curve = sorted(curve + [[d, float(objective(d))] for d in new])
    return best()[0], curve


def edge_warning(delta: float, curve: list[list[float]]) -> str | None:
    """A warning when the chosen ``δ`` is the smallest or largest value searched."""
    if len(curve) < 2:
        return None
    lo, hi = min(d for d, _ in curve), max(d for d, _ in curve)
    if lo < delta < hi:
        return None
    side = "largest" if delta >= hi else "smallest"
    toward = "a stronger prior (predictions closer to MAP)" if side == "largest" else "a weaker prior"
    return (
        f"the prior precision {delta:.3g} is the {side} value searched ({lo:.3g}–{hi:.3g}); the "
        f"objective may improve further toward {toward}: give prior_precision a number"
    )
