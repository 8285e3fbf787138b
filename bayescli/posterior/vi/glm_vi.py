"""GLM VI (seed 003 §2.3–2.4, App. B.1): Gaussian variational inference in the linearised network.

Model. Linearising the network at its trained weights ``θ*`` gives a generalised linear model with
logits ``f_lin(x, θ) = f(x; θ*) + J(x)(θ − θ*)`` and prior ``θ ~ N(0, δ⁻¹ I)``. For the last layer
``J = I_K ⊗ φ̃ᵀ`` and ``f_lin = W̃ φ̃`` (the head is linear: nothing is approximated).

Family and objective. ``q(θ) = N(μ, Σ)``, ``Σ`` full or diagonal, maximising

    ELBO = Σ_n E_q[log softmax(f_lin(x_n, θ))_{y_n}] − KL(q ‖ N(0, δ⁻¹ I)).

Updates: natural-gradient VI (Khan et al. 2018; Zhang et al. 2018; the seed's App. B.1). With the
residual ``r = y − softmax(f)`` and ``Λ = diag(p) − ppᵀ`` (minus the log-softmax Hessian),

    Σ⁻¹ ← (1 − β) Σ⁻¹ + β (Σ_n J_nᵀ E[Λ_n] J_n + δ I)        (diag: the diagonal of the bracket)
    μ   ← μ + β Σ_new (Σ_n J_nᵀ E[r_n] − δ μ),

expectations under the current logit marginals ``N(f_lin(x_n, μ), J_n Σ J_nᵀ)``. In a GLM
``−∇²_θ log p(y | f_lin) = Jᵀ Λ J`` exactly (the GGN *is* the Hessian), so the fixed point is the
ELBO's stationary point: ``Σ⁻¹ = E[Σ_n J_nᵀ Λ_n J_n] + δI`` and ``Σ_n J_nᵀ E[r_n] = δ μ`` (for
diag, the optimum over diagonal ``Σ``). ``β`` = ``lr`` is the step fraction: the distance to the
fixed point shrinks roughly by ``(1 − β)`` per iteration, so the seed's defaults (250 iterations,
β = 1e-2 diag / 1e-3 full) leave about 8% / 78% of it; ``meta["vi"]`` records the residuals.

Expectations of the softmax likelihood under the Gaussian logits
(:mod:`~bayescli.posterior.vi.softmax_expectations`): for ``K = 2`` exactly, by 64-node
Gauss–Hermite on the logit difference ``f₀ − f₁``; for ``K > 2`` by Monte Carlo, ``samples``
draws per input and iteration from a generator seeded with ``seed`` (fresh draws every iteration;
the update's averaging with weight β pools them over ~1/β iterations). The linearised data and
the iteration live in :mod:`~bayescli.posterior.vi.linearised_glm`.

Start: the Laplace posterior of :func:`bayescli.posterior.laplace.fit_laplace` with the same
structure, ``μ = θ*``, ``Σ⁻¹ = H_GGN(θ*) + δI``. ``δ`` (:mod:`~bayescli.posterior.vi.prior_precision`):
given, else chosen on validation data over a grid around the Laplace marginal-likelihood optimum,
else that optimum. No ``δ`` recovers MAP: the mean is fitted under a zero-centred prior, so as
``δ → ∞`` it shrinks to zero with the covariance (measured on digits: validation NLL 0.09 → 1.5).
The MAP end of the candidate set is the point mass at ``θ*``: when selection runs (post hoc, with
validation data) and no ``δ`` on the grid scores better than MAP on ``select_by``, :func:`fit`
returns it (``selection.map_fallback``, with a warning), stored in the same container as ``μ = θ*``,
curvature zero and ``δ = POINT_MASS_PRECISION`` (1e30), so every weight variance is ``1e-30`` and
its predictive is the network's own (logit variances ``‖φ̃‖²·1e-30`` last layer, ``J Jᵀ·1e-30``
all layers). Measured on the digits small CNN of tests/conftest.py (default settings): best
validation NLL on the grid 0.0692 vs MAP's 0.0452, so the fit returns MAP (test NLL 0.0545, MAP's).

Multi-label classifiers (``likelihood == "bernoulli"``, a sigmoid per label, labels ``[N, K]``;
last layer): ``log p(y | f) = Σ_k [y_k log σ(f_k) + (1 − y_k) log(1 − σ(f_k))]``, so ``r = y − σ(f)``
and ``Λ = diag(σ(f)(1 − σ(f)))``; their expectations under the logit marginals ``N(μ_k, v_k)`` are
1-D integrals per label, by quadrature (:mod:`~bayescli.posterior.vi.bernoulli_expectations`,
exact to ~1e-12), and the curvature is block-diagonal over labels. The Laplace start is the
Bernoulli one (:mod:`bayescli.posterior.bernoulli_curvature`), the validation predictive
``E[σ(f_k)]`` per label (the limit of the ``mc`` link) scored per label against MAP's sigmoids.

The posterior is stored as ``curvature = Σ⁻¹ − δI`` in the Laplace containers
(:class:`DiagGaussian` / :class:`FullGaussian`), so their GLM push-forwards give its logit
Gaussian unchanged (exact: the GLM predictive of ``q`` *is* that Gaussian).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from bayescli.errors import BayescliError, require
from bayescli.fitting.fit_source import FitSource
from bayescli.metrics.classification import map_probabilities
from bayescli.models.specs import Classifier
from bayescli.options import Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.curvature import network_jacobian
from bayescli.posterior.gaussian import (
    MAX_FULL_PARAMS,
    DiagGaussian,
    FullGaussian,
    LogitGaussian,
    WeightGaussian,
    augment,
)
from bayescli.posterior.laplace import LaplacePosterior, fit_laplace
from bayescli.posterior.selection import Criterion, Scored
from bayescli.posterior.vi.bernoulli_expectations import (
    HERMITE_BANDS,
    LAGUERRE_NODES,
    SWITCH_STD,
    sigmoid_predictive,
)
from bayescli.posterior.vi.linearised_glm import GLMData, NGVIResult, linearised_data, natural_gradient_vi
from bayescli.posterior.vi.network_weights import flat_parameters, network_logits
from bayescli.posterior.vi.prior_precision import (
    MARGLIK_RULE,
    Default,
    Grid,
    Validation,
    choose_prior_precision,
    require_validation,
    select_criterion,
    selects,
)
from bayescli.posterior.vi.setting_values import as_float
from bayescli.posterior.vi.softmax_expectations import VAL_SAMPLES, expectation_label, mc_predictive

COVARIANCES = ("diag", "full")
# δ of the point mass at θ* (curvature zero): weight variances 1e-30, finite so the file's JSON
# header holds it.
POINT_MASS_PRECISION = 1e30


# Fitting sets larger than this iterate on minibatches of MINIBATCH rows (``minibatch=None``); the
# seed's full-batch iteration costs four [N, D]×[D, K] GEMMs and N·K·samples softmax draws per
# iteration (≈ 7 s at 20,000 × 2048 → 1000 on 2 cores, 250 iterations per δ). With β = 0.05 the
# update averages ~20 minibatches: one pass over 20,000 rows.
FULL_BATCH_ROWS = 8192
MINIBATCH = 1024
# On minibatches the step fraction is this many times the seed's, for this many times fewer
# iterations: (1 − 5β)^(T/5) ≈ (1 − β)^T leaves the same distance to the fixed point (8% diag).
STOCHASTIC_SPEEDUP = 5


def default_lr(covariance: str, stochastic: bool = False) -> float:
    """The seed's step fractions (App. B.1): 1e-2 for diagonal, 1e-3 for full covariances (×5 on
    minibatches, :data:`STOCHASTIC_SPEEDUP`)."""
    return (1e-2 if covariance == "diag" else 1e-3) * (STOCHASTIC_SPEEDUP if stochastic else 1)


@dataclass
class GLMVIConfig:
    """Settings of GLM VI (``glm-vi``).

    * ``subset``: ``last-layer`` (the head, on features) or ``all`` (every weight, per-input Jacobians).
    * ``covariance``: ``diag`` or ``full`` (full needs ≤ 20,000 parameters, as for Laplace).
    * ``prior_precision``: δ; ``None`` = chosen on validation data if any (see ``select``), else the
      Laplace marginal-likelihood optimum at θ*.
    * ``epochs``: natural-gradient iterations; ``None`` = 250, the seed's (50 on minibatches).
    * ``lr``: the step fraction β; ``None`` = 1e-2 (diag) or 1e-3 (full), the seed's (×5 on
      minibatches: the same distance to the fixed point in 1/5 of the iterations).
    * ``minibatch``: rows per iteration; ``None`` = every row up to 8,192 fitting rows, 1,024 beyond
      (stochastic natural-gradient VI, unbiased sums scaled by ``N/B``); ``0`` = always every row.
    * ``batch_size``: inputs per chunk of the sums (memory only).
    * ``samples``: Monte-Carlo logit draws per input and iteration when K > 2 (K = 2 is exact).
    * ``seed``: seeds the Monte-Carlo draws and the validation predictive.
    * ``select``: choose δ on validation data — ``None`` (default): whenever validation data is
      given and δ is not; ``True``: required (an error without validation data); ``False``: never.
      A given ``prior_precision`` is always used as is. The from-scratch trainer selects only with
      ``True`` (over the seed's grid).
    * ``select_by``: the validation criterion (``nll``, ``ece`` or ``brier``).
    """

    subset: Subset = Subset.LAST_LAYER
    covariance: str = "diag"
    prior_precision: float | None = None
    epochs: int | None = None
    lr: float | None = None
    minibatch: int | None = None
    batch_size: int = 1024
    samples: int = 8
    seed: int = 0
    select: bool | None = None
    select_by: Criterion = Criterion.NLL

    def __post_init__(self) -> None:
        try:
            self.subset = Subset(self.subset)
        except ValueError:
            raise BayescliError(f"subset must be 'last-layer' or 'all', got '{self.subset}'") from None
        require(self.covariance in COVARIANCES, f"covariance must be diag or full, got '{self.covariance}'")
        self.prior_precision = as_float(self.prior_precision, "prior_precision")
        self.lr = as_float(self.lr, "lr")
        require(
            self.prior_precision is None or self.prior_precision > 0,
            f"prior_precision must be positive, got {self.prior_precision}",
        )
        require(self.lr is None or 0 < self.lr <= 1, f"lr is a step fraction in (0, 1], got {self.lr}")
        require(
            (self.epochs is None or self.epochs >= 1) and min(self.samples, self.batch_size) >= 1,
            "epochs, samples and batch_size must be at least 1",
        )
        require(
            self.minibatch is None or self.minibatch >= 0, f"minibatch must be >= 0, got {self.minibatch}"
        )
        self.select_by = select_criterion(self.select_by)

    def rows_per_iteration(self, n: int) -> int | None:
        """Rows each iteration sums over, ``None`` for all ``n`` (``minibatch``'s rule)."""
        size = self.minibatch if self.minibatch is not None else (MINIBATCH if n > FULL_BATCH_ROWS else 0)
        return size if 0 < size < n else None

    def iteration(self, n: int) -> tuple[int, float, int | None]:
        """``(iterations, step fraction β, minibatch rows or None)`` for ``n`` fitting rows."""
        rows = self.rows_per_iteration(n)
        stochastic = rows is not None
        epochs = self.epochs if self.epochs is not None else 250 // (STOCHASTIC_SPEEDUP if stochastic else 1)
        return epochs, self.lr if self.lr is not None else default_lr(self.covariance, stochastic), rows


# ---------------------------------------------------------------------------------------------
# the posterior
# ---------------------------------------------------------------------------------------------


@dataclass
class GLMVIPosterior(Posterior):
    """``q(θ) = N(μ, Σ)`` in the linearised network; ``gaussian`` holds ``μ``, ``Σ⁻¹ − δI`` and ``δ``;
    ``likelihood`` the classifier's (``categorical`` or ``bernoulli``; files without it: categorical)."""

    gaussian: WeightGaussian
    subset: Subset
    head_bias: bool
    n_data: int
    meta: dict = field(default_factory=dict)
    likelihood: str = "categorical"

    method: ClassVar[str] = "glm-vi"

    @property
    def label(self) -> str:
        return f"glm-vi {self.subset.value} {self.covariance}"

    @property
    def covariance(self) -> str:
        return self.gaussian.structure

    @property
    def prior_precision(self) -> float:
        return self.gaussian.delta

    def summary(self) -> dict:
        vi = self.meta.get("vi", {})
        return {
            "covariance": self.covariance,
            "likelihood": self.likelihood,
            "prior_precision": self.prior_precision,
            "prior_method": self.meta.get("prior", {}).get("method"),
            "iterations": vi.get("epochs"),
            "step": vi.get("lr"),
            "expectations": vi.get("expectations"),
            "n_data": self.n_data,
        }

    def logit_gaussian(self, phi: torch.Tensor) -> LogitGaussian:
        """GLM logit Gaussian ``N(W̃_μ φ̃, (I ⊗ φ̃ᵀ) Σ (I ⊗ φ̃))`` for features ``phi [N, D]``."""
        if self.subset is not Subset.LAST_LAYER:
            raise BayescliError("this posterior covers all layers; use logit_gaussian_inputs")
        lg = self.gaussian.push_last_layer(phi.to(self.gaussian.mean.dtype), self.head_bias)
        return _cast(lg, phi.dtype)

    def logit_gaussian_inputs(self, classifier: Classifier, x: torch.Tensor) -> LogitGaussian:
        """GLM logit Gaussian ``N(f(x; θ*) + J(μ − θ*), J Σ Jᵀ)`` for inputs ``x [N, ...]``.

        ``classifier`` must carry ``θ*`` (the checkpoint the posterior was fitted on).
        """
        x = x.to(self.gaussian.mean.device)
        if self.subset is Subset.LAST_LAYER:
            return self.logit_gaussian(classifier.features(x))
        f, jac = network_jacobian(classifier.net, classifier.normalise(x))
        theta_star = flat_parameters(classifier.net).to(self.gaussian.mean.dtype)
        require(
            theta_star.numel() == self.gaussian.num_params,
            f"the posterior has {self.gaussian.num_params:,} weights but the network "
            f"{theta_star.numel():,}; use the checkpoint it was fitted on",
        )
        jac = jac.to(self.gaussian.mean.dtype)
        mean = f.to(jac.dtype) + jac @ (self.gaussian.mean.reshape(-1) - theta_star)
        return _cast(self.gaussian.push_jacobian(mean, jac), x.dtype)

    def sample_logits(
        self,
        num: int,
        classifier: Classifier,
        x: torch.Tensor | None,
        phi: torch.Tensor | None,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """BNN predictive: logits ``[M, N, K]`` of the network at ``M`` draws from ``q``."""
        draws = self.gaussian.sample(num, generator)
        if self.subset is Subset.LAST_LAYER:
            phi_aug = augment(phi) if self.head_bias else phi
            w = draws.reshape(num, *self.gaussian.mean.shape)
            return torch.einsum("nd,mkd->mnk", phi_aug.to(w.dtype), w).to(phi.dtype)
        return network_logits(classifier, x.to(draws.device), draws)

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.gaussian.tensors()

    def own_metadata(self) -> dict:
        return {
            "covariance": self.covariance,
            "likelihood": self.likelihood,
            "head_bias": self.head_bias,
            "n_data": self.n_data,
            "prior_precision": self.prior_precision,
            "predictive": "glm",
            "exact": True,
        }

    @classmethod
    def from_file(cls, tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> GLMVIPosterior:
        delta = float(meta["prior_precision"])
        if meta["covariance"] == "diag":
            gauss: WeightGaussian = DiagGaussian(tensors["mean"], tensors["curvature_diag"], delta)
        else:
            gauss = FullGaussian(tensors["mean"], tensors["curvature_full"], delta)
        return cls(
            gauss,
            Subset(meta["subset"]),
            bool(meta["head_bias"]),
            int(meta["n_data"]),
            cls.provenance(meta, _OWN_KEYS),
            str(meta.get("likelihood", "categorical")),
        )


_OWN_KEYS = {"covariance", "likelihood", "head_bias", "n_data", "prior_precision", "predictive", "exact"}


def _cast(lg: LogitGaussian, dtype: torch.dtype) -> LogitGaussian:
    return LogitGaussian(
        lg.mean.to(dtype), lg.var.to(dtype), None if lg.cov is None else lg.cov.to(dtype), exact=lg.exact
    )


# ---------------------------------------------------------------------------------------------
# fitting
# ---------------------------------------------------------------------------------------------


def check_full_size(num_params: int, covariance: str, subset: Subset) -> None:
    """Refuse a full covariance over more than :data:`MAX_FULL_PARAMS` weights (Laplace's limit)."""
    if covariance == "full" and num_params > MAX_FULL_PARAMS:
        raise BayescliError(
            f"covariance 'full' needs ≤ {MAX_FULL_PARAMS:,} parameters; this {subset.value} posterior "
            f"has {num_params:,}. Use covariance 'diag'"
            + (" or subset 'last-layer'" if subset is Subset.ALL else "")
        )


@dataclass
class _Problem:
    """What one fit needs: the linearised data and the Laplace start."""

    data: GLMData
    laplace: LaplacePosterior


def _posterior(result: NGVIResult, delta: float, subset: Subset, data: GLMData) -> GLMVIPosterior:
    if result.curvature.shape == result.mean.shape:
        gauss: WeightGaussian = DiagGaussian(result.mean, result.curvature.clamp_min(0), delta)
    else:
        gauss = FullGaussian(result.mean, result.curvature, delta)
    bias = data.bias if data.last_layer else False
    return GLMVIPosterior(gauss, subset, bias, len(data), likelihood=data.likelihood)


def _validation(source: FitSource, cfg: GLMVIConfig) -> Validation:
    """The GLM predictive on the validation set (``VAL_SAMPLES`` seeded draws of its logit Gaussian),
    on the source's device."""
    feats = source.val_features()
    classifier, batch_size = source.classifier, source.batch_size
    last = Subset(cfg.subset) is Subset.LAST_LAYER
    val_phi = feats.phi if last else None
    likelihood = source.model.likelihood

    def predictive(post: GLMVIPosterior) -> Scored:
        if val_phi is not None:
            lg = post.logit_gaussian(val_phi)
        else:
            lg = LogitGaussian.cat(
                [post.logit_gaussian_inputs(classifier, x) for x, _ in source.val.batches(batch_size)]
            )
        if likelihood == "bernoulli":
            return sigmoid_predictive(lg.mean, lg.var)
        return mc_predictive(lg, cfg.seed)

    draws = "E[sigmoid] per label by quadrature" if likelihood == "bernoulli" else f"{VAL_SAMPLES} MC draws"
    objective = f"validation {cfg.select_by.value} (glm predictive, {draws})"
    map_probs = map_probabilities(feats.logits, likelihood)
    return Validation(predictive, source.val.y, objective, map_probs, feats.logits)


def _prepare(source: FitSource, cfg: GLMVIConfig) -> _Problem:
    subset = Subset(cfg.subset)
    classifier, train = source.classifier, source.data
    num_params = (
        classifier.num_classes * (classifier.feature_dim + (classifier.head.bias is not None))
        if subset is Subset.LAST_LAYER
        else sum(p.numel() for p in classifier.net.parameters())
    )
    check_full_size(num_params, cfg.covariance, subset)
    likelihood = source.model.likelihood
    if likelihood == "bernoulli" and subset is not Subset.LAST_LAYER:
        # the Laplace start and the per-input Jacobians of the all-layer iteration are softmax-only
        raise BayescliError(
            "glm-vi fits multi-label (bernoulli) models on the last layer only; use subset 'last-layer'"
        )
    # the backbone, the Laplace start and the iterations all run on the source's device
    phi = source.features().phi if subset is Subset.LAST_LAYER else None
    classifier.to(source.device).eval()
    data = linearised_data(classifier, train, subset, source.batch_size, phi, likelihood)
    if subset is Subset.LAST_LAYER:
        laplace = fit_laplace(
            classifier, phi=phi, labels=data.labels, structure=cfg.covariance, likelihood=likelihood
        )
    else:
        batches = list(train.batches(source.batch_size))
        laplace = fit_laplace(classifier, batches=batches, subset=subset, structure=cfg.covariance)
    return _Problem(data, laplace)


def _expectations(data: GLMData, samples: int) -> str:
    """How the likelihood's expectations are computed (recorded under ``meta["vi"]``)."""
    if data.likelihood == "bernoulli":
        return (
            f"exact: per label, Gauss-Hermite with {HERMITE_BANDS[0][1]}-{HERMITE_BANDS[-1][1]} nodes by "
            f"logit std (<= {SWITCH_STD}) or {LAGUERRE_NODES}-node Gauss-Laguerre on the smooth part"
        )
    return expectation_label(data.num_classes, samples)


def _thin(values: list[float], keep: int = 50) -> list[list[float]]:
    """``[[iteration, value], ...]`` at ≤ ``keep`` evenly spaced iterations (first and last kept)."""
    idx = sorted({round(i) for i in np.linspace(0, len(values) - 1, min(keep, len(values)))})
    return [[i, values[i]] for i in idx]


def fit_over_grid(
    source: FitSource, settings: GLMVIConfig, grid: Grid | None, *, map_fallback: bool = False
) -> GLMVIPosterior:
    """:func:`fit`, selecting δ over ``grid`` instead of the grid around the marginal-likelihood δ
    (the from-scratch trainer's :data:`~bayescli.posterior.vi.prior_precision.TRAINER_GRID`).
    ``map_fallback``: return the point mass at ``θ*`` when selection runs and no δ beats MAP."""
    start = time.perf_counter()
    require_validation(settings.select, source.val is not None)
    selecting = selects(settings.prior_precision, settings.select, source.val is not None)
    val = _validation(source, settings) if selecting else None
    problem = _prepare(source, settings)
    laplace, data = problem.laplace, problem.data
    subset = Subset(settings.subset)
    gauss = laplace.gaussian
    mean0 = gauss.mean.double()
    curv0 = (gauss.h if isinstance(gauss, DiagGaussian) else gauss.H).double()
    marglik = laplace.prior_precision
    cfg = settings

    epochs, step, rows = cfg.iteration(len(data))

    def run(delta: float) -> GLMVIPosterior:
        result = natural_gradient_vi(
            data, mean0, curv0, delta, epochs, step, cfg.samples, cfg.seed, cfg.batch_size, rows
        )
        post = _posterior(result, delta, subset, data)
        post.meta["vi"] = {
            "algorithm": "natural-gradient VI in the GLM (seed 003 App. B.1)",
            "start": "laplace",
            "laplace_marglik_prior_precision": marglik,
            "epochs": epochs,
            "lr": step,
            "minibatch": rows,
            "expectations": _expectations(data, cfg.samples),
            "elbo_first": result.elbo[0],
            "elbo_last": result.elbo[-1],
            "elbo": _thin(result.elbo),
            "fixed_point_residuals": result.residuals,
        }
        return post

    def default() -> Default:
        return Default(marglik, "laplace-marglik", MARGLIK_RULE)

    def point_mass(best: GLMVIPosterior) -> GLMVIPosterior:
        """``q = δ_{θ*}``: mean θ*, curvature zero, δ = POINT_MASS_PRECISION (variances 1e-30)."""
        if isinstance(gauss, DiagGaussian):
            point: WeightGaussian = DiagGaussian(mean0, torch.zeros_like(curv0), POINT_MASS_PRECISION)
        else:
            point = FullGaussian(mean0, torch.zeros_like(curv0), POINT_MASS_PRECISION)
        post = GLMVIPosterior(point, subset, best.head_bias, best.n_data, likelihood=best.likelihood)
        post.meta["vi"] = {
            "algorithm": "none: the point mass at θ* (no prior_precision beat MAP on validation)",
            "laplace_marglik_prior_precision": marglik,
        }
        return post

    post, selection = choose_prior_precision(
        cfg.prior_precision,
        cfg.select,
        cfg.select_by,
        default,
        run,
        val,
        grid,
        point_mass if map_fallback else None,
        "the MAP head" if subset is Subset.LAST_LAYER else "the MAP weights",
    )
    post.selection = selection
    post.meta["fit_seconds"] = time.perf_counter() - start
    return post


def fit(source: FitSource, settings: GLMVIConfig) -> GLMVIPosterior:
    """GLM VI post hoc on a trained checkpoint.

    δ: ``settings.prior_precision`` if given; else, with validation data (``source.val``) and
    ``select`` not ``False``, the best of ``δ_0 · 10^i``, ``i = −2 … 2`` (extended past an edge
    minimum) by ``select_by`` on the validation GLM predictive, ``δ_0`` the Laplace
    marginal-likelihood optimum; else ``δ_0``. ``post.selection`` records which. When selection
    ran and no δ scores better than MAP on validation, the posterior is the point mass at ``θ*``
    (``post.selection.map_fallback``; see the module docstring).
    """
    return fit_over_grid(source, settings, None, map_fallback=True)
