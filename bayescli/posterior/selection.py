"""Held-out selection of a method's key hyperparameter (one rule for every method).

A method fits (or re-scales) its posterior at each value of a log-spaced grid that spans its own
principled value and reaches the limit where the posterior equals MAP (Laplace δ → ∞, GLM VI
δ → ∞, MNVI κ → 0, Dirichlet fVI τ → 0). Each candidate's predictive on the validation set is
scored by a :class:`Criterion`; the lowest wins. Because the grid reaches the MAP limit, the
choice is never worse than MAP on validation (up to how close the grid's end is to the limit).
A method whose hyperparameter has no MAP limit (FSVI's prior scale: its prior is centred at zero,
so neither end of the grid is MAP) falls back to a point mass at the MAP head when no grid value
beats MAP, and records that (``map_fallback``). A minimum at a grid edge extends the grid beyond that
edge (same log spacing) before it warns. Every fit sets the outcome as ``post.selection`` (a
:class:`Selection`, also for a value given or defaulted); the posterior file stores its record
(grid, curve, choice, MAP's validation scores) under ``selection``.

The criteria read the labels' shape: class indices ``[N]`` score the softmax probabilities
(:mod:`bayescli.metrics.classification`), multi-label ``[N, K]`` indicators score per-label
probabilities by the means over labels of the per-label binary NLL, ECE and Brier
(:mod:`bayescli.metrics.multilabel`), so every method selects on multi-label data through the same grid logic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from bayescli.metrics.classification import brier, ece, map_log_probabilities, nll
from bayescli.metrics.multilabel import check_multilabel, per_label_brier, per_label_ece, per_label_nll
from bayescli.options import Criterion

__all__ = [
    "TIE",
    "Criterion",
    "Scored",
    "Selection",
    "calibration_verdict",
    "chose_map",
    "chosen_label",
    "log_grid",
    "map_temperature",
    "scores",
    "select_on_grid",
    "unvalidated",
]

# Scores within this (relative) of the best are ties; among ties the MAP end of a grid wins.
TIE = 1e-6

# Held-out evidence that MAP is calibrated: the validation NLL's temperature within this of 1 in
# log (T in 0.905–1.105) and a validation ECE at most this. Outside the first, the temperature
# names the cause (T < 1 underconfident, T > 1 overconfident).
CALIBRATED_LOG_T = 0.1
CALIBRATED_ECE = 0.02
# Where :func:`map_temperature` searches (that of temperature scaling).
T_BOUNDS = (0.05, 20.0)

P = TypeVar("P")


def scores(
    probs: torch.Tensor,
    labels: torch.Tensor,
    log_probs: torch.Tensor | None = None,
    log_odds: torch.Tensor | None = None,
) -> dict[str, float]:
    """Every criterion of ``probs [N, K]`` against ``labels [N]`` (softmax; the NLL from
    ``log_probs [N, K]`` when given, exact at any confidence), or against multi-label ``labels
    [N, K]`` (per-label probabilities; each criterion the mean over the ``K`` labels, the NLL from
    the per-label ``log_odds [N, K]`` when given, exact at any margin)."""
    probs, labels = probs.detach().double().cpu(), labels.cpu()
    if labels.dim() == 2:
        check_multilabel(probs, labels)
        s = None if log_odds is None else log_odds.detach().cpu()
        return {
            "nll": float(per_label_nll(probs, labels, s).mean()),
            "ece": float(per_label_ece(probs, labels).mean()),
            "brier": float(per_label_brier(probs, labels).mean()),
        }
    logp = None if log_probs is None else log_probs.detach().cpu()
    return {"nll": nll(probs, labels, logp), "ece": ece(probs, labels), "brier": brier(probs, labels)}


@dataclass(frozen=True)
class Scored:
    """A candidate's validation predictive: ``probs [N, K]`` and, where the method has them, its
    float64 ``log_probs [N, K]`` (softmax) or per-label ``log_odds [N, K]`` (multi-label), from
    which the NLL is taken: exact where ``probs`` round to 0 or 1 (:func:`scores`)."""

    probs: torch.Tensor
    log_probs: torch.Tensor | None = None
    log_odds: torch.Tensor | None = None

    def scores(self, labels: torch.Tensor) -> dict[str, float]:
        """:func:`scores` of this predictive against ``labels``."""
        return scores(self.probs, labels, self.log_probs, self.log_odds)

    @staticmethod
    def cat(parts: list[Scored]) -> Scored:
        """The predictives of consecutive batches of inputs as one."""

        def join(name: str) -> torch.Tensor | None:
            values = [getattr(part, name) for part in parts]
            return None if values[0] is None else torch.cat(values)

        return Scored(join("probs"), join("log_probs"), join("log_odds"))


# How a setting was set: the record's ``method`` entry.
VALIDATION, FIXED, DEFAULT = "validation", "fixed", "default"

# The record entries :class:`Selection` types; any other entry is a method's own (``extra``).
_VALIDATED_KEYS = (
    "method", "validated", "setting", "criterion", "grid", "curve", "chosen", "principled",
    "map_validation", "extensions", "map_point", "map_temperature", "warning", "map_fallback",
)  # fmt: skip
_UNVALIDATED_KEYS = ("method", "validated", "setting", "chosen", "rule", "warning")


@dataclass
class Selection:
    """How a method's key setting was set: chosen on held-out data (``how`` = ``validation``: the
    grid, the curve of scores ``[{setting: v, nll, ece, brier}]`` sorted by ``v``, the criterion,
    the principled value, MAP's scores), given explicitly (``fixed``) or the method's principled
    default (``default``, ``rule`` says which).

    Every fit sets it as ``post.selection``; the posterior file stores :meth:`record` under
    ``selection`` (and :meth:`from_record` reads it back). ``map_point``: the choice is the grid's
    MAP end (the posterior is numerically MAP); ``map_fallback``: no value beat MAP and the method
    returned the point mass at MAP instead. ``prior`` is how the prior-precision methods' file
    block ``prior`` describes the choice (its ``method``, ``objective``, …; its ``value`` is the
    posterior's own δ, written with it). ``extra`` holds a method's own entries (MNVI's
    ``map_limit_gap``, Dirichlet fVI's ``map_limit``, prior_precision's ``objective``, …),
    written into the record as they are.
    """

    setting: str
    criterion: Criterion | None = None
    grid: list[float] = field(default_factory=list)
    curve: list[dict] = field(default_factory=list)
    chosen: float | None = math.nan
    principled: float | None = None
    map_scores: dict[str, float] | None = None
    extensions: int = 0
    warning: str | None = None
    map_point: bool = False
    map_temperature: float | None = None  # MAP's validation-NLL temperature, where it was needed
    how: str = VALIDATION
    rule: str | None = None  # why a value not validated is what it is
    map_fallback: bool = False
    prior: dict | None = None
    extra: dict = field(default_factory=dict)

    @property
    def validated(self) -> bool:
        """Whether the setting was chosen on held-out data."""
        return self.how == VALIDATION

    @property
    def chose_map(self) -> bool | None:
        """Whether held-out selection chose MAP itself: the grid's MAP end (``map_point``) or the
        MAP fallback (``map_fallback``, e.g. Dirichlet fVI's τ = 0 head); ``None`` when the setting
        was not chosen on held-out data."""
        if not self.validated:
            return None
        return bool(self.map_point or self.map_fallback)

    @property
    def label(self) -> str | None:
        """``"setting = value"``, where the record names both."""
        value = self.chosen
        if not self.setting or not isinstance(value, int | float) or isinstance(value, bool):
            return None
        return f"{self.setting} = {value:.3g}"

    def add_warning(self, text: str) -> None:
        """Append ``text`` to the warning (``; ``-separated)."""
        self.warning = f"{self.warning}; {text}" if self.warning else text

    def record(self) -> dict:
        """The ``selection`` entry of the posterior file."""
        if not self.validated:
            out = {
                "method": self.how,
                "validated": False,
                "setting": self.setting,
                "chosen": self.chosen,
                "rule": self.rule,
            }
            if self.warning:
                out["warning"] = self.warning
            return out | self.extra
        out = {
            "method": "validation",
            "validated": True,
            "setting": self.setting,
            "criterion": None if self.criterion is None else self.criterion.value,
            "grid": self.grid,
            "curve": self.curve,
            "chosen": self.chosen,
            "principled": self.principled,
            "map_validation": self.map_scores,
            "extensions": self.extensions,
            "map_point": self.map_point,
        }
        if self.map_temperature is not None:
            out["map_temperature"] = self.map_temperature
        if self.warning:
            out["warning"] = self.warning
        out |= self.extra
        if self.map_fallback:
            out["map_fallback"] = True
        return out

    @classmethod
    def from_record(cls, record: dict, prior: dict | None = None) -> Selection:
        """The selection a file's ``selection`` entry records (and its ``prior`` block, less its
        ``value``), as :meth:`record` wrote it."""
        if not record.get("validated"):
            return cls(
                str(record.get("setting", "")),
                chosen=record.get("chosen"),
                how=str(record.get("method", DEFAULT)),
                rule=record.get("rule"),
                warning=record.get("warning"),
                prior=prior,
                extra={k: v for k, v in record.items() if k not in _UNVALIDATED_KEYS},
            )
        criterion = record.get("criterion")
        return cls(
            str(record.get("setting", "")),
            None if criterion is None else Criterion(criterion),
            list(record.get("grid") or []),
            list(record.get("curve") or []),
            record.get("chosen", math.nan),
            record.get("principled"),
            record.get("map_validation"),
            int(record.get("extensions", 0)),
            record.get("warning"),
            bool(record.get("map_point", False)),
            record.get("map_temperature"),
            prior=prior,
            map_fallback=bool(record.get("map_fallback", False)),
            extra={k: v for k, v in record.items() if k not in _VALIDATED_KEYS},
        )


def unvalidated(setting: str, value: float | None, rule: str, *, fixed: bool = False) -> Selection:
    """The selection of a posterior whose ``setting`` was not chosen on held-out data: given
    explicitly (``fixed``) or the method's principled default (``rule`` says which)."""
    return Selection(setting, chosen=value, how=FIXED if fixed else DEFAULT, rule=rule)


def chose_map(selection: Selection | None) -> bool | None:
    """:attr:`Selection.chose_map` of a posterior's ``selection`` (``None`` without one)."""
    return None if selection is None else selection.chose_map


def chosen_label(selection: Selection | None) -> str | None:
    """:attr:`Selection.label` of a posterior's ``selection`` (``None`` without one)."""
    return None if selection is None else selection.label


def map_temperature(
    logits: torch.Tensor, labels: torch.Tensor, bounds: tuple[float, float] = T_BOUNDS
) -> float:
    """The temperature ``T`` in ``bounds`` minimising MAP's validation NLL of ``logits / T``:
    softmax cross-entropy for ``logits [N, K]`` and class ``labels [N]``, the mean per-label
    binary cross-entropy for multi-label ``labels [N, K]`` (float64, exact at any margin)."""
    from scipy.optimize import minimize_scalar

    z, y = logits.detach().double().cpu(), labels.cpu()
    if y.dim() == 2:
        y = y.double()

        def objective(beta: float) -> float:
            return torch.nn.functional.binary_cross_entropy_with_logits(z * beta, y).item()

    else:

        def objective(beta: float) -> float:
            return torch.nn.functional.cross_entropy(z * beta, y).item()

    lo, hi = bounds
    res = minimize_scalar(objective, bounds=(1 / hi, 1 / lo), method="bounded", options={"xatol": 1e-6})
    return 1 / float(res.x)


def calibration_verdict(temperature: float, ece: float, setting: str) -> str | None:
    """What held-out evidence says of MAP's calibration when no ``setting`` beat MAP: the net is
    underconfident (``temperature`` < 1), overconfident (> 1), or already calibrated (``temperature``
    ≈ 1 and a small validation ``ece``); ``None`` when the evidence says neither."""
    if math.log(temperature) < -CALIBRATED_LOG_T:
        return (
            f"the net is underconfident (temperature T = {temperature:.3g} < 1 fits its validation data "
            "better): posterior variance only spreads its predictions further; temperature scaling "
            "sharpens them"
        )
    if math.log(temperature) > CALIBRATED_LOG_T:
        return (
            f"the net is overconfident (temperature T = {temperature:.3g} > 1 fits its validation data "
            f"better), yet no {setting} searched improves on MAP: try temperature scaling"
        )
    if ece <= CALIBRATED_ECE:
        return f"the net is already calibrated there (temperature T = {temperature:.3g}, ECE {ece:.3g})"
    return None


def log_grid(center: float, low: int, high: int, step: float = 10.0) -> list[float]:
    """``center · step^i`` for ``i = low … high`` (``low ≤ 0 ≤ high``)."""
    return [center * step**i for i in range(low, high + 1)]


def select_on_grid(
    setting: str,
    grid: list[float],
    candidate: Callable[[float], tuple[P, Scored]],
    labels: torch.Tensor,
    criterion: Criterion | str = Criterion.NLL,
    *,
    map_probs: torch.Tensor | None = None,
    map_logits: torch.Tensor | None = None,
    principled: float | None = None,
    map_side: str | None = None,
    extensions: int = 2,
    extend_by: int = 2,
) -> tuple[P, Selection]:
    """The candidate with the lowest validation ``criterion`` over ``grid`` and its record.

    ``candidate(value)`` returns ``(posterior, Scored)`` — the posterior at ``value`` and its
    validation predictive with its log-probabilities (so the NLL is exact at any confidence).
    ``map_side`` (``"low"`` or ``"high"``) says which end of the grid is the MAP limit: the grid is
    never extended past it, and where the curve is flat to within :data:`TIE` of the best score the
    MAP end is chosen (the simpler answer; ``map_point``). A minimum at the other edge extends the
    grid by ``extend_by`` points beyond it, up to ``extensions`` times; if it stays there,
    :attr:`Selection.warning` says so. MAP's ``map_logits [N, K]`` (when given) make its scores
    exact; where the MAP end wins they let the warning say why, from the temperature that fits them
    (:func:`calibration_verdict`); without them it says nothing of calibration.
    """
    criterion = Criterion(criterion)
    grid = sorted(float(v) for v in grid)
    ratio = grid[1] / grid[0] if len(grid) > 1 else 10.0
    found: dict[float, tuple[P, dict[str, float]]] = {}

    def visit(values: list[float]) -> None:
        for v in values:
            post, predictive = candidate(v)
            found[v] = (post, predictive.scores(labels))

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
        None if map_probs is None else _map_scores(map_probs, map_logits, labels),
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
            f"does not improve on MAP's {criterion.value} ({sel.map_scores[criterion.value]:.4g})"
        )
        if map_logits is not None:
            sel.map_temperature = map_temperature(map_logits, labels)
            verdict = calibration_verdict(sel.map_temperature, sel.map_scores["ece"], setting)
            if verdict:
                sel.warning += f"; {verdict}"
    return found[chosen][0], sel


def _map_scores(probs: torch.Tensor, logits: torch.Tensor | None, labels: torch.Tensor) -> dict[str, float]:
    """MAP's :func:`scores` of ``probs [N, K]``, its NLL exact from ``logits [N, K]`` when given:
    their log-softmax for class ``labels [N]``, the log-odds themselves for multi-label ``[N, K]``."""
    if logits is None:
        return scores(probs, labels)
    if labels.dim() == 2:
        return scores(probs, labels, log_odds=logits)
    return scores(probs, labels, map_log_probabilities(logits.detach().cpu()))


def _finite(value: float) -> float:
    return value if math.isfinite(value) else math.inf
