"""Choosing the prior precision ``δ``.

* ``marglik`` (``--prior-precision auto``): maximise the Laplace log marginal likelihood

      log p(D | δ) ≈ log p(D | θ*) + (P/2) log δ − (δ/2) ‖θ*‖² − ½ log det(H + δI),

  in closed form per structure (elementwise for diag, on the eigenvalues ``g_i a_j`` for kron,
  on the eigenvalues of ``H`` for full): a log-spaced grid, then a bounded scalar refinement
  around the best grid point.
* ``val-nll``: any objective evaluated on a grid (the predictive layer supplies validation NLL).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from scipy.optimize import minimize_scalar

from bayescli.posterior.gaussian import WeightGaussian

LOG10_RANGE = (-6.0, 6.0)


def log_marglik(gaussian: WeightGaussian, log_lik: float, delta: float | torch.Tensor) -> torch.Tensor:
    """Laplace log marginal likelihood for prior precision ``δ`` (vectorised over ``δ``)."""
    d = torch.as_tensor(delta, dtype=torch.float64)
    theta2 = gaussian.mean.double().pow(2).sum()
    p = gaussian.num_params
    return log_lik + 0.5 * p * torch.log(d) - 0.5 * d * theta2 - 0.5 * gaussian.log_det_precision(d)


def optimise_marglik(
    gaussian: WeightGaussian, log_lik: float, grid_points: int = 49
) -> tuple[float, list[list[float]]]:
    """``argmax_δ log p(D | δ)`` and the objective curve ``[[δ, value], ...]`` on the grid."""
    grid = torch.logspace(*LOG10_RANGE, grid_points, dtype=torch.float64)
    values = log_marglik(gaussian, log_lik, grid)
    best = int(values.argmax())
    lo = np.log10(grid[max(best - 1, 0)].item())
    hi = np.log10(grid[min(best + 1, grid_points - 1)].item())
    res = minimize_scalar(
        lambda t: -float(log_marglik(gaussian, log_lik, 10.0**t)),
        bounds=(lo, hi),
        method="bounded",
        options={"xatol": 1e-6},
    )
    delta = float(10.0**res.x) if -res.fun >= values[best].item() else grid[best].item()
    return delta, [[g, v] for g, v in zip(grid.tolist(), values.tolist(), strict=True)]


def grid_search(objective: Callable[[float], float], grid: list[float]) -> tuple[float, list[list[float]]]:
    """``argmin`` of ``objective`` over ``grid`` and the curve ``[[δ, value], ...]``."""
    curve = [[float(d), float(objective(d))] for d in grid]
    best = min(curve, key=lambda dv: dv[1] if np.isfinite(dv[1]) else np.inf)
    return best[0], curve
