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

Expectations of the softmax likelihood under the Gaussian logits: for ``K = 2`` exactly, by
64-node Gauss–Hermite on the logit difference ``f₀ − f₁`` (the softmax depends on nothing else);
for ``K > 2`` by Monte Carlo, ``samples`` draws per input and iteration from a generator seeded
with ``seed`` (fresh draws every iteration; the update's averaging with weight β pools them over
~1/β iterations).

Start: the Laplace posterior of :func:`bayescli.posterior.laplace.fit_laplace` with the same
structure, ``μ = θ*``, ``Σ⁻¹ = H_GGN(θ*) + δI``. ``δ``: given, else the Laplace marginal-likelihood
optimum, or (``select``) the grid value with the lowest validation NLL.

The posterior is stored as ``curvature = Σ⁻¹ − δI`` in the Laplace containers
(:class:`DiagGaussian` / :class:`FullGaussian`), so their GLM push-forwards give its logit
Gaussian unchanged (exact: the GLM predictive of ``q`` *is* that Gaussian).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from bayescli.data import ArrayData
from bayescli.errors import BayescliError, require
from bayescli.features import extract_features
from bayescli.metrics import nll
from bayescli.models import Classifier, LoadedModel, ModelSpec
from bayescli.options import Subset, TrainConfig
from bayescli.posterior.base import Posterior
from bayescli.posterior.curvature import network_jacobian
from bayescli.posterior.gaussian import (
    MAX_FULL_PARAMS,
    DiagGaussian,
    FullGaussian,
    LogitGaussian,
    WeightGaussian,
    augment,
    cholesky_jitter,
)
from bayescli.posterior.laplace import LaplacePosterior, fit_laplace
from bayescli.posterior.prior import edge_warning, grid_search
from bayescli.progress import track
from bayescli.train import train_classifier

GH_NODES = 64
# The seed's δ grid for UCI (App. B.3): 10 log-spaced values in [1e-2, 1e2]; grid_search extends it
# past an edge minimum.
SELECT_GRID = [float(v) for v in np.logspace(-2, 2, 10)]
VAL_SAMPLES = 100
MAX_JACOBIAN_BYTES = 4 * 2**30
COVARIANCES = ("diag", "full")


def default_lr(covariance: str) -> float:
    """The seed's step fractions (App. B.1): 1e-2 for diagonal, 1e-3 for full covariances."""
    return 1e-2 if covariance == "diag" else 1e-3


def _as_float(value: object, name: str) -> float | None:
    """``None``/``"auto"`` → ``None``; numbers and numeric strings (``--set``) → float."""
    if value is None or (isinstance(value, str) and value.lower() in ("auto", "none")):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise BayescliError(f"{name} must be a number, got '{value}'") from None


@dataclass
class GLMVIConfig:
    """Settings of ``--method glm-vi``.

    * ``subset``: ``last-layer`` (the head, on features) or ``all`` (every weight, per-input Jacobians).
    * ``covariance``: ``diag`` or ``full`` (full needs ≤ 20,000 parameters, as for Laplace).
    * ``prior_precision``: δ; ``None`` = the Laplace marginal-likelihood optimum at θ*.
    * ``epochs``: natural-gradient iterations, each over the whole fitting set.
    * ``lr``: the step fraction β; ``None`` = 1e-2 (diag) or 1e-3 (full), the seed's.
    * ``batch_size``: inputs per chunk of the full-batch sums (memory only).
    * ``samples``: Monte-Carlo logit draws per input and iteration when K > 2 (K = 2 is exact).
    * ``seed``: seeds the Monte-Carlo draws and the validation predictive.
    * ``select``: pick δ by validation NLL over :data:`SELECT_GRID` (recorded in ``meta``).
    """

    subset: str = "last-layer"
    covariance: str = "diag"
    prior_precision: float | None = None
    epochs: int = 250
    lr: float | None = None
    batch_size: int = 1024
    samples: int = 8
    seed: int = 0
    select: bool = False

    def __post_init__(self) -> None:
        require(self.covariance in COVARIANCES, f"--covariance must be diag or full, got '{self.covariance}'")
        subsets = [s.value for s in Subset]
        require(self.subset in subsets, f"--subset must be one of {', '.join(subsets)}, got '{self.subset}'")
        self.prior_precision = _as_float(self.prior_precision, "--prior-precision")
        self.lr = _as_float(self.lr, "--lr")
        require(
            self.prior_precision is None or self.prior_precision > 0,
            f"--prior-precision must be positive, got {self.prior_precision}",
        )
        require(self.lr is None or 0 < self.lr <= 1, f"--lr is a step fraction in (0, 1], got {self.lr}")
        require(
            min(self.epochs, self.samples, self.batch_size) >= 1,
            "--epochs, --samples and --train-batch-size must be at least 1",
        )

    @property
    def step(self) -> float:
        return self.lr if self.lr is not None else default_lr(self.covariance)


