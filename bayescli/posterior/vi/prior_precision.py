"""How GLM VI, GGP VI and Bayes by Backprop choose their prior precision ``δ``.

All three place the prior ``θ ~ N(0, δ⁻¹ I)`` on the weights, and ``δ`` is their key setting
(``prior_precision``). In order of precedence:

1. a value given in the settings is used as is (recorded as fixed);
2. with labelled validation data (and ``select`` not ``False``), held-out selection
   (:func:`bayescli.posterior.selection.select_on_grid`) over ``δ_0 · 10^i``, ``i = −2 … 2``, around
   the principled value ``δ_0`` (extended past an edge minimum);
3. otherwise the principled value ``δ_0``: the Laplace marginal-likelihood optimum at ``θ*`` for a
   trained network.

No ``δ`` gives back MAP. The prior is centred at zero, not at ``θ*``, and the variational mean is
fitted: as ``δ → ∞`` the mean shrinks to zero with the covariance, and the predictive tends to
the prior's (uniform for a last layer), not to MAP; as ``δ → 0`` the covariance grows along every
direction the likelihood leaves flat. So the grid has no MAP end (``map_side`` is not passed);
MAP's validation scores are recorded beside the curve. The MAP end of the candidate set is instead
the point mass at ``θ*`` (the variance → 0 limit about the network's own weights): a caller that
passes ``map_point`` (GLM VI's and GGP VI's post-hoc fits) gets it back when no ``δ`` searched
scores better than MAP on validation, recorded as ``map_fallback`` in its selection with a warning, so a
selected posterior is never worse than MAP there (as FSVI, :mod:`bayescli.posterior.vi.fsvi`).
Without ``map_point`` (Bayes by Backprop, the from-scratch trainers) the record only warns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from bayescli.errors import BayescliError, require
from bayescli.posterior.selection import Criterion, Scored, Selection, log_grid, select_on_grid, unvalidated

P = TypeVar("P")

SETTING = "prior_precision"
MARGLIK_RULE = "Laplace marginal likelihood"
# The seed's δ grid for UCI (App. B.3): 10 log-spaced values in [1e-2, 1e2], where the from-scratch
# trainers select (``select=True``).
SELECT_GRID = [float(v) for v in np.logspace(-2, 2, 10)]


@dataclass
class Validation:
    """Held-out data to score candidates on.

    ``predictive(posterior)`` is the posterior's validation predictive ``[N, K]`` with its
    log-probabilities (the method's own: ``objective`` says which), ``labels [N]``; ``map_probs
    [N, K]`` the network's own softmax and ``map_logits [N, K]`` its logits (MAP's NLL exact), or
    ``None`` where there is no trained network to compare with (from scratch).
    """

    predictive: Callable[[object], Scored]
    labels: torch.Tensor
    objective: str
    map_probs: torch.Tensor | None = None
    map_logits: torch.Tensor | None = None


@dataclass
class Grid:
    """A fixed grid of ``δ`` and how it grows past an edge minimum: up to ``extensions`` times by
    ``extend_by`` points of the same log spacing."""

    values: list[float]
    extensions: int
    extend_by: int


# GLM VI's and GGP VI's trainers: the seed's grid, extended by 8 points past an edge minimum, up to
# twice (their selection before held-out selection became the default).
TRAINER_GRID = Grid(SELECT_GRID, extensions=2, extend_by=8)


@dataclass
class Default:
    """The ``δ`` used without a given value or validation data, and the rule it follows."""

    value: float
    method: str
    rule: str


def select_criterion(value: Criterion | str) -> Criterion:
    """``value`` as a :class:`Criterion` (the ``select_by`` setting)."""
    try:
        return Criterion(value)
    except ValueError:
        names = ", ".join(c.value for c in Criterion)
        raise BayescliError(f"select_by must be one of {names}, got '{value}'") from None


def require_validation(select: bool | None, has_val: bool) -> None:
    """``select=True`` is an error without labelled validation data."""
    require(
        select is not True or has_val,
        "select=True chooses prior_precision on held-out data but no validation data (`val`) was "
        "given; pass labelled validation data or leave select unset",
    )


def selects(given: float | None, select: bool | None, has_val: bool) -> bool:
    """Whether ``δ`` is chosen on validation data (not given, ``select`` not ``False``, data present)."""
    return given is None and select is not False and has_val


def choose_prior_precision(
    given: float | None,
    select: bool | None,
    criterion: Criterion,
    default: Callable[[], Default],
    run: Callable[[float], P],
    val: Validation | None,
    grid: Grid | None = None,
    map_point: Callable[[P], P] | None = None,
    map_point_label: str = "MAP",
) -> tuple[P, Selection]:
    """The posterior ``run(δ)`` at the chosen ``δ`` and how ``δ`` was set (its ``prior`` block:
    the file's ``prior`` entry, less the value).

    ``default()`` gives the principled ``δ_0`` (computed only when needed). ``grid`` replaces the
    grid around ``δ_0`` (the from-scratch trainers' :data:`SELECT_GRID`). ``map_point(best)``, if
    given, returns the point mass at MAP (``best`` is the best candidate, for its records): it is
    returned instead when selection ran against MAP's validation scores and no ``δ`` beat them
    (``map_fallback``; ``map_point_label`` names the point in the warning, e.g. "the MAP head").
    """
    require_validation(select, val is not None)
    if given is not None:
        post = run(given)
        selection = unvalidated(SETTING, given, "given", fixed=True)
        selection.prior = {"method": "given"}
        return post, selection
    if not selects(given, select, val is not None):
        base = default()
        post = run(base.value)
        selection = unvalidated(SETTING, base.value, base.rule)
        selection.prior = {"method": base.method}
        return post, selection
    principled = None
    if grid is None:
        principled = default().value
        grid = Grid(log_grid(principled, -2, 2), extensions=2, extend_by=2)

    def candidate(delta: float) -> tuple[P, Scored]:
        post = run(delta)
        return post, val.predictive(post)

    post, selection = select_on_grid(
        SETTING,
        grid.values,
        candidate,
        val.labels,
        criterion,
        map_probs=val.map_probs,
        map_logits=val.map_logits,
        principled=principled,
        extensions=grid.extensions,
        extend_by=grid.extend_by,
    )
    selection.extra["objective"] = val.objective
    selection.prior = {"method": f"val-{criterion.value}", "objective": val.objective}
    if selection.map_scores is not None:
        chosen = next(p for p in selection.curve if p[SETTING] == selection.chosen)
        key = criterion.value
        if chosen[key] > selection.map_scores[key] and map_point is not None:
            # No δ beats MAP: return MAP itself, the end of the candidate set.
            post = map_point(post)
            lo, hi = selection.curve[0][SETTING], selection.curve[-1][SETTING]
            selection.map_fallback = True
            selection.add_warning(
                f"no {SETTING} in {lo:.3g}–{hi:.3g} improves on MAP's validation {key} "
                f"({selection.map_scores[key]:.4g} vs best {chosen[key]:.4g}): the posterior is the point "
                f"mass at {map_point_label} (zero variances)"
            )
            selection.prior = {"method": "map-fallback", "objective": val.objective}
            return post, selection
        if chosen[key] > selection.map_scores[key]:
            selection.add_warning(
                f"every {SETTING} searched scores a worse validation {key} than MAP "
                f"(best {chosen[key]:.4g} at {selection.chosen:.3g}, MAP {selection.map_scores[key]:.4g}); "
                "the network's own predictions score better on this validation set"
            )
    return post, selection
