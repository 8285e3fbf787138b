"""Temperature scaling as a registered method: ``softmax((W φ + b) / T)``, a point mass on the head.

Not Bayesian, but the baseline every post-hoc method must beat, so ``bayescli select`` ranks it
beside them and its file predicts and evaluates like any posterior: its logit Gaussian has mean
``(W φ + b) / T`` and zero variance (every link then gives ``softmax(mean)``).

``T`` is chosen on validation data by a bounded 1-D minimisation of the validation ``select_by``
score over ``β = 1/T`` (the NLL is convex in β); ``T = 1`` is MAP and the result is kept only if it
does not score worse than ``T = 1``. Without validation data ``T = 1`` (MAP), recorded as not
validated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from bayescli.errors import BayescliError, require
from bayescli.fitting.fit_source import FitSource
from bayescli.metrics.classification import map_log_probabilities
from bayescli.options import Criterion, Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.gaussian import LogitGaussian
from bayescli.posterior.selection import Selection, scores, unvalidated

T_BOUNDS = (0.05, 20.0)


@dataclass
class TemperatureSettings:
    """Settings of temperature scaling.

    * ``temperature``: ``T``; ``None`` = chosen on validation data (``T = 1`` without any).
    * ``select_by``: the validation criterion (``nll`` | ``ece`` | ``brier``).
    * ``bounds``: the interval searched for ``T`` (``lo < 1 < hi``).
    """

    temperature: float | None = None
    select_by: Criterion = Criterion.NLL
    bounds: tuple[float, float] = T_BOUNDS

    def __post_init__(self) -> None:
        self.select_by = Criterion(self.select_by)
        lo, hi = self.bounds
        require(0 < lo < 1 < hi, f"bounds must satisfy 0 < lo < 1 < hi, got {self.bounds}")
        require(
            self.temperature is None or self.temperature > 0,
            f"temperature must be positive, got {self.temperature}",
        )


class TemperaturePosterior(Posterior):
    """The MAP head with its logits divided by ``T``: weight ``[K, D]``, bias ``[K]`` or ``None``."""

    method: ClassVar[str] = "temperature"

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float, meta: dict | None = None
    ) -> None:
        self.subset = Subset.LAST_LAYER
        self.weight, self.bias, self.temperature = weight, bias, float(temperature)
        self.meta = dict(meta or {})

    @property
    def label(self) -> str:
        return f"temperature T={self.temperature:.3g}"

    def logit_gaussian(self, phi: torch.Tensor) -> LogitGaussian:
        """Mean ``(φ Wᵀ + b) / T`` ``[N, K]``, zero variance."""
        w = self.weight.to(phi)
        logits = phi @ w.T
        if self.bias is not None:
            logits = logits + self.bias.to(phi)
        mean = logits / self.temperature
        return LogitGaussian(mean, torch.zeros_like(mean))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.weight}
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    def own_metadata(self) -> dict:
        return {"temperature": self.temperature}

    @classmethod
    def from_file(cls, tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> TemperaturePosterior:
        return cls(
            tensors["weight"],
            tensors.get("bias"),
            float(meta["temperature"]),
            cls.provenance(meta, {"temperature"}),
        )


def fit(source: FitSource, settings: TemperatureSettings) -> TemperaturePosterior:
    """Temperature scaling of ``source``'s classifier (module docs)."""
    head = source.classifier.head
    # the head's copy lives on the fit's device, wherever the caller left the classifier
    weight = head.weight.detach().to(source.device, copy=True)
    bias = None if head.bias is None else head.bias.detach().to(source.device, copy=True)
    if settings.temperature is not None:
        post = TemperaturePosterior(weight, bias, settings.temperature)
        post.selection = unvalidated("temperature", settings.temperature, "given", fixed=True)
        return post
    if source.val is None:
        post = TemperaturePosterior(weight, bias, 1.0)
        post.selection = unvalidated("temperature", 1.0, "T = 1 (MAP): no validation data (val)")
        return post
    val = source.val_features()
    temperature, sel = fit_temperature(val.logits, val.labels, settings.select_by, settings.bounds)
    post = TemperaturePosterior(weight, bias, temperature)
    post.selection = sel
    return post


def fit_temperature(
    logits: torch.Tensor,
    labels: torch.Tensor,
    criterion: Criterion | str = Criterion.NLL,
    bounds: tuple[float, float] = T_BOUNDS,
) -> tuple[float, Selection]:
    """``T`` minimising the validation ``criterion`` of ``softmax(logits / T)`` (``logits [N, K]``,
    ``labels [N]``) over ``bounds``, never scoring worse than ``T = 1``; and its record."""
    from scipy.optimize import minimize_scalar

    if labels is None or not len(labels):
        raise BayescliError("temperature scaling needs labelled validation data (val)")
    criterion = Criterion(criterion)
    z, y = logits.double(), labels.to(logits.device)
    curve: dict[float, dict[str, float]] = {}

    def score(temperature: float) -> float:
        if temperature not in curve:
            logp = map_log_probabilities(z / temperature)
            curve[temperature] = scores(logp.exp(), y, logp)
        return curve[temperature][criterion.value]

    lo, hi = bounds
    res = minimize_scalar(lambda beta: score(1 / beta), bounds=(1 / hi, 1 / lo), method="bounded")
    best = 1 / float(res.x)
    if not score(best) <= score(1.0):
        best = 1.0
    grid = sorted(curve)
    sel = Selection(
        "temperature",
        criterion,
        grid,
        [{"temperature": t, **curve[t]} for t in grid],
        best,
        1.0,
        curve[1.0],
    )
    if min(abs(best - lo), abs(best - hi)) < 1e-3 * best:
        sel.warning = f"T = {best:.3g} is at the edge of the bounds searched ({lo}–{hi})"
    return best, sel
