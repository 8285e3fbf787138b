"""Held-out selection of a method's key hyperparameter (one rule for every method).

A method fits (or re-scales) its posterior at each value of a log-spaced grid that spans its own
principled value and reaches the limit where the posterior equals MAP (Laplace δ → ∞, GLM VI
δ → ∞, MNVI κ → 0, Dirichlet fVI τ → 0). Each candidate's predictive on the validation set is
scored by a :class:`Criterion`; the lowest wins. Because the grid reaches the MAP limit, the
choice is never worse than MAP on validation (up to how close the grid's end is to the limit).
A method whose hyperparameter has no MAP limit (FSVI's prior scale: its prior is centred at zero,
so neither end of the grid is MAP) falls back to a point mass at the MAP head when no grid value
beats MAP, and records that (``map_fallback``). A minimum at a grid edge extends the grid beyond that
edge (same log spacing) before it warns. The record (grid, curve, choice, MAP's validation scores)
goes into the posterior file under ``selection``.

The criteria read the labels' shape: class indices ``[N]`` score the softmax probabilities
(:mod:`bayescli.metrics`), multi-label ``[N, K]`` indicators score per-label probabilities by the
means over labels of the per-label binary NLL, ECE and Brier (:mod:`bayescli.metrics_multilabel`),
so every method selects on multi-label data through the same grid logic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from bayescli.metrics import brier, ece, nll
from bayescli.metrics_multilabel import check_multilabel, per_label_brier, per_label_ece, per_label_nll
from bayescli.options import Criterion

__all__ = ["TIE", "Criterion", "Selection", "log_grid", "scores", "select_on_grid", "unvalidated"]

# Scores within this (relative) of the best are ties; among ties the MAP end of a grid wins.
TIE = 1e-6

P = TypeVar("P")


def scores(
    probs: torch.Tensor, labels: torch.Tensor, log_probs: torch.Tensor | None = None
) -> dict[str, float]:
    """Every criterion of ``probs [N, K]`` against ``labels [N]`` (softmax; the NLL from
    ``log_probs [N, K]`` when given, exact at any confidence), or against multi-label ``labels
    [N, K]`` (per-label probabilities; each criterion the mean over the ``K`` labels)."""
    probs, labels = probs.detach().double().cpu(), labels.cpu()
    if labels.dim() == 2:
        check_multilabel(probs, labels)
        per_label = {"nll": per_label_nll, "ece": per_label_ece, "brier": per_label_brier}
        return {name: float(fn(probs, labels).mean()) for name, fn in per_label.items()}
    logp = None if log_probs is None else log_probs.detach().cpu()
    return {"nll": nll(probs, labels, logp), "ece": ece(probs, labels), "brier": brier(probs, labels)}


@dataclass
class Selection:
    """The outcome of a held-out selection, as recorded in the posterior file."""

    setting: str
    criterion: Criterion
    grid: list[float]
    curve: list[dict] = field(default_factory=list)  # [{setting: v, nll, ece, brier}] sorted by v
    chosen: float = math.nan
    principled: float | None = None
    map_scores: dict[str, float] | None = None
    extensions: int = 0
    warning: str | None = None
    map_point: bool = False  # the choice is the grid's MAP end: the posterior is (numerically) MAP

    def record(self) -> dict:
        out = {
            "method": "validation",
            "validated": True,
            "setting": self.setting,
            "criterion": self.criterion.value,
            "grid": self.grid,
            "curve": self.curve,
            "chosen": self.chosen,
            "principled": self.principled,
            "map_validation": self.map_scores,
            "extensions": self.extensions,
            "map_point": self.map_point,
        }
        if self.warning:
            out["warning"] = self.warning
        return out


def unvalidated(setting: str, value: float | None, rule: str, *, fixed: bool = False) -> dict:
    """The ``selection`` record of a posterior whose ``setting`` was not chosen on held-out data:
    given explicitly (``fixed``) or the method's principled default (``rule`` says which)."""
    return {
        "method": "fixed" if fixed else "default",
        "validated": False,
        "setting": setting,
        "chosen": value,
        "rule": rule,
    }


