"""The linearised network as a GLM, and GLM VI's natural-gradient iteration on it (seed 003 App. B.1).

Linearising at ``θ*`` gives logits ``f_lin(x, θ) = f(x; θ*) + J(x)(θ − θ*)``; for the last layer
``J = I_K ⊗ φ̃ᵀ`` (exact: the head is linear). :class:`GLMData` holds the fitting set in that form
and computes the sums of the updates; :func:`natural_gradient_vi` iterates

    Σ⁻¹ ← (1 − β) Σ⁻¹ + β (Σ_n J_nᵀ E[Λ_n] J_n + δ I)        (diag: the diagonal of the bracket)
    μ   ← μ + β Σ_new (Σ_n J_nᵀ E[r_n] − δ μ),

with the expectations of the likelihood: softmax (:mod:`bayescli.posterior.vi.softmax_expectations`)
or, for a multi-label head (``likelihood="bernoulli"``, labels ``[N, K]``, last layer), Bernoulli
per label (:mod:`bayescli.posterior.vi.bernoulli_expectations`: ``E[σ(f_k)]`` and
``E[σ(f_k)(1 − σ(f_k))]`` under ``N(μ_k, v_k)`` by quadrature). The Bernoulli ``Λ_n`` is diagonal,
so ``Σ_n J_nᵀ E[Λ_n] J_n`` is block-diagonal over labels (block ``k`` = ``Σ_n E[λ_nk] φ̃_nφ̃_nᵀ``,
as in :mod:`bayescli.posterior.bernoulli_curvature`), built without per-input Jacobians; the
expectations need only the logit variances ``v_nk = φ̃_nᵀ Σ_kk φ̃_n``, and a precision that is
block-diagonal over labels (the Bernoulli Laplace start, kept so by these updates) is factorised
block by block: ``K`` Choleskys of ``[D, D]``, not one of ``[KD, KD]``. With ``minibatch``
rows per iteration (stochastic natural-gradient VI) both sums are taken over that many rows,
drawn without replacement pass by pass, and scaled by ``N/B``: unbiased for the full sums, so the
fixed point is the same, and the β-weighted averaging pools the draws over ~1/β iterations.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from bayescli import devices
from bayescli.data import Data
from bayescli.errors import BayescliError, require
from bayescli.models.specs import Classifier
from bayescli.options import Subset
from bayescli.posterior.curvature import network_jacobian
from bayescli.posterior.gaussian import augment
from bayescli.posterior.vi.bernoulli_expectations import bernoulli_expectations
from bayescli.posterior.vi.network_weights import flat_parameters
from bayescli.posterior.vi.softmax_expectations import softmax_expectations
from bayescli.progress import track

# All-layer GLM VI keeps every fitting input's Jacobian [K, P] (float32) in memory: this is the cap.
MAX_JACOBIAN_BYTES = 4 * 2**30
# Full-batch last-layer iterations keep φ̃ (and φ̃²) in the working dtype up to this size.
PREPARED_BYTES = 512 * 2**20


@dataclass
class GLMData:
    """The linearised network on the fitting data (float64 throughout the iteration).

    Last layer: ``phi [N, D]`` and ``bias`` (parameters ``W̃ [K, D(+1)]``, logits ``W̃ φ̃``).
    All layers: ``jac [N, K, P]`` and ``offset [N, K] = f(x; θ*) − J θ*`` (logits ``offset + J θ``).
    ``likelihood``: ``categorical`` (``labels [N]``) or ``bernoulli`` (``labels [N, K]``, last layer).
    """

    labels: torch.Tensor
    num_classes: int
    phi: torch.Tensor | None = None
    bias: bool = True
    jac: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    likelihood: str = "categorical"
    phi_sq: torch.Tensor | None = None  # φ̃² when precomputed (:meth:`in_dtype`)
    _chunk_key: tuple | None = field(default=None, repr=False)
    _chunk: tuple = field(default=(None, None), repr=False)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def last_layer(self) -> bool:
        return self.phi is not None

    def rows(self, index: torch.Tensor) -> GLMData:
        """The rows ``index`` as their own :class:`GLMData` (a minibatch)."""
        if self.last_layer:
            return GLMData(
                self.labels[index],
                self.num_classes,
                phi=self.phi[index],
                bias=self.bias,
                likelihood=self.likelihood,
                phi_sq=None if self.phi_sq is None else self.phi_sq[index],
            )
        return GLMData(
            self.labels[index],
            self.num_classes,
            jac=self.jac[index],
            offset=self.offset[index],
            likelihood=self.likelihood,
        )

    def in_dtype(self, dtype: torch.dtype, squares: bool) -> GLMData:
        """Last layer: the same rows with ``φ̃`` augmented and in ``dtype`` once (and ``φ̃²`` with
        ``squares``), so every iteration's chunks are slices, not conversions; ``self`` otherwise."""
        if not self.last_layer:
            return self
        phi = self.phi.to(dtype)
        phi = augment(phi) if self.bias else phi
        sq = phi.square() if squares else None
        k, lik = self.num_classes, self.likelihood
        return GLMData(self.labels, k, phi=phi, bias=False, likelihood=lik, phi_sq=sq)

    def chunks(self, size: int) -> Iterator[slice]:
        for start in range(0, len(self), size):
            yield slice(start, start + size)

    def _phi(self, sl: slice, dtype: torch.dtype = torch.float64, square: bool = False) -> torch.Tensor:
        """``φ̃`` (or ``φ̃²``) of a chunk: a slice when already in ``dtype`` (:meth:`in_dtype`), else
        converted, the last chunk's kept, as each is used three times."""
        if square and self.phi_sq is not None and self.phi_sq.dtype == dtype:
            return self.phi_sq[sl]
        if not square and not self.bias and self.phi.dtype == dtype:
            return self.phi[sl]
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
            # [K, B] then transposed: the skinny GEMM is ~1.7x faster this way round (CPU)
            return (mean @ self._phi(sl, mean.dtype).T).T
        return self.offset[sl] + self.jac[sl].double() @ mean

    def logit_cov(self, state: _State, sl: slice, diagonal: bool = False) -> torch.Tensor:
        """``J_n Σ J_nᵀ``: a variance ``[B, K]`` (last-layer diag, or ``diagonal`` on the last layer:
        its diagonal only, what the Bernoulli likelihood needs) or ``[B, K, K]``."""
        if self.last_layer:
            if state.factor is None:
                return (state.variance @ self._phi(sl, state.variance.dtype, square=True).T).T
            phi = self._phi(sl)
            if diagonal:  # v_nk = φ̃_nᵀ Σ_kk φ̃_n: N·K·D² flops instead of N·K·D·P for J_n G
                return (phi @ state.label_blocks(len(state.mean)) * phi).sum(-1).T
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
        """``Σ_n J_nᵀ Λ_n J_n``: its diagonal (shaped like the mean) or ``[P, P]``; ``lam`` is
        ``[B, K, K]``, or ``[B, K]`` for a diagonal ``Λ_n`` (Bernoulli; softmax with ``diag``)."""
        if self.last_layer:
            phi = self._phi(sl, lam.dtype)
            if diag:  # lam is the diagonal [B, K] here: the logit covariance is diagonal too
                return (lam.T @ self._phi(sl, lam.dtype, square=True)).double()
            if lam.dim() == 2:  # diagonal Λ_n: block k = Σ_n λ_nk φ̃_nφ̃_nᵀ, no coupling across labels
                blocks = (lam.T[:, :, None] * phi).transpose(1, 2) @ phi  # [K, D, D], one batched GEMM
                return torch.block_diag(*blocks).double()
            k, d1 = lam.shape[1], phi.shape[1]
            blocks = (lam[:, :, :, None] * phi[:, None, None, :]).reshape(len(phi), -1).T @ phi
            return blocks.reshape(k, k, d1, d1).permute(0, 2, 1, 3).reshape(k * d1, k * d1)
        jac = self.jac[sl].double()
        lam_jac = lam @ jac  # [B, K, P]
        if diag:
            return (lam_jac * jac).sum((0, 1))
        return jac.reshape(-1, jac.shape[2]).T @ lam_jac.reshape(-1, jac.shape[2])


