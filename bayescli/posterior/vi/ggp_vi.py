"""GGP VI (seed 003 §2.5, App. A.3–A.4, B.1): sparse variational GP classification with the GGP prior.

Prior. Linearising the network at ``θ*`` with ``θ ~ N(0, δ⁻¹ I)`` gives a GP with mean
``m(x) = f(x; θ*) − J(x) θ*`` and, classes taken independent (as the seed and
:mod:`bayescli.predictive.ggp` do), kernels ``k_c(x, x') = δ⁻¹ J_c(x) J_c(x')ᵀ``. Last layer:
``m = 0`` and one kernel ``δ⁻¹ φ̃(x)ᵀ φ̃(x')`` for every class (exact, rank ``D + 1``).

Posterior. ``M`` inducing inputs ``Z`` fixed to a seeded random subset of the fitting data
(the seed does not learn them), one whitened Gaussian per class: ``u_c = g_c(Z) = L_c v_c``,
``v_c ~ q = N(m_c, S_c)``, ``S_c = R_c R_cᵀ`` (``R_c`` lower triangular), prior ``N(0, I)``.
``L_c`` is a square root of ``K_c(Z, Z)`` from its eigendecomposition, truncated to the
eigenvalues above ``RANK_TOL`` of the largest: the last-layer kernel has rank ``D + 1``, often
below ``M``, where a Cholesky factor would need jitter. With ``W_c = diag(λ^{-½}) Uᵀ`` ``[r, M]``
and ``a_c(x) = W_c k_c(Z, x)``, the predictive of each class is Gaussian (Hensman et al. 2015):

    mean  m_c(x) + a_c(x)ᵀ m_c,      variance  k_c(x, x) − ‖a_c(x)‖² + ‖R_cᵀ a_c(x)‖².

Objective. ``ELBO = Σ_n E_q[log softmax(f(x_n))_{y_n}] − Σ_c KL(N(m_c, S_c) ‖ N(0, I))``, estimated
on minibatches (``−ELBO/N`` = batch mean NLL + KL/N, VI-SPEC §0), Adam with learning rate 0.1
(the seed's) under a cosine schedule to zero (so the final iterate settles; the seed's CIFAR runs
kept the rate constant). Expectations: ``K = 2`` Gauss–Hermite on ``f₀ − f₁``, else reparameterised
Monte Carlo (``samples`` draws, seeded). The variational mean starts at the network's own
function values (``u = f(Z; θ*) − m(Z)``), ``S_c`` at the prior ``I``.

Why not GPyTorch (the seed's library): its Cholesky whitening needs jitter for the rank-deficient
last-layer kernel, and its softmax likelihood estimates the expected log-likelihood with Monte-Carlo
draws from the global generator (with learned class-mixing weights by default); the exact
two-class expectation and seeded draws matter for the tests, and prediction from the posterior
file would need the same formulas as here anyway.

Prior precision ``δ`` (:mod:`~bayescli.posterior.vi.prior_precision`): given, else chosen on
validation data over a grid around the Laplace marginal-likelihood optimum, else that optimum.
No ``δ`` recovers MAP: the kernel scales as ``δ⁻¹`` around the prior mean (zero for a last layer),
so as ``δ → ∞`` the predictive tends to the prior's, not to the network's. The MAP end of the
candidate set is the point mass at ``θ*``: when selection runs (post hoc, with validation data) and
no ``δ`` on the grid scores better than MAP on ``select_by``, :func:`fit` returns a posterior in
point-mass mode (:class:`GGPVIPosterior`, ``point_mass``), recorded as ``selection.map_fallback``
with a warning. Measured on the digits small CNN of tests/conftest.py (default settings): best
validation NLL on the grid 0.0615 vs MAP's 0.0452, so the fit returns MAP (test NLL 0.0545, MAP's).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch

from bayescli import devices
from bayescli.data import Data
from bayescli.errors import BayescliError, require
from bayescli.fitting.fit_source import FitSource
from bayescli.models.specs import Classifier
from bayescli.options import Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.curvature import network_jacobian
from bayescli.posterior.gaussian import LogitGaussian, augment
from bayescli.posterior.laplace import fit_laplace, head_parameters
from bayescli.posterior.selection import Criterion, Scored
from bayescli.posterior.vi.linearised_glm import MAX_JACOBIAN_BYTES
from bayescli.posterior.vi.network_weights import flat_parameters
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
from bayescli.posterior.vi.softmax_expectations import (
    VAL_SAMPLES,
    expectation_label,
    mc_predictive,
)
from bayescli.posterior.vi.svgp import (
    CHUNK,
    Projected,
    predict_svgp,
    train_svgp,
    whitening,
)


@dataclass
class GGPVIConfig:
    """Settings of GGP VI (``ggp-vi``).

    * ``subset``: ``last-layer`` (kernel ``δ⁻¹ φ̃ᵀφ̃'``) or ``all`` (per-class Jacobian kernels).
    * ``inducing_points``: M, a seeded random subset of the fitting data (at most all of it).
    * ``prior_precision``: δ; ``None`` = chosen on validation data if any (see ``select``), else the
      Laplace marginal-likelihood optimum at θ* (Kronecker-factored for the last layer, diagonal
      for all layers).
    * ``epochs``, ``lr``, ``batch_size``: Adam on the minibatch ELBO (cosine schedule).
    * ``samples``: Monte-Carlo draws of the logits per input and step when K > 2 (K = 2 is exact).
    * ``seed``: seeds the inducing points, the minibatches and the draws.
    * ``select``: choose δ on validation data — ``None`` (default): whenever validation data is
      given and δ is not; ``True``: required (an error without validation data); ``False``: never.
      A given ``prior_precision`` is always used as is. The from-scratch trainer selects only with
      ``True`` (over the seed's grid).
    * ``select_by``: the validation criterion (``nll``, ``ece`` or ``brier``).
    """

    subset: Subset = Subset.LAST_LAYER
    inducing_points: int = 512
    prior_precision: float | None = None
    epochs: int = 50
    lr: float = 0.1
    batch_size: int = 256
    samples: int = 16
    seed: int = 0
    select: bool | None = None
    select_by: Criterion = Criterion.NLL

    def __post_init__(self) -> None:
        try:
            self.subset = Subset(self.subset)
        except ValueError:
            raise BayescliError(f"subset must be 'last-layer' or 'all', got '{self.subset}'") from None
        self.prior_precision = as_float(self.prior_precision, "prior_precision")
        require(
            self.prior_precision is None or self.prior_precision > 0,
            f"prior_precision must be positive, got {self.prior_precision}",
        )
        require(self.lr > 0, f"lr must be positive, got {self.lr}")
        require(
            min(self.inducing_points, self.epochs, self.batch_size, self.samples) >= 1,
            "inducing_points, epochs, batch_size and samples must be at least 1",
        )
        self.select_by = select_criterion(self.select_by)


# ---------------------------------------------------------------------------------------------
# whitened SVGP algebra
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# the posterior
# ---------------------------------------------------------------------------------------------


@dataclass
class GGPVIPosterior(Posterior):
    """Whitened SVGP per class under the GGP prior at ``prior_precision``.

    ``whiten [C|1, r, M]`` is ``W`` at the fitted ``δ``; ``var_mean [C, r]``, ``var_chol [C, r, r]``
    the variational parameters. Last layer: ``inducing [M, D]`` are the inducing points' features;
    all layers: their pixel-space inputs ``[M, ...]`` (their Jacobians are recomputed from the
    classifier, which must carry ``θ*``).

    Point-mass mode (``point_mass``, the file's ``point_mass`` flag): the posterior is the point
    mass at ``θ*`` (held-out selection found no ``δ`` better than MAP; ``selection.map_fallback``).
    Its logit Gaussian is the network's own logits with zero variance: last layer
    ``map_weight [K, D(+1)] · φ̃(x)`` (``map_weight`` the head ``[W, b]``, stored), all layers the
    classifier's logits ``f(x; θ*)`` (it must carry ``θ*``). The SVGP tensors are then the best grid
    candidate's, kept for the record and not used for prediction.
    """

    whiten: torch.Tensor
    var_mean: torch.Tensor
    var_chol: torch.Tensor
    inducing: torch.Tensor
    inducing_index: torch.Tensor
    prior_precision: float
    subset: Subset
    head_bias: bool
    n_data: int
    meta: dict = field(default_factory=dict)
    point_mass: bool = False
    map_weight: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    method: ClassVar[str] = "ggp-vi"

    def __post_init__(self) -> None:
        require(
            not (self.point_mass and self.subset is Subset.LAST_LAYER and self.map_weight is None),
            "a last-layer GGP VI point mass needs the MAP head weights (map_weight)",
        )

    @property
    def label(self) -> str:
        if self.point_mass:
            return f"ggp-vi {self.subset.value} MAP point mass"
        return f"ggp-vi {self.subset.value} M={len(self.inducing_index)}"

    def summary(self) -> dict:
        vi = self.meta.get("vi", {})
        return {
            "inducing_points": len(self.inducing_index),
            "rank": int(self.whiten.shape[1]),
            "prior_precision": self.prior_precision,
            "prior_method": self.meta.get("prior", {}).get("method"),
            "epochs": vi.get("epochs"),
            "expectations": vi.get("expectations"),
            "n_data": self.n_data,
            "point_mass": self.point_mass,
        }

    def _aug(self, phi: torch.Tensor) -> torch.Tensor:
        phi = phi.double()
        return augment(phi) if self.head_bias else phi

    def logit_gaussian(self, phi: torch.Tensor) -> LogitGaussian:
        """SVGP logit Gaussian (independent classes) for last-layer features ``phi [N, D]``."""
        if self.subset is not Subset.LAST_LAYER:
            raise BayescliError("this posterior covers all layers; use logit_gaussian_inputs")
        if self.point_mass:  # the MAP head's logits, zero variance
            mean = self._aug(phi) @ self.map_weight.double().T
            return LogitGaussian(mean.to(phi.dtype), torch.zeros_like(mean, dtype=phi.dtype))
        if "proj" not in self._cache:  # a(x) = W k(Z, x) = (W Φ̃_Z / δ) φ̃(x)
            self._cache["proj"] = self.whiten.double() @ self._aug(self.inducing) / self.prior_precision
        parts = []
        for start in range(0, len(phi), CHUNK):
            x = self._aug(phi[start : start + CHUNK])
            a = self._cache["proj"] @ x.T  # [1, r, n]
            kres = (x.square().sum(1) / self.prior_precision - a.square().sum(1)).clamp_min(0)
            prior_mean = x.new_zeros(len(x), self.var_mean.shape[0])
            parts.append(
                predict_svgp(Projected(a, kres, prior_mean), self.var_mean.double(), self.var_chol.double())
            )
        lg = LogitGaussian.cat(parts)
        return LogitGaussian(lg.mean.to(phi.dtype), lg.var.to(phi.dtype))

    def _inducing_jacobian(self, classifier: Classifier) -> torch.Tensor:
        key = id(classifier)
        if self._cache.get("jac_key") != key:
            _, jac = network_jacobian(classifier.net, classifier.normalise(self.inducing))
            self._cache |= {"jac_key": key, "jac": jac.double()}
        return self._cache["jac"]

    def logit_gaussian_inputs(self, classifier: Classifier, x: torch.Tensor) -> LogitGaussian:
        """SVGP logit Gaussian for pixel-space inputs ``x [N, ...]`` (all-layer kernels)."""
        x = x.to(self.var_mean.device)
        if self.subset is Subset.LAST_LAYER:
            return self.logit_gaussian(classifier.features(x))
        if self.point_mass:  # the network's own logits f(x; θ*), zero variance
            with torch.no_grad():
                f = classifier.net(classifier.normalise(x))
            return LogitGaussian(f.to(x.dtype), torch.zeros_like(f, dtype=x.dtype))
        theta = flat_parameters(classifier.net).double()
        jac_z = self._inducing_jacobian(classifier)
        require(
            jac_z.shape[2] == theta.numel(),
            "the network differs from the one the posterior was fitted on; use its checkpoint",
        )
        whiten1 = self.whiten.double() / math.sqrt(self.prior_precision)
        proj = jacobian_projection(classifier, x, jac_z, whiten1, theta).at(self.prior_precision)
        lg = predict_svgp(proj, self.var_mean.double(), self.var_chol.double())
        return LogitGaussian(lg.mean.to(x.dtype), lg.var.to(x.dtype))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "whiten": self.whiten,
            "var_mean": self.var_mean,
            "var_chol": self.var_chol,
            "inducing": self.inducing,
            "inducing_index": self.inducing_index,
        }
        if self.map_weight is not None:
            out["map_weight"] = self.map_weight
        return out

    def own_metadata(self) -> dict:
        return {
            "prior_precision": self.prior_precision,
            "head_bias": self.head_bias,
            "n_data": self.n_data,
            "inducing_points": len(self.inducing_index),
            "predictive": "map-point-mass" if self.point_mass else "ggp-svgp",
            "exact": True,
            "point_mass": self.point_mass,
        }

    @classmethod
    def from_file(cls, tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> GGPVIPosterior:
        return cls(
            tensors["whiten"],
            tensors["var_mean"],
            tensors["var_chol"],
            tensors["inducing"],
            tensors["inducing_index"],
            float(meta["prior_precision"]),
            Subset(meta["subset"]),
            bool(meta["head_bias"]),
            int(meta["n_data"]),
            cls.provenance(meta, _OWN_KEYS),
            bool(meta.get("point_mass", False)),
            tensors.get("map_weight"),
        )


_OWN_KEYS = {"prior_precision", "head_bias", "n_data", "inducing_points", "predictive", "exact", "point_mass"}


def jacobian_projection(
    classifier: Classifier, x: torch.Tensor, jac_z: torch.Tensor, whiten1: torch.Tensor, theta: torch.Tensor
) -> Projected:
    """:class:`Projected` at ``δ = 1`` of inputs ``x`` for per-class Jacobian kernels.

    ``jac_z [M, C, P]`` are the inducing points' Jacobians, ``whiten1 [C, r, M]`` the whitening of
    ``k₁`` (at ``δ = 1``: pass ``W/√δ`` for a posterior's ``W``; :meth:`Projected.at` rescales).
    """
    f, jac = network_jacobian(classifier.net, classifier.normalise(x))
    jac, f = jac.double(), f.double()
    k_zx = torch.einsum("mcp,ncp->cmn", jac_z, jac)
    a = whiten1 @ k_zx
    kres = (jac.square().sum(-1).T - a.square().sum(1)).clamp_min(0)
    return Projected(a, kres, f - jac @ theta)


# ---------------------------------------------------------------------------------------------
# fitting
# ---------------------------------------------------------------------------------------------


@dataclass
class _Kernel:
    """Everything the fit needs at ``δ = 1``: whitening, training (and validation) projections and
    the inducing values of the network itself ``u* = f(Z; θ*) − m(Z)`` ``[M, C]``."""

    whiten1: torch.Tensor
    train: Projected
    val: Projected | None
    u_star: torch.Tensor
    inducing: torch.Tensor


def _last_layer_kernel(
    phi: torch.Tensor,
    val_phi: torch.Tensor | None,
    index: torch.Tensor,
    head_weight: torch.Tensor,
    bias: bool,
) -> _Kernel:
    def aug(p: torch.Tensor) -> torch.Tensor:
        p = p.double()
        return augment(p) if bias else p

    z = aug(phi[index])
    whiten1 = whitening((z @ z.T)[None])
    proj = whiten1 @ z  # [1, r, D+1]: a₁(x) = W₁ Φ̃_Z φ̃(x)

    def project(p: torch.Tensor) -> Projected:
        parts, kres = [], []
        for start in range(0, len(p), CHUNK):
            x = aug(p[start : start + CHUNK])
            a = proj @ x.T
            parts.append(a)
            kres.append((x.square().sum(1) - a.square().sum(1)).clamp_min(0))
        k = head_weight.shape[0]
        prior_mean = torch.zeros(len(p), k, dtype=torch.float64, device=p.device)
        return Projected(torch.cat(parts, -1), torch.cat(kres, -1), prior_mean)

    u_star = z @ head_weight.double().T
    return _Kernel(whiten1, project(phi), None if val_phi is None else project(val_phi), u_star, phi[index])


def _all_layer_kernel(
    classifier: Classifier, train: Data, val: Data | None, index: torch.Tensor, batch_size: int
) -> _Kernel:
    theta = flat_parameters(classifier.net).double()
    dev = theta.device
    k, m = classifier.num_classes, len(index)
    need = (m + batch_size) * k * theta.numel() * 8
    if need > MAX_JACOBIAN_BYTES:
        raise BayescliError(
            f"the all-layer GGP kernel keeps {m:,}×{k}×{theta.numel():,} Jacobian entries "
            f"({need / 2**30:.1f} GiB); lower inducing_points or use subset 'last-layer'"
        )
    inducing = train.inputs(index.cpu()).to(dev)  # the data live on the host: one copy of M indices
    f_z, jac_z = network_jacobian(classifier.net, classifier.normalise(inducing))
    jac_z = jac_z.double()
    whiten1 = whitening(torch.einsum("mcp,ncp->cmn", jac_z, jac_z))

    def project(data: Data) -> Projected:
        parts = [
            jacobian_projection(classifier, x.to(dev), jac_z, whiten1, theta)
            for x, _ in data.batches(batch_size)
        ]
        return Projected(
            torch.cat([p.a for p in parts], -1),
            torch.cat([p.kres for p in parts], -1),
            torch.cat([p.prior_mean for p in parts]),
        )

    u_star = jac_z @ theta  # f(Z) − m(Z) = J(Z) θ*
    return _Kernel(whiten1, project(train), None if val is None else project(val), u_star, inducing)


def _marglik_delta(
    classifier: Classifier, phi: torch.Tensor | None, train: Data, subset: Subset, batch_size: int
) -> float:
    """The Laplace marginal-likelihood ``δ`` (kron for the last layer, diag for all layers)."""
    if subset is Subset.LAST_LAYER:
        labels = train.y.to(phi.device)
        return fit_laplace(classifier, phi=phi, labels=labels, structure="kron").prior_precision
    batches = list(train.batches(batch_size))
    return fit_laplace(classifier, batches=batches, subset=subset, structure="diag").prior_precision


def fit_over_grid(
    source: FitSource, settings: GGPVIConfig, grid: Grid | None, *, map_fallback: bool = False
) -> GGPVIPosterior:
    """:func:`fit`, selecting δ over ``grid`` instead of the grid around the marginal-likelihood δ
    (the from-scratch trainer's :data:`~bayescli.posterior.vi.prior_precision.TRAINER_GRID`).
    ``map_fallback``: return the point mass at ``θ*`` when selection runs and no δ beats MAP."""
    start = time.perf_counter()
    cfg, train = settings, source.data
    subset = Subset(cfg.subset)
    require_validation(cfg.select, source.val is not None)
    selecting = selects(cfg.prior_precision, cfg.select, source.val is not None)
    clf = source.classifier
    last = subset is Subset.LAST_LAYER
    # the backbone, the kernel and the SVGP iterations all run on the source's device
    dev = source.device
    val_feats = source.val_features() if selecting else None
    phi = source.features().phi if last else None
    val_phi = val_feats.phi if last and selecting else None
    clf.to(dev).eval()
    index = torch.randperm(len(train), generator=devices.generator(dev, cfg.seed), device=dev)
    index = index[: min(cfg.inducing_points, len(train))].sort().values
    bias = clf.head.bias is not None
    if last:
        kernel = _last_layer_kernel(phi, val_phi, index, head_parameters(clf.head), bias)
    else:
        kernel = _all_layer_kernel(clf, train, source.val if selecting else None, index, source.batch_size)
    c = kernel.u_star.shape[1]
    # v* = W u*: the whitened inducing values of the network itself (δ = 1; scales as √δ).
    v1 = torch.einsum("crm,mc->cr", kernel.whiten1.expand(c, -1, -1), kernel.u_star)
    marglik = None
    if cfg.prior_precision is None:
        marglik = _marglik_delta(clf, phi, train, subset, source.batch_size)

    def run(delta: float) -> GGPVIPosterior:
        args = (cfg.epochs, cfg.lr, cfg.batch_size, cfg.samples, cfg.seed)
        result = train_svgp(kernel.train.at(delta), train.y.to(dev), v1 * math.sqrt(delta), *args)
        post = GGPVIPosterior(
            kernel.whiten1 * math.sqrt(delta),
            result.mean,
            result.chol,
            kernel.inducing,
            index,
            float(delta),
            subset,
            bias and last,
            len(train.y),
        )
        post.meta["vi"] = {
            "algorithm": "whitened SVGP with the GGP prior (seed 003 App. B.1), classes independent",
            "inducing": f"{len(index)} fitting inputs, seeded random subset (fixed)",
            "rank": int(kernel.whiten1.shape[1]),
            "laplace_marglik_prior_precision": marglik,
            "epochs": cfg.epochs,
            "lr": cfg.lr,
            "batch_size": cfg.batch_size,
            "schedule": "cosine to zero",
            "expectations": expectation_label(c, cfg.samples),
            "objective": result.objective,
        }
        return post

    val = None
    if selecting:

        def predictive(post: GGPVIPosterior) -> Scored:
            proj = kernel.val.at(post.prior_precision)
            return mc_predictive(predict_svgp(proj, post.var_mean, post.var_chol), cfg.seed)

        objective = f"validation {cfg.select_by.value} (svgp predictive, {VAL_SAMPLES} MC draws)"
        val = Validation(predictive, source.val.y, objective, val_feats.logits.softmax(-1), val_feats.logits)

    def default() -> Default:
        return Default(marglik, "laplace-marglik", MARGLIK_RULE)

    head_weight = head_parameters(clf.head).detach().double() if last else None

    def point_mass(best: GGPVIPosterior) -> GGPVIPosterior:
        """The point mass at θ*: ``best``'s SVGP tensors for the record, predicting MAP."""
        return replace(best, meta={"vi": best.meta["vi"]}, point_mass=True, map_weight=head_weight, _cache={})

    post, selection = choose_prior_precision(
        cfg.prior_precision,
        cfg.select,
        cfg.select_by,
        default,
        run,
        val,
        grid,
        point_mass if map_fallback else None,
        "the MAP head" if last else "the MAP weights",
    )
    post.selection = selection
    post.meta["fit_seconds"] = time.perf_counter() - start
    return post


def fit(source: FitSource, settings: GGPVIConfig) -> GGPVIPosterior:
    """GGP VI post hoc on a trained checkpoint.

    δ: ``settings.prior_precision`` if given; else, with validation data (``source.val``) and
    ``select`` not ``False``, the best of ``δ_0 · 10^i``, ``i = −2 … 2`` (extended past an edge
    minimum) by ``select_by`` on the validation SVGP predictive, ``δ_0`` the Laplace
    marginal-likelihood optimum; else ``δ_0``. ``post.selection`` records which. When selection
    ran and no δ scores better than MAP on validation, the posterior is the point mass at ``θ*``
    (point-mass mode, ``post.selection.map_fallback``; see the module docstring).
    """
    return fit_over_grid(source, settings, None, map_fallback=True)