# ---------------------------------------------------------------------------------------------
# expectations of the softmax likelihood under Gaussian logits
# ---------------------------------------------------------------------------------------------


@functools.cache
def _hermegauss(num: int) -> tuple[np.ndarray, np.ndarray]:
    nodes, weights = np.polynomial.hermite_e.hermegauss(num)
    return nodes, weights / math.sqrt(2 * math.pi)


def gauss_hermite(dtype: torch.dtype, num: int = GH_NODES) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights with ``E_{z~N(0,1)}[g(z)] ≈ Σ_i w_i g(z_i)`` (exact for degree < 2·num)."""
    nodes, weights = _hermegauss(num)
    return torch.as_tensor(nodes, dtype=dtype), torch.as_tensor(weights, dtype=dtype)


def _difference(mean: torch.Tensor, cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of ``f₀ − f₁`` for ``K = 2`` (``cov`` a variance or ``[B,2,2]``)."""
    var = cov[:, 0] + cov[:, 1] if cov.dim() == 2 else cov[:, 0, 0] + cov[:, 1, 1] - 2 * cov[:, 0, 1]
    return mean[:, 0] - mean[:, 1], var.clamp_min(0).sqrt()


def _draws(mean: torch.Tensor, cov: torch.Tensor, samples: int, generator: torch.Generator) -> torch.Tensor:
    """``samples`` float32 logit draws ``[S, B, K]`` (``cov`` a variance ``[B,K]`` or ``[B,K,K]``).

    float32: the Monte-Carlo error (~1/√S) dwarfs its round-off, and drawing and exponentiating
    S·B·K numbers dominates an iteration's time.
    """
    eps = torch.randn(samples, *mean.shape, generator=generator, dtype=torch.float32)
    if cov.dim() == 2:
        return mean.float() + eps * cov.clamp_min(0).sqrt().float()
    return mean.float() + torch.einsum("bkl,sbl->sbk", cholesky_jitter(cov).float(), eps)