def _label_diagonal_blocks(mean: torch.Tensor, curvature: torch.Tensor) -> torch.Tensor | None:
    """The label blocks ``[K, D, D]`` of a last-layer ``curvature [KD, KD]`` (mean ``[K, D]``) when
    every entry outside them is zero, else ``None``."""
    if mean.dim() != 2:
        return None
    k, d = mean.shape
    grid = curvature.reshape(k, d, k, d)
    coupling = grid.abs().amax((1, 3))  # [K, K]: the largest entry of each block
    if bool((coupling - torch.diag(coupling.diagonal())).any()):
        return None
    return grid.diagonal(dim1=0, dim2=2).permute(2, 0, 1)


@dataclass
class _State:
    """``q`` in the iteration: mean, curvature ``Σ⁻¹ − δI`` and what the pushes need."""

    mean: torch.Tensor
    curvature: torch.Tensor
    delta: float
    variance: torch.Tensor | None = None  # diag: 1 / (h + δ)
    factor: torch.Tensor | None = None  # full: G = C⁻ᵀ with C Cᵀ = Σ⁻¹, so Σ = G Gᵀ
    chol: torch.Tensor | None = None
    _blocks: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def build(cls, mean: torch.Tensor, curvature: torch.Tensor, delta: float) -> _State:
        if curvature.shape == mean.shape:
            return cls(mean, curvature, delta, variance=1.0 / (curvature + delta))
        blocks = _label_diagonal_blocks(mean, curvature)
        if blocks is not None:
            # block-diagonal over labels (the Bernoulli start and updates keep it so): K Choleskys of
            # [D, D] instead of one of [KD, KD]; the same factors, assembled for solve and kl
            eye = torch.eye(blocks.shape[1], dtype=blocks.dtype, device=blocks.device)
            chol_b = torch.linalg.cholesky(0.5 * (blocks + blocks.mT) + delta * eye)
            factor_b = torch.linalg.solve_triangular(chol_b, eye.expand_as(chol_b), upper=False).mT
            state = cls(
                mean, curvature, delta, factor=torch.block_diag(*factor_b), chol=torch.block_diag(*chol_b)
            )
            state._blocks = factor_b @ factor_b.mT
            return state
        eye = torch.eye(len(curvature), dtype=curvature.dtype, device=curvature.device)
        chol = torch.linalg.cholesky(0.5 * (curvature + curvature.T) + delta * eye)
        factor = torch.linalg.solve_triangular(chol, eye, upper=False).T
        return cls(mean, curvature, delta, factor=factor, chol=chol)

    def label_blocks(self, num_labels: int) -> torch.Tensor:
        """The diagonal blocks ``Σ_kk = G_k G_kᵀ`` ``[K, D, D]`` of a full ``Σ`` over ``K`` labels'
        weight rows (``G_k`` = rows ``kD … (k+1)D − 1`` of ``G``); computed once per state."""
        if self._blocks is None:
            rows = self.factor.reshape(num_labels, -1, self.factor.shape[1])
            self._blocks = rows @ rows.transpose(1, 2)
        return self._blocks

    def solve(self, g: torch.Tensor) -> torch.Tensor:
        """``Σ g`` (``g`` shaped like the mean)."""
        if self.variance is not None:
            return self.variance * g
        return torch.cholesky_solve(g.reshape(-1, 1), self.chol).reshape(g.shape)

    def kl(self) -> torch.Tensor:
        """``KL(q ‖ N(0, δ⁻¹ I))`` (a 0-dim tensor on the state's device: read once, after the loop)."""
        d, p = self.delta, self.mean.numel()
        if self.variance is not None:
            trace, logdet_prec = self.variance.sum(), torch.log(self.curvature + d).sum()
        else:
            trace, logdet_prec = self.factor.square().sum(), 2 * torch.log(self.chol.diagonal()).sum()
        value = d * trace + d * self.mean.square().sum() - p - p * math.log(d) + logdet_prec
        return 0.5 * value


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
    minibatch: int | None = None,
) -> NGVIResult:
    """Run the natural-gradient iteration from ``N(mean, (curvature + δI)⁻¹)``.

    ``minibatch``: rows per iteration (module doc); ``None`` (or ≥ N) sums over every row.

    ``mean`` is ``[K, D(+1)]`` (last layer) or ``[P]``; ``curvature`` has the mean's shape (diag)
    or is ``[P, P]`` (full). The ELBO (its Monte-Carlo estimate when ``K > 2``, softmax) is recorded at
    every iterate; ``residuals`` hold the fixed-point conditions at the last expansion point:
    ``gradient`` = max |Σ Jᵀ E[r] − δμ| and ``curvature`` = max |E[Σ JᵀΛJ] − (Σ⁻¹ − δI)|, each
    relative to the largest entry of its reference (``δ|μ|`` and the curvature).
    """
    require(delta > 0, f"prior precision must be positive, got {delta}")
    diag = curvature.shape == mean.shape
    state = _State.build(mean.double(), curvature.double(), float(delta))
    dev = state.mean.device
    gen = devices.generator(dev, seed)
    diag_logits = diag and data.last_layer  # the logit covariance is diagonal: sample K scalars
    bernoulli = data.likelihood == "bernoulli"
    # Last-layer diag with K > 2 works in float32 per chunk (GEMMs over ≤ batch_size inputs, Monte
    # Carlo noise ≫ round-off) and sums in float64; quadrature (K = 2, Bernoulli) and full
    # covariances stay float64.
    mc = diag_logits and data.num_classes > 2 and not bernoulli
    work = torch.float32 if mc else torch.float64
    # the ELBO stays on the device, one 0-dim float64 tensor per iteration, read back once at the end
    # (a read per chunk or iteration would wait for the device every time)
    elbo: list[torch.Tensor] = []
    residuals: dict = {}
    n = len(data)
    stochastic = minibatch is not None and minibatch < n
    # φ̃ (and φ̃² for diag) converted once for all iterations, not per chunk and iteration, where the
    # copies fit PREPARED_BYTES; minibatches are converted as they are drawn
    copies = (2 if diag else 1) * n * (data.phi.shape[1] + 1) if data.last_layer else 0
    if not stochastic and copies * work.itemsize <= PREPARED_BYTES:
        data = data.in_dtype(work, squares=diag)
    order = torch.empty(0, dtype=torch.int64, device=dev)
    for step in track(range(epochs), total=epochs, description="GLM VI"):
        grad = torch.zeros_like(state.mean)
        curv = torch.zeros_like(state.curvature)
        ell = torch.zeros((), dtype=torch.float64, device=dev)
        view = state if work == torch.float64 else replace(state, variance=state.variance.to(work))
        mean_w = state.mean.to(work)
        batch = data
        if stochastic:
            if len(order) < minibatch:
                order = torch.cat([order, torch.randperm(n, generator=gen, device=dev)])
            batch, order = data.rows(order[:minibatch]).in_dtype(work, squares=diag), order[minibatch:]
        for sl in batch.chunks(batch_size):
            mean_b = batch.logit_mean(mean_w, sl)
            cov_b = batch.logit_cov(view, sl, diagonal=bernoulli)
            if bernoulli:
                e_ll, resid, lam = bernoulli_expectations(mean_b, cov_b, batch.labels[sl])
            else:
                e_ll, resid, lam = softmax_expectations(
                    mean_b, cov_b, batch.labels[sl], samples, gen, diag_only=diag_logits
                )
            ell += e_ll.sum().double()
            grad += batch.gradient(resid, sl)
            curv += batch.curvature(lam, sl, diag)
        if stochastic:
            scale = n / len(batch)
            grad, curv, ell = grad * scale, curv * scale, ell * scale
        elbo.append(ell - state.kl())
        g = grad - delta * state.mean
        if step == epochs - 1:  # the fixed-point conditions at the last expansion point
            residuals = {
                "gradient": float(g.abs().max() / (delta * state.mean.abs().max()).clamp_min(1e-300)),
                "curvature": float(
                    (curv - state.curvature).abs().max() / state.curvature.abs().max().clamp_min(1e-300)
                ),
            }
        new_state = _State.build(state.mean, (1 - lr) * state.curvature + lr * curv, delta)
        new_state.mean = state.mean + lr * new_state.solve(g)  # the step uses the new precision
        state = new_state
    return NGVIResult(state.mean, state.curvature, torch.stack(elbo).tolist() if elbo else [], residuals)