def log_grid(center: float, low: int, high: int, step: float = 10.0) -> list[float]:
    """``center · step^i`` for ``i = low … high`` (``low ≤ 0 ≤ high``)."""
    return [center * step**i for i in range(low, high + 1)]


def select_on_grid(
    setting: str,
    grid: list[float],
    candidate: Callable[[float], tuple[P, torch.Tensor]],
    labels: torch.Tensor,
    criterion: Criterion | str = Criterion.NLL,
    *,
    map_probs: torch.Tensor | None = None,
    principled: float | None = None,
    map_side: str | None = None,
    extensions: int = 2,
    extend_by: int = 2,
) -> tuple[P, Selection]:
    """The candidate with the lowest validation ``criterion`` over ``grid`` and its record.

    ``candidate(value)`` returns ``(posterior, probs [N, K])`` — the posterior at ``value`` and its
    validation predictive. ``map_side`` (``"low"`` or ``"high"``) says which end of the grid is the
    MAP limit: the grid is never extended past it, and where the curve is flat to within
    :data:`TIE` of the best score the MAP end is chosen (the simpler answer; ``map_point``). A
    minimum at the other edge extends the grid by ``extend_by`` points beyond it, up to
    ``extensions`` times; if it stays there, :attr:`Selection.warning` says so.
    """
    criterion = Criterion(criterion)
    grid = sorted(float(v) for v in grid)
    ratio = grid[1] / grid[0] if len(grid) > 1 else 10.0
    found: dict[float, tuple[P, dict[str, float]]] = {}

    def visit(values: list[float]) -> None:
        for v in values:
            post, probs = candidate(v)
            found[v] = (post, scores(probs, labels))

    def best() -> float:
        return min(found, key=lambda v: _finite(found[v][1][criterion.value]))

    visit(grid)
    done = 0
    for _ in range(extensions):
        chosen, values = best(), sorted(found)
        if (map_side == "low" and chosen == values[0]) or (map_side == "high" and chosen == values[-1]):
            break  # past the MAP end the posterior is MAP to ever more digits
        if chosen == values[0]:
            new = [values[0] / ratio**i for i in range(extend_by, 0, -1)]
        elif chosen == values[-1]:
            new = [values[-1] * ratio**i for i in range(1, extend_by + 1)]
        else:
            break
        visit(new)
        done += 1
    chosen = best()
    values = sorted(found)
    if map_side in ("low", "high"):
        end = values[0] if map_side == "low" else values[-1]
        top = found[chosen][1][criterion.value]
        if found[end][1][criterion.value] <= top + TIE * max(1.0, abs(top)):
            chosen = end
    sel = Selection(
        setting,
        criterion,
        grid,
        [{setting: v, **found[v][1]} for v in values],
        chosen,
        principled,
        None if map_probs is None else scores(map_probs, labels),
        done,
    )
    at_edge = len(values) > 1 and chosen in (values[0], values[-1])
    at_map_edge = (map_side == "low" and chosen == values[0]) or (map_side == "high" and chosen == values[-1])
    sel.map_point = at_map_edge
    if at_edge and not at_map_edge:
        side = "smallest" if chosen == values[0] else "largest"
        sel.warning = (
            f"{setting} = {chosen:.3g} is the {side} value searched ({values[0]:.3g}–{values[-1]:.3g}) "
            f"even after extending the grid {done} times; the validation {criterion.value} may improve "
            f"beyond it: set {setting} explicitly"
        )
    elif at_map_edge and sel.map_scores is not None:
        sel.warning = (
            f"{setting} = {chosen:.3g} reaches the MAP limit: on this validation set the posterior "
            f"does not improve on MAP's {criterion.value} ({sel.map_scores[criterion.value]:.4g}); "
            "the net is already calibrated there"
        )
    return found[chosen][0], sel


def _finite(value: float) -> float:
    return value if math.isfinite(value) else math.inf