def softmax_expectations(
    mean: torch.Tensor,
    cov: torch.Tensor,
    labels: torch.Tensor,
    samples: int,
    generator: torch.Generator,
    diag_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``E[log p(y|f)] [B]``, ``E[y − softmax f] [B,K]`` and ``E[Λ] [B,K,K]`` (its diagonal ``[B,K]``
    with ``diag_only``) for ``f ~ N(mean [B,K], cov)``, ``cov`` a variance ``[B,K]`` or ``[B,K,K]``.

    ``K = 2``: Gauss–Hermite on ``d = f₀ − f₁`` (``p₀ = σ(d)``, ``Λ = σ(1−σ)[[1,−1],[−1,1]]``);
    ``K > 2``: Monte Carlo with ``samples`` draws.
    """
    k = mean.shape[1]
    onehot = nn.functional.one_hot(labels, k).to(mean.dtype)
    if k == 2:
        nodes, weights = gauss_hermite(mean.dtype)
        m, s = _difference(mean, cov)
        d = m[:, None] + s[:, None] * nodes  # [B, G]
        sig = torch.sigmoid(d)
        p0 = sig @ weights
        lam = (sig * (1 - sig)) @ weights
        sign = 1.0 - 2.0 * labels.to(mean.dtype)  # log p_y = log σ(±d): + for y = 0
        ell = nn.functional.logsigmoid(sign[:, None] * d) @ weights
        probs = torch.stack([p0, 1 - p0], 1)
        if diag_only:
            return ell, onehot - probs, lam[:, None].expand(-1, 2).clone()
        block = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=mean.dtype)
        return ell, onehot - probs, lam[:, None, None] * block
    logp = _draws(mean, cov, samples, generator).log_softmax(-1)
    p = logp.exp()
    ell = logp.gather(2, labels.view(1, -1, 1).expand(samples, -1, 1)).squeeze(2).mean(0)
    p_mean = p.mean(0)
    if diag_only:
        lam = (p - p.square()).mean(0)
    else:
        lam = torch.diag_embed(p_mean) - torch.einsum("sbk,sbl->bkl", p, p) / samples
    dtype = mean.dtype
    return ell.to(dtype), onehot - p_mean.to(dtype), lam.to(dtype)


def expected_log_softmax(
    mean: torch.Tensor, var: torch.Tensor, labels: torch.Tensor, samples: int, generator: torch.Generator
) -> torch.Tensor:
    """Differentiable ``E[log softmax(f)_y] [B]`` for independent ``f_k ~ N(mean, var)`` ``[B,K]``.

    ``K = 2``: Gauss–Hermite on ``f₀ − f₁``; ``K > 2``: reparameterised Monte Carlo.
    """
    if mean.shape[1] == 2:
        nodes, weights = gauss_hermite(mean.dtype)
        m, s = _difference(mean, var)
        sign = 1.0 - 2.0 * labels.to(mean.dtype)
        return nn.functional.logsigmoid(sign[:, None] * (m[:, None] + s[:, None] * nodes)) @ weights
    eps = torch.randn(samples, *mean.shape, generator=generator, dtype=mean.dtype)
    logp = (mean + eps * var.clamp_min(1e-30).sqrt()).log_softmax(-1)
    return logp.gather(2, labels.view(1, -1, 1).expand(samples, -1, 1)).squeeze(2).mean(0)


def expectation_label(num_classes: int, samples: int) -> str:
    """How the likelihood's expectations are computed (recorded in the posterior's metadata)."""
    if num_classes == 2:
        return f"exact: {GH_NODES}-node Gauss-Hermite on f0 - f1"
    return f"Monte Carlo: {samples} logit draws per input and step (seeded)"


# ---------------------------------------------------------------------------------------------
# the linearised model and the natural-gradient iteration
# ---------------------------------------------------------------------------------------------


@dataclass
class GLMData:
    """The linearised network on the fitting data (float64 throughout the iteration).

    Last layer: ``phi [N, D]`` and ``bias`` (parameters ``W̃ [K, D(+1)]``, logits ``W̃ φ̃``).
    All layers: ``jac [N, K, P]`` and ``offset [N, K] = f(x; θ*) − J θ*`` (logits ``offset + J θ``).
    """

    labels: torch.Tensor
    num_classes: int
    phi: torch.Tensor | None = None
    bias: bool = True
    jac: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    _chunk_key: tuple | None = field(default=None, repr=False)
    _chunk: tuple = field(default=(None, None), repr=False)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def last_layer(self) -> bool:
        return self.phi is not None

    def chunks(self, size: int) -> Iterator[slice]:
        for start in range(0, len(self), size):
            yield slice(start, start + size)

    def _phi(self, sl: slice, dtype: torch.dtype = torch.float64, square: bool = False) -> torch.Tensor:
        """``φ̃`` (or ``φ̃²``) of a chunk; the last chunk's are kept, as each is used three times."""
        key = (sl.start, sl.stop, dtype)
        if self._chunk_key != key:
            phi = self.phi[sl].to(dtype)
            phi = augment(phi) if self.bias else phi
            self._chunk_key, self._chunk = key, (phi, None)
        phi, phi_sq = self._chunk
        if not square:
            return phi
        if phi_sq is None:
            phi_sq = phi.square()
            self._chunk = (phi, phi_sq)
        return phi_sq

    def logit_mean(self, mean: torch.Tensor, sl: slice) -> torch.Tensor:
        """``f_lin(x_n, μ)`` ``[B, K]`` (in the mean's dtype)."""
        if self.last_layer:
            return self._phi(sl, mean.dtype) @ mean.T
        return self.offset[sl] + self.jac[sl].double() @ mean

    def logit_cov(self, state: _State, sl: slice) -> torch.Tensor:
        """``J_n Σ J_nᵀ``: a variance ``[B, K]`` (last-layer diag) or ``[B, K, K]``."""
        if self.last_layer:
            if state.factor is None:
                return self._phi(sl, state.variance.dtype, square=True) @ state.variance.T
            phi = self._phi(sl)
            k, d1 = state.mean.shape
            jg = torch.einsum("nd,kdp->nkp", phi, state.factor.reshape(k, d1, -1))
            return jg @ jg.transpose(1, 2)
        jac = self.jac[sl].double()
        if state.factor is None:
            return torch.einsum("nkp,p,nlp->nkl", jac, state.variance, jac)
        jg = jac @ state.factor
        return jg @ jg.transpose(1, 2)

    def gradient(self, resid: torch.Tensor, sl: slice) -> torch.Tensor:
        """``Σ_n J_nᵀ r_n`` (shaped like the mean)."""
        if self.last_layer:
            return (resid.T @ self._phi(sl, resid.dtype)).double()
        return torch.einsum("nk,nkp->p", resid, self.jac[sl].double())

    def curvature(self, lam: torch.Tensor, sl: slice, diag: bool) -> torch.Tensor:
        """``Σ_n J_nᵀ Λ_n J_n``: its diagonal (shaped like the mean) or ``[P, P]``."""
        if self.last_layer:
            phi = self._phi(sl, lam.dtype)
            if diag:  # lam is the diagonal [B, K] here: the logit covariance is diagonal too
                return (lam.T @ self._phi(sl, lam.dtype, square=True)).double()
            k, d1 = lam.shape[1], phi.shape[1]
            blocks = (lam[:, :, :, None] * phi[:, None, None, :]).reshape(len(phi), -1).T @ phi
            return blocks.reshape(k, k, d1, d1).permute(0, 2, 1, 3).reshape(k * d1, k * d1)
        jac = self.jac[sl].double()
        lam_jac = lam @ jac  # [B, K, P]
        if diag:
            return (lam_jac * jac).sum((0, 1))
        return jac.reshape(-1, jac.shape[2]).T @ lam_jac.reshape(-1, jac.shape[2])