def linearised_data(
    classifier: Classifier,
    train: Data,
    subset: Subset,
    batch_size: int,
    phi: torch.Tensor | None,
    likelihood: str = "categorical",
) -> GLMData:
    """:class:`GLMData` for ``train``: features ``phi [N, D]`` (last layer) or per-input Jacobians
    (all; categorical only), on the device of ``phi`` (last layer) or of the classifier (all)."""
    k = classifier.num_classes
    if subset is Subset.LAST_LAYER:
        labels = train.y.to(phi.device)
        return GLMData(labels, k, phi=phi, bias=classifier.head.bias is not None, likelihood=likelihood)
    theta = flat_parameters(classifier.net).double()
    dev = theta.device
    need = len(train) * k * theta.numel() * 4
    if need > MAX_JACOBIAN_BYTES:
        raise BayescliError(
            f"all-layer GLM VI keeps {len(train):,}×{k}×{theta.numel():,} Jacobian entries "
            f"({need / 2**30:.1f} GiB); use subset='last-layer' or fewer fitting inputs"
        )
    jacs, offsets = [], []
    for x, _ in train.batches(batch_size):
        f, jac = network_jacobian(classifier.net, classifier.normalise(x.to(dev)))
        jacs.append(jac)
        offsets.append(f.double() - jac.double() @ theta)
    return GLMData(train.y.to(dev), k, jac=torch.cat(jacs), offset=torch.cat(offsets))
