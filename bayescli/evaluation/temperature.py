"""Temperature scaling (Guo et al. 2017): ``softmax(f/T)`` with ``T`` fitted by validation NLL.

The NLL is convex in ``β = 1/T`` (a log-sum-exp of functions linear in ``β`` minus a linear
term), so a bounded 1-D minimisation over ``β`` finds its global minimum on the interval. The
fitted ``T`` is kept only if it does not raise the validation NLL above ``T = 1`` (the MAP),
which guards against the optimiser's finite tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bayescli.errors import BayescliError

T_BOUNDS = (0.05, 20.0)


@dataclass
class TemperatureFit:
    """The fitted temperature and the validation NLL before (``T = 1``) and after."""

    temperature: float
    nll_before: float
    nll_after: float
    points: int
    bounds: tuple[float, float] = T_BOUNDS

    def info(self) -> dict:
        return {
            "temperature": self.temperature,
            "val_nll_at_1": self.nll_before,
            "val_nll": self.nll_after,
            "val_points": self.points,
            "bounds": list(self.bounds),
            "objective": "validation NLL, bounded Brent on 1/T",
        }


def nll_at(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> float:
    """Mean NLL of ``softmax(logits / T)`` for ``logits [N, K]``, ``labels [N]`` (float64)."""
    return torch.nn.functional.cross_entropy(logits.double() / temperature, labels).item()


def fit_temperature(
    logits: torch.Tensor, labels: torch.Tensor, bounds: tuple[float, float] = T_BOUNDS
) -> TemperatureFit:
    """Fit ``T`` in ``bounds`` on validation ``logits [N, K]`` and ``labels [N]``."""
    from scipy.optimize import minimize_scalar

    if labels is None or len(labels) == 0:
        raise BayescliError("temperature scaling needs labelled validation data (`val_data`)")
    lo, hi = bounds
    if not 0 < lo < 1 < hi:
        raise BayescliError(f"temperature bounds must satisfy 0 < lo < 1 < hi, got {bounds}")
    z = logits.double()
    labels = labels.to(z.device)

    def objective(beta: float) -> float:
        return nll_at(z, labels, 1 / beta)

    res = minimize_scalar(objective, bounds=(1 / hi, 1 / lo), method="bounded", options={"xatol": 1e-8})
    before = objective(1.0)
    beta, after = float(res.x), float(res.fun)
    if not after <= before:
        beta, after = 1.0, before
    return TemperatureFit(1 / beta, before, after, len(labels), (lo, hi))