@dataclass
class _State:
    """``q`` in the iteration: mean, curvature ``Σ⁻¹ − δI`` and what the pushes need."""

    mean: torch.Tensor
    curvature: torch.Tensor
    delta: float
    variance: torch.Tensor | None = None  # diag: 1 / (h + δ)
    factor: torch.Tensor | None = None  # full: G = C⁻ᵀ with C Cᵀ = Σ⁻¹, so Σ = G Gᵀ
    chol: torch.Tensor | None = None

    @classmethod
    def build(cls, mean: torch.Tensor, curvature: torch.Tensor, delta: float) -> _State:
        if curvature.shape == mean.shape:
            return cls(mean, curvature, delta, variance=1.0 / (curvature + delta))
        eye = torch.eye(len(curvature), dtype=curvature.dtype)
        chol = torch.linalg.cholesky(0.5 * (curvature + curvature.T) + delta * eye)
        factor = torch.linalg.solve_triangular(chol, eye, upper=False).T
        return cls(mean, curvature, delta, factor=factor, chol=chol)

    def solve(self, g: torch.Tensor) -> torch.Tensor:
        """``Σ g`` (``g`` shaped like the mean)."""
        if self.variance is not None:
            return self.variance * g
        return torch.cholesky_solve(g.reshape(-1, 1), self.chol).reshape(g.shape)

    def kl(self) -> float:
        """``KL(q ‖ N(0, δ⁻¹ I))``."""
        d, p = self.delta, self.mean.numel()
        if self.variance is not None:
            trace, logdet_prec = self.variance.sum(), torch.log(self.curvature + d).sum()
        else:
            trace, logdet_prec = self.factor.square().sum(), 2 * torch.log(self.chol.diagonal()).sum()
        value = d * trace + d * self.mean.square().sum() - p - p * math.log(d) + logdet_prec
        return float(0.5 * value)


@dataclass
class NGVIResult:
    """The fitted mean and curvature (``Σ⁻¹ − δI``) and the iteration's record."""

    mean: torch.Tensor
    curvature: torch.Tensor
    elbo: list[float]
    residuals: dict = field(default_factory=dict)


