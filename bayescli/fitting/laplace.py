"""Laplace as a registered method: its settings and ``fit(source, settings)``.

The maths is in :mod:`bayescli.posterior.laplace` (curvature, the weight Gaussian, marglik); this
module chooses the prior precision δ. It sits above the predictives because choosing δ on
held-out data scores the GLM predictive (a link over the logit Gaussian).

δ, by :attr:`LaplaceSettings.prior_precision`:

* ``None`` (default): on validation data (``source.val``) the δ with the lowest validation
  ``select_by`` score on a log grid that includes marglik's δ and reaches the MAP limit (δ so
  large that every validation logit variance is ≤ 1e-4, where the probit predictive is MAP's to
  ~1e-5 in NLL); without validation data, marglik (recorded as not validated).
* :attr:`PriorRule.MARGLIK`: the Laplace marginal likelihood's maximiser (``"auto"`` on the CLI).
* :attr:`PriorRule.VALIDATION`: like ``None`` but an error without validation data.
* a positive number: used as is.

The likelihood is the classifier's (``source.model.likelihood``): for a multi-label (``bernoulli``)
model the curvature and marglik are the Bernoulli ones, the validation scores are means over
labels of per-label scores, and ``link`` is a sigmoid link (``probit`` by default).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from enum import Enum

import torch

from bayescli.data import Data
from bayescli.errors import BayescliError, require
from bayescli.fitting.fit_source import FitSource
from bayescli.models.features import Features
from bayescli.models.specs import Classifier
from bayescli.options import Backend, CurvatureType, HessianStructure, Link, Predictive, Subset
from bayescli.posterior.laplace import LaplacePosterior, fit_laplace
from bayescli.posterior.selection import Criterion, Scored, Selection, select_on_grid, unvalidated
from bayescli.predictive.glm import map_probabilities, predict

__all__ = ["LaplacePosterior", "LaplaceSettings", "PriorRule", "fit", "map_limit", "select_prior"]

# Grid points per decade and decades below marglik's δ that validation searches.
STEPS_PER_DECADE = 2
DECADES_BELOW = 3
# The MAP end: the smallest δ whose largest validation logit variance is below this.
MAP_LIMIT_VARIANCE = 1e-4


class PriorRule(str, Enum):
    """How δ is chosen when it is not a number."""

    MARGLIK = "auto"
    VALIDATION = "val-nll"


@dataclass
class LaplaceSettings:
    """Settings of a Laplace fit.

    * ``subset``: ``last-layer`` (features) or ``all`` (every weight; diag, or full on small nets).
    * ``hessian``: curvature structure ``diag`` | ``kron`` | ``full``.
    * ``curvature``: ``ggn`` (exact), ``ggn-mc`` (one sampled label) or ``ef`` (empirical Fisher).
    * ``backend``: last-layer curvature engine (``auto``: closed form where it applies).
    * ``prior_precision``: δ — ``None`` (validated when validation data exists, else marglik),
      a :class:`PriorRule`, or a positive number (module docs).
    * ``predictive``, ``link``: the predictive scored on validation data (``glm`` or ``bnn``; a
      multi-label model takes ``glm`` with ``none``, ``probit``, ``mc`` or ``beta``).
    * ``select_by``: the validation criterion (``nll`` | ``ece`` | ``brier``).
    * ``refine_steps``: Newton/L-BFGS steps to the GLM mode before fitting (last layer).
    * ``samples``: MC samples of the ``bnn`` predictive or ``mc`` link during selection.
    * ``seed``: MC curvature labels and predictive samples.
    """

    subset: Subset = Subset.LAST_LAYER
    hessian: HessianStructure = HessianStructure.KRON
    curvature: CurvatureType = CurvatureType.GGN
    backend: Backend = Backend.AUTO
    prior_precision: float | PriorRule | None = None
    predictive: Predictive = Predictive.GLM
    link: Link = Link.PROBIT
    select_by: Criterion = Criterion.NLL
    refine_steps: int = 0
    samples: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        for name, kind in (
            ("subset", Subset),
            ("hessian", HessianStructure),
            ("curvature", CurvatureType),
            ("backend", Backend),
            ("predictive", Predictive),
            ("link", Link),
            ("select_by", Criterion),
        ):
            value = getattr(self, name)
            try:
                setattr(self, name, kind(value))
            except ValueError:
                raise BayescliError(
                    f"{name} cannot be '{value}'; use one of {', '.join(m.value for m in kind)}"
                ) from None
        self.prior_precision = parse_prior(self.prior_precision)
        require(
            self.predictive is not Predictive.GGP,
            "predictive='ggp' cannot choose δ (its fitting points depend on δ); use 'glm' or 'bnn'",
        )
        require(self.refine_steps >= 0, f"refine_steps must be >= 0, got {self.refine_steps}")
        require(self.samples >= 1, f"samples must be >= 1, got {self.samples}")
        require(
            self.refine_steps == 0 or self.subset is Subset.LAST_LAYER,
            "refine_steps applies to last-layer posteriors; use subset='last-layer'",
        )

    def check_shardable(self) -> None:
        """Raise unless this fit shards under ``torchrun``: last-layer curvature is a sum over the
        fitting rows (each process sums its shard's); all-layer fits and the GLM-mode refinement
        run over every row in one process."""
        require(
            self.subset is Subset.LAST_LAYER and not self.refine_steps,
            "under torchrun only last-layer Laplace fits without refine_steps are sharded; run one process",
        )


def parse_prior(value: float | str | PriorRule | None) -> float | PriorRule | None:
    """``prior_precision`` from a number, a rule or its name (``auto``/``marglik``, ``val-nll``)."""
    if value is None or isinstance(value, PriorRule):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "marglik"):
            return PriorRule.MARGLIK
        if text in ("val-nll", "validation"):
            return PriorRule.VALIDATION
        if text in ("", "default", "none"):
            return None
        try:
            value = float(text)
        except ValueError:
            raise BayescliError(
                f"prior_precision must be a positive number, 'auto' (marglik) or 'val-nll'; got '{value}'"
            ) from None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value > 0
        or not math.isfinite(value)
    ):
        raise BayescliError(f"prior_precision must be a positive finite number, got {value}")
    return float(value)


def fit(source: FitSource, settings: LaplaceSettings) -> LaplacePosterior:
    """Fit a Laplace approximation on ``source`` and choose δ (module docs).

    Last layer: the fitting set's features are streamed (one batch in memory, or read from
    ``source``'s memo when another method already extracted them). All layers: pixel batches.
    How δ was chosen is ``post.selection`` (validated or not, as every method records it; its
    ``prior`` block is the file's ``prior`` entry: method, curve, …).
    """
    s = settings
    start = time.perf_counter()
    rule = s.prior_precision
    validate = rule is PriorRule.VALIDATION or (rule is None and source.val is not None)
    require(
        not (rule is PriorRule.VALIDATION and source.val is None),
        "prior_precision='val-nll' needs validation data (val)",
    )
    clf = source.classifier.to(source.device)
    batches = features = None
    if s.subset is Subset.ALL:
        batches = source.data.batches(source.batch_size)
    elif source.has_features():
        feats = source.features()
        features = [(feats.phi, feats.labels)]
    else:
        features = source.stream().pairs()
    initial = rule if isinstance(rule, float) else "auto"
    post = fit_laplace(
        clf,
        batches=batches,
        subset=s.subset,
        structure=s.hessian,
        curvature=s.curvature,
        backend=s.backend,
        prior_precision=initial,
        batch_size=max(source.batch_size, 1024),
        seed=s.seed,
        refine_steps=s.refine_steps,
        features=features,
        likelihood=source.model.likelihood,
    )
    post.meta["backend"] = s.backend.value
    if validate:
        _select_prior(post, source, s)
        post.meta["fit_seconds"] = time.perf_counter() - start  # the curvature and the selection
        return post
    if isinstance(rule, float):
        post.selection = unvalidated("prior_precision", rule, "given", fixed=True)
    else:
        post.selection = unvalidated(
            "prior_precision",
            post.prior_precision,
            "Laplace marginal likelihood (no validation data: pass val to choose δ on held-out data)",
            fixed=rule is PriorRule.MARGLIK,
        )
    post.selection.prior = _prior_block(post)
    return post


def _prior_block(post: LaplacePosterior) -> dict:
    """The ``prior`` record :meth:`LaplacePosterior.set_prior_precision` left in ``meta``, moved
    to the selection (less its ``value``: the file writes the posterior's δ)."""
    return {k: v for k, v in post.meta.pop("prior", {}).items() if k != "value"}


def _select_prior(post: LaplacePosterior, source: FitSource, s: LaplaceSettings) -> None:
    """Choose δ on ``source.val`` (grid through marglik's δ up to the MAP limit)."""
    select_prior(
        post,
        source.val_features(),
        s,
        classifier=source.classifier,
        val_data=source.val,
        batch_size=source.batch_size,
    )


def select_prior(
    post: LaplacePosterior,
    val: Features,
    settings: LaplaceSettings,
    *,
    classifier: Classifier | None = None,
    val_data: Data | None = None,
    batch_size: int = 256,
    grid: list[float] | None = None,
) -> Selection:
    """Set δ to the value with the lowest validation ``settings.select_by`` of the (predictive,
    link) on ``val`` (features ``phi [N, D]``, MAP ``logits [N, K]``, ``labels [N]``, or ``[N, K]``
    for a multi-label posterior, scored per label: :func:`~bayescli.posterior.selection.scores`); all-layer
    posteriors also need ``classifier`` and the validation inputs ``val_data``.

    The default grid runs through the current δ (marglik's, as fitted) in steps of
    10^(1/:data:`STEPS_PER_DECADE`) from :data:`DECADES_BELOW` decades below it up to the MAP limit
    (:func:`map_limit`). The candidates are scored on a copy of ``post``'s Gaussian, so ``post``
    changes once, to the chosen δ; the record is ``post.selection`` (its ``prior`` block, the
    file's ``prior`` entry, names the criterion).
    """
    s = settings
    labels = val.labels.to(val.phi.device)
    marglik = post.prior_precision
    if grid is None:
        upper = map_limit(post, val, classifier, val_data, batch_size)
        ratio = 10.0 ** (1.0 / STEPS_PER_DECADE)
        high = max(0, math.ceil(math.log(upper / marglik, ratio)))
        grid = [marglik * ratio**i for i in range(-DECADES_BELOW * STEPS_PER_DECADE, high + 1)]
    scorer = _scoring_copy(post)

    def candidate(delta: float) -> tuple[LaplacePosterior, Scored]:
        scorer.gaussian.with_delta(delta)
        pred = predict(
            scorer,
            val,
            s.predictive,
            s.link,
            s.samples,
            s.seed,
            classifier=classifier,
            data=val_data,
            batch_size=batch_size,
        )
        log_odds = None if pred.per_label is None else pred.per_label.log_odds
        return scorer, Scored(pred.probs, pred.log_probs, log_odds)

    _, sel = select_on_grid(
        "prior_precision",
        grid,
        candidate,
        labels,
        s.select_by,
        map_probs=map_probabilities(val.logits, post.likelihood),
        map_logits=val.logits,
        principled=marglik,
        map_side="high",
    )
    curve = [[row["prior_precision"], row[s.select_by.value]] for row in sel.curve]
    post.selection = None  # this choice replaces any earlier record
    post.set_prior_precision(sel.chosen, f"val-{s.select_by.value}", curve)
    sel.prior = _prior_block(post)
    sel.prior["objective"] = f"validation {s.select_by.value} ({s.predictive.value}, {s.link.value})"
    sel.prior["marglik"] = marglik
    sel.prior.pop("warning", None)  # the selection's own warning says more
    post.selection = sel
    return sel


def _scoring_copy(post: LaplacePosterior) -> LaplacePosterior:
    """``post`` with a Gaussian of its own: setting the copy's δ leaves ``post`` as it is (δ's
    refresh rebinds the derived tensors; the mean and curvature are shared, read only)."""
    scorer = copy.copy(post)
    scorer.gaussian = copy.copy(post.gaussian)
    return scorer


def map_limit(
    post: LaplacePosterior,
    val: Features,
    classifier: Classifier | None = None,
    val_data: Data | None = None,
    batch_size: int = 256,
) -> float:
    """The smallest power-of-ten multiple of the current δ at which every validation logit
    variance is ≤ :data:`MAP_LIMIT_VARIANCE` (there the GLM predictive is MAP's to ~1e-5 NLL).

    Once δ dominates the curvature the logit variance falls as 1/δ, so each evaluation predicts
    the factor still needed; the loop confirms it at the limit itself. ``post`` is left as it is
    (the variances are those of a copy's Gaussian)."""
    scorer = _scoring_copy(post)

    def largest_variance(delta: float) -> float:
        scorer.gaussian.with_delta(delta)
        if scorer.needs_inputs:
            parts = [scorer.logit_gaussian_inputs(classifier, x) for x, _ in val_data.batches(batch_size)]
            return float(torch.cat([p.var for p in parts]).max())
        return float(scorer.logit_gaussian(val.phi).var.max())

    delta = post.prior_precision
    for _ in range(6):
        v = largest_variance(delta)
        if v <= MAP_LIMIT_VARIANCE:
            break
        delta *= 10.0 ** math.ceil(math.log10(v / MAP_LIMIT_VARIANCE))
    return delta