def natural_gradient_vi(
    data: GLMData,
    mean: torch.Tensor,
    curvature: torch.Tensor,
    delta: float,
    epochs: int,
    lr: float,
    samples: int = 8,
    seed: int = 0,
    batch_size: int = 1024,
) -> NGVIResult:
    """Run the natural-gradient iteration from ``N(mean, (curvature + δI)⁻¹)``.

    ``mean`` is ``[K, D(+1)]`` (last layer) or ``[P]``; ``curvature`` has the mean's shape (diag)
    or is ``[P, P]`` (full). The ELBO (its Monte-Carlo estimate when ``K > 2``) is recorded at
    every iterate; ``residuals`` hold the fixed-point conditions at the last expansion point:
    ``gradient`` = max |Σ Jᵀ E[r] − δμ| and ``curvature`` = max |E[Σ JᵀΛJ] − (Σ⁻¹ − δI)|, each
    relative to the largest entry of its reference (``δ|μ|`` and the curvature).
    """
    require(delta > 0, f"prior precision must be positive, got {delta}")
    diag = curvature.shape == mean.shape
    state = _State.build(mean.double(), curvature.double(), float(delta))
    gen = torch.Generator().manual_seed(seed)
    diag_logits = diag and data.last_layer  # the logit covariance is diagonal: sample K scalars
    # Last-layer diag with K > 2 works in float32 per chunk (GEMMs over ≤ batch_size inputs, Monte
    # Carlo noise ≫ round-off) and sums in float64; K = 2 quadrature and full covariances stay float64.
    work = torch.float32 if diag_logits and data.num_classes > 2 else torch.float64
    elbo: list[float] = []
    residuals: dict = {}
    for _ in track(range(epochs), total=epochs, description="GLM VI"):
        grad = torch.zeros_like(state.mean)
        curv = torch.zeros_like(state.curvature)
        ell = 0.0
        view = state if work == torch.float64 else replace(state, variance=state.variance.to(work))
        mean_w = state.mean.to(work)
        for sl in data.chunks(batch_size):
            mean_b = data.logit_mean(mean_w, sl)
            cov_b = data.logit_cov(view, sl)
            e_ll, resid, lam = softmax_expectations(
                mean_b, cov_b, data.labels[sl], samples, gen, diag_only=diag_logits
            )
            ell += float(e_ll.sum())
            grad += data.gradient(resid, sl)
            curv += data.curvature(lam, sl, diag)
        elbo.append(ell - state.kl())
        g = grad - delta * state.mean
        residuals = {
            "gradient": float(g.abs().max() / (delta * state.mean.abs().max()).clamp_min(1e-300)),
            "curvature": float(
                (curv - state.curvature).abs().max() / state.curvature.abs().max().clamp_min(1e-300)
            ),
        }
        new_state = _State.build(state.mean, (1 - lr) * state.curvature + lr * curv, delta)
        new_state.mean = state.mean + lr * new_state.solve(g)  # the step uses the new precision
        state = new_state
    return NGVIResult(state.mean, state.curvature, elbo, residuals)


# ---------------------------------------------------------------------------------------------
# the posterior
# ---------------------------------------------------------------------------------------------


def flat_parameters(net: nn.Module) -> torch.Tensor:
    """All parameters of ``net`` as one vector ``[P]`` (``named_parameters`` order)."""
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def network_logits(classifier: Classifier, x: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Logits ``[M, N, K]`` of the network at each flat weight vector of ``draws [M, P]``."""
    from torch.func import functional_call

    shapes = [(name, p.shape, p.numel()) for name, p in classifier.net.named_parameters()]
    require(
        draws.shape[1] == sum(size for _, _, size in shapes),
        f"the posterior has {draws.shape[1]:,} weights but the network {sum(s for _, _, s in shapes):,}; "
        "use the checkpoint it was fitted on",
    )
    xn = classifier.normalise(x)
    dtype = next(classifier.net.parameters()).dtype
    out = []
    for theta in draws.to(dtype):
        params, offset = {}, 0
        for name, shape, size in shapes:
            params[name] = theta[offset : offset + size].reshape(shape)
            offset += size
        with torch.no_grad():
            out.append(functional_call(classifier.net, params, (xn,)))
    return torch.stack(out)


@dataclass
class GLMVIPosterior(Posterior):
    """``q(θ) = N(μ, Σ)`` in the linearised network; ``gaussian`` holds ``μ``, ``Σ⁻¹ − δI`` and ``δ``."""

    gaussian: WeightGaussian
    subset: Subset
    head_bias: bool
    n_data: int
    meta: dict = field(default_factory=dict)

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
        return network_logits(classifier, x, draws)

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.gaussian.tensors()

    def own_metadata(self) -> dict:
        return {
            "covariance": self.covariance,
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
        )


_OWN_KEYS = {"covariance", "head_bias", "n_data", "prior_precision", "predictive", "exact"}


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
            f"--covariance full needs ≤ {MAX_FULL_PARAMS:,} parameters; this {subset.value} posterior "
            f"has {num_params:,}. Use --covariance diag"
            + (" or --subset last-layer" if subset is Subset.ALL else "")
        )


def mc_nll(lg: LogitGaussian, labels: torch.Tensor, seed: int, samples: int = VAL_SAMPLES) -> float:
    """NLL of the Monte-Carlo predictive ``E[softmax f]``, ``f ~ lg`` (``samples`` seeded draws)."""
    draws = lg.sample(samples, torch.Generator().manual_seed(seed))
    return nll(draws.softmax(-1).mean(0), labels)


@dataclass
class _Problem:
    """What one fit needs: the linearised data, the Laplace start and the validation inputs."""

    data: GLMData
    laplace: LaplacePosterior
    classifier: Classifier
    val_phi: torch.Tensor | None
    val: ArrayData | None


def linearised_data(
    classifier: Classifier, train: ArrayData, subset: Subset, batch_size: int, phi: torch.Tensor | None
) -> GLMData:
    """:class:`GLMData` for ``train``: features ``phi`` (last layer) or per-input Jacobians (all)."""
    k = classifier.num_classes
    if subset is Subset.LAST_LAYER:
        return GLMData(train.y, k, phi=phi, bias=classifier.head.bias is not None)
    theta = flat_parameters(classifier.net).double()
    need = len(train) * k * theta.numel() * 4
    if need > MAX_JACOBIAN_BYTES:
        raise BayescliError(
            f"all-layer GLM VI keeps {len(train):,}×{k}×{theta.numel():,} Jacobian entries "
            f"({need / 2**30:.1f} GiB); use --subset last-layer or fewer fitting inputs (--limit)"
        )
    jacs, offsets = [], []
    for x, _ in train.batches(batch_size):
        f, jac = network_jacobian(classifier.net, classifier.normalise(x))
        jacs.append(jac)
        offsets.append(f.double() - jac.double() @ theta)
    return GLMData(train.y, k, jac=torch.cat(jacs), offset=torch.cat(offsets))


def _posterior(result: NGVIResult, delta: float, subset: Subset, data: GLMData) -> GLMVIPosterior:
    if result.curvature.shape == result.mean.shape:
        gauss: WeightGaussian = DiagGaussian(result.mean, result.curvature.clamp_min(0), delta)
    else:
        gauss = FullGaussian(result.mean, result.curvature, delta)
    return GLMVIPosterior(gauss, subset, data.bias if data.last_layer else False, len(data))


def _val_logits(post: GLMVIPosterior, problem: _Problem, batch_size: int) -> LogitGaussian:
    if problem.val_phi is not None:
        return post.logit_gaussian(problem.val_phi)
    parts = [post.logit_gaussian_inputs(problem.classifier, x) for x, _ in problem.val.batches(batch_size)]
    return LogitGaussian.cat(parts)


def _prepare(
    classifier: Classifier,
    train: ArrayData,
    val: ArrayData | None,
    cfg: GLMVIConfig,
    phi: torch.Tensor | None,
    val_phi: torch.Tensor | None,
    batch_size: int,
) -> _Problem:
    subset = Subset(cfg.subset)
    require(train.y is not None, f"{train.spec} has no labels; GLM VI needs labelled fitting data")
    if cfg.select:
        require(val is not None and val.y is not None, "--select needs labelled validation data (--val-data)")
    num_params = (
        classifier.num_classes * (classifier.feature_dim + (classifier.head.bias is not None))
        if subset is Subset.LAST_LAYER
        else sum(p.numel() for p in classifier.net.parameters())
    )
    check_full_size(num_params, cfg.covariance, subset)
    classifier.cpu().eval()
    data = linearised_data(classifier, train, subset, batch_size, phi)
    if subset is Subset.LAST_LAYER:
        laplace = fit_laplace(classifier, phi=phi, labels=train.y, structure=cfg.covariance)
    else:
        batches = list(train.batches(batch_size))
        laplace = fit_laplace(classifier, batches=batches, subset=subset, structure=cfg.covariance)
    return _Problem(data, laplace, classifier, val_phi, val)


def _fit(problem: _Problem, cfg: GLMVIConfig, batch_size: int) -> GLMVIPosterior:
    start = time.perf_counter()
    laplace, data = problem.laplace, problem.data
    subset = Subset(cfg.subset)
    gauss = laplace.gaussian
    mean0 = gauss.mean.double()
    curv0 = (gauss.h if isinstance(gauss, DiagGaussian) else gauss.H).double()
    marglik = laplace.prior_precision

    def run(delta: float) -> tuple[GLMVIPosterior, NGVIResult]:
        result = natural_gradient_vi(
            data, mean0, curv0, delta, cfg.epochs, cfg.step, cfg.samples, cfg.seed, cfg.batch_size
        )
        return _posterior(result, delta, subset, data), result

    fits: dict[float, tuple[GLMVIPosterior, NGVIResult]] = {}
    prior: dict = {}
    if cfg.select:

        def objective(delta: float) -> float:
            fits[delta] = run(delta)
            return mc_nll(_val_logits(fits[delta][0], problem, batch_size), problem.val.y, cfg.seed)

        delta, curve = grid_search(objective, SELECT_GRID)
        prior = {
            "value": delta,
            "method": "val-nll",
            "curve": curve,
            "objective": f"validation NLL (glm predictive, {VAL_SAMPLES} MC draws)",
        }
        warning = edge_warning(delta, curve)
        if warning:
            prior["warning"] = warning
        post, result = fits[delta]
    else:
        delta = cfg.prior_precision if cfg.prior_precision is not None else marglik
        post, result = run(delta)
        prior = {"value": delta, "method": "given" if cfg.prior_precision is not None else "laplace-marglik"}
    post.meta["prior"] = prior
    post.meta["vi"] = {
        "algorithm": "natural-gradient VI in the GLM (seed 003 App. B.1)",
        "start": "laplace",
        "laplace_marglik_prior_precision": marglik,
        "epochs": cfg.epochs,
        "lr": cfg.step,
        "expectations": expectation_label(data.num_classes, cfg.samples),
        "elbo_first": result.elbo[0],
        "elbo_last": result.elbo[-1],
        "elbo": _thin(result.elbo),
        "fixed_point_residuals": result.residuals,
    }
    post.meta["fit_seconds"] = time.perf_counter() - start
    return post


def _thin(values: list[float], keep: int = 50) -> list[list[float]]:
    """``[[iteration, value], ...]`` at ≤ ``keep`` evenly spaced iterations (first and last kept)."""
    idx = sorted({round(i) for i in np.linspace(0, len(values) - 1, min(keep, len(values)))})
    return [[i, values[i]] for i in idx]


def fit_glm_vi(
    model: LoadedModel,
    train: ArrayData,
    val: ArrayData | None,
    cfg: GLMVIConfig,
    device: torch.device,
    batch_size: int = 256,
) -> GLMVIPosterior:
    """GLM VI post hoc on a trained checkpoint (features extracted here for the last layer).

    The backbone runs on ``device``; the natural-gradient iterations run on the host (features
    come back once)."""
    start = time.perf_counter()
    last = Subset(cfg.subset) is Subset.LAST_LAYER
    phi = extract_features(model, train, batch_size, device).phi.cpu() if last else None
    val_phi = None
    if last and cfg.select and val is not None:
        val_phi = extract_features(model, val, batch_size, device).phi.cpu()
    problem = _prepare(model.classifier, train, val, cfg, phi, val_phi, batch_size)
    post = _fit(problem, cfg, batch_size)
    post.meta["fit_seconds"] = time.perf_counter() - start
    return post


def train_glm_vi(
    model_spec: str, train: ArrayData, val: ArrayData | None, cfg: GLMVIConfig, device: torch.device
) -> tuple[Classifier, dict, GLMVIPosterior]:
    """Train the MAP network (the trainer's defaults, seeded with ``cfg.seed``), then fit GLM VI.

    ``cfg.epochs``/``cfg.lr`` are the VI iteration's; the MAP run uses :class:`TrainConfig`.
    """
    clf, meta = train_classifier(model_spec, train, val, TrainConfig(seed=cfg.seed), device)
    loaded = LoadedModel(clf, ModelSpec.parse(model_spec), Path(), "", meta)
    post = fit_glm_vi(loaded, train, val, cfg, device)
    return clf, meta, post
