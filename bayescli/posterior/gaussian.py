"""Gaussian containers: weight posteriors and the logit Gaussian every link consumes.

Weight posteriors have precision ``P = H + δI`` for a curvature ``H`` (sum over the data) and
an isotropic prior precision ``δ``; they keep ``H`` and ``δ`` apart so that ``δ`` can be tuned
without refitting. Parameters of a last-layer head are the bias-augmented weights
``W̃ = [W, b] ∈ R^{K×(D+1)}``, flattened row-major (index ``k·(D+1) + d``), so that the logits
are ``f(x) = W̃ φ̃(x)`` with ``φ̃ = [φ; 1]`` and the Jacobian is ``J(x) = I_K ⊗ φ̃(x)ᵀ``.

Pushforwards through that Jacobian use the structure and never build ``J``:

* diag:  ``Σ(x)_kk = Σ_d S[k,d] φ̃_d²`` with ``S = 1/(h + δ)``, off-diagonals zero;
* kron:  ``H ≈ G ⊗ A`` with ``G = Q_G diag(g) Q_Gᵀ`` (``[K,K]``) and ``A = Q_A diag(a) Q_Aᵀ``
  (``[D+1, D+1]``), ``u = Q_Aᵀ φ̃``: ``Σ(x) = Q_G diag_i(Σ_j u_j² / (g_i a_j + δ)) Q_Gᵀ``;
* full:  ``Σ(x) = (I ⊗ φ̃ᵀ) P⁻¹ (I ⊗ φ̃)`` via the Cholesky factor of ``P⁻¹``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from bayescli.errors import BayescliError

MAX_FULL_PARAMS = 20_000
_JITTERS = (0.0, 1e-10, 1e-8, 1e-6, 1e-4)


def cholesky_jitter(mat: torch.Tensor) -> torch.Tensor:
    """Cholesky factor of a (batch of) symmetric PSD matrices, adding jitter·mean(diag) if needed."""
    scale = mat.diagonal(dim1=-2, dim2=-1).abs().mean(-1).clamp_min(1e-30)[..., None, None]
    eye = torch.eye(mat.shape[-1], dtype=mat.dtype, device=mat.device)
    for jitter in _JITTERS:
        chol, info = torch.linalg.cholesky_ex(mat + jitter * scale * eye)
        if not bool((info != 0).any()):
            return chol
    raise BayescliError(
        "covariance is not positive definite even with jitter 1e-4; increase the prior precision"
    )


@dataclass
class LogitGaussian:
    """Per-input Gaussians over logits, ``N(mean [N,K], Σ [N,K,K])``.

    ``Σ`` is kept in the cheapest exact form the posterior allows:

    * ``var`` only (diagonal ``Σ``; ``kind == "diag"``),
    * ``basis [K,K]`` (orthogonal, shared) and ``spectrum [N,K]`` with
      ``Σ_n = basis · diag(spectrum_n) · basisᵀ`` (``kind == "eig"``, from kron posteriors),
    * ``cov [N,K,K]`` (``kind == "full"``).

    ``var [N,K]`` (the diagonal) is always present.

    ``alpha [N,K]``, when set, is a Dirichlet the posterior produces natively (Dirichlet fVI);
    ``(mean, Σ)`` is then its Laplace-bridge image and the bridge link returns ``alpha`` itself.
    ``exact`` says whether the method's predictive over logits *is* this Gaussian (last-layer
    Laplace/VI) or a moment approximation of it (deep MNVI, Dirichlet fVI) — VI-SPEC §0.
    """

    mean: torch.Tensor
    var: torch.Tensor
    cov: torch.Tensor | None = None
    basis: torch.Tensor | None = None
    spectrum: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    exact: bool = True

    @property
    def kind(self) -> str:
        if self.cov is not None:
            return "full"
        return "eig" if self.basis is not None else "diag"

    def __len__(self) -> int:
        return int(self.mean.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.mean.shape[-1])

    def cov_matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``Σ_n v_n`` for ``v [N,K]`` → ``[N,K]`` without forming ``Σ`` when avoidable."""
        if self.cov is not None:
            return torch.einsum("nkl,nl->nk", self.cov, v)
        if self.basis is not None:
            return ((v @ self.basis) * self.spectrum) @ self.basis.T
        return self.var * v

    def rowsum(self) -> torch.Tensor:
        """``Σ_n 1`` ``[N,K]`` (what the bridge's zero-sum correction needs)."""
        if self.basis is not None:
            return (self.spectrum * self.basis.sum(0)) @ self.basis.T
        return self.cov_matvec(torch.ones_like(self.mean))

    def covariance(self) -> torch.Tensor:
        """The full ``Σ [N,K,K]`` (materialised on request)."""
        if self.cov is not None:
            return self.cov
        if self.basis is not None:
            return torch.einsum("ki,ni,li->nkl", self.basis, self.spectrum, self.basis)
        return torch.diag_embed(self.var)

    def sample(self, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``num`` draws ``[M, N, K]`` (Cholesky with jitter for full covariances)."""
        n, k = self.mean.shape
        eps = torch.randn(num, n, k, generator=generator, dtype=self.mean.dtype, device=self.mean.device)
        if self.cov is not None:
            chol = cholesky_jitter(self.cov)
            return self.mean + torch.einsum("nkl,mnl->mnk", chol, eps)
        if self.basis is not None:
            return self.mean + (eps * self.spectrum.clamp_min(0).sqrt()) @ self.basis.T
        return self.mean + eps * self.var.clamp_min(0).sqrt()

    def slice(self, sl: slice) -> LogitGaussian:
        """Rows ``sl`` of every per-input tensor."""
        return LogitGaussian(
            self.mean[sl],
            self.var[sl],
            None if self.cov is None else self.cov[sl],
            self.basis,
            None if self.spectrum is None else self.spectrum[sl],
            None if self.alpha is None else self.alpha[sl],
            self.exact,
        )

    @staticmethod
    def cat(parts: list[LogitGaussian]) -> LogitGaussian:
        """Concatenate batches (all of the same kind)."""
        first = parts[0]

        def cat(name: str) -> torch.Tensor | None:
            if getattr(first, name) is None:
                return None
            return torch.cat([getattr(p, name) for p in parts])

        return LogitGaussian(
            cat("mean"), cat("var"), cat("cov"), first.basis, cat("spectrum"), cat("alpha"), first.exact
        )


def augment(phi: torch.Tensor) -> torch.Tensor:
    """``φ̃ = [φ, 1]``: ``[N, D]`` → ``[N, D+1]``."""
    return torch.cat([phi, torch.ones_like(phi[:, :1])], dim=1)


def _affine(phi: torch.Tensor, mat: torch.Tensor, bias: bool) -> torch.Tensor:
    """``φ̃ @ mat`` for ``mat [D(+1), M]`` without building ``φ̃`` (the last row is the bias's)."""
    if not bias:
        return phi @ mat
    return torch.addmm(mat[-1], phi, mat[:-1])


class WeightGaussian(ABC):
    """``N(mean, (H + δI)⁻¹)`` over a flat parameter vector of length ``P``."""

    structure: str
    mean: torch.Tensor
    delta: float

    @property
    def num_params(self) -> int:
        return int(self.mean.numel())

    @abstractmethod
    def log_det_precision(self, delta: float | torch.Tensor) -> torch.Tensor:
        """``log det(H + δI)`` for scalar or vector ``δ`` (vectorised over ``δ``)."""

    @abstractmethod
    def sample(self, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``num`` weight draws ``[M, P]`` (row-major ``[K, D+1]`` layout for heads)."""

    @abstractmethod
    def push_last_layer(self, phi: torch.Tensor, bias: bool) -> LogitGaussian:
        """Logit Gaussian of ``f = W̃ φ̃`` for features ``phi [N, D]``; ``bias`` says whether the
        head's parameters are ``[W, b]`` (then ``φ̃ = [φ; 1]``, never materialised) or ``W``."""

    def push_jacobian(self, f: torch.Tensor, jac: torch.Tensor) -> LogitGaussian:
        """Logit Gaussian ``N(f, J Σ Jᵀ)`` for ``f [N,K]`` and ``J [N,K,P]``."""
        raise BayescliError(f"{self.structure} posteriors support the last layer only")

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """What the posterior file stores (curvature and mean)."""

    def with_delta(self, delta: float) -> WeightGaussian:
        self.delta = float(delta)
        self._refresh()
        return self

    @abstractmethod
    def _refresh(self) -> None:
        """Recompute what depends on ``δ``."""


class DiagGaussian(WeightGaussian):
    """Diagonal precision ``h + δ``; ``mean`` and ``h`` of shape ``[K, D+1]`` (heads) or ``[P]``.

    ``h`` keeps the dtype it was summed in (float64 for last-layer fits), which the marginal
    likelihood reads; the variances the predictive uses are cached in the mean's dtype."""

    structure = "diag"

    def __init__(self, mean: torch.Tensor, h: torch.Tensor, delta: float = 1.0) -> None:
        if mean.shape != h.shape:
            raise ValueError(f"mean {list(mean.shape)} and curvature {list(h.shape)} differ")
        self.mean, self.h, self.delta = mean, h, float(delta)
        self._refresh()

    def _refresh(self) -> None:
        self._variance = (1.0 / (self.h + self.delta)).to(self.mean.dtype)

    def variance(self) -> torch.Tensor:
        return self._variance

    def log_det_precision(self, delta: float | torch.Tensor) -> torch.Tensor:
        d = torch.as_tensor(delta, dtype=torch.float64, device=self.h.device).reshape(-1, 1)
        return torch.log(self.h.double().reshape(1, -1) + d).sum(-1).reshape(torch.as_tensor(delta).shape)

    def sample(self, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = self.mean.reshape(-1)
        eps = torch.randn(num, flat.numel(), generator=generator, dtype=flat.dtype, device=flat.device)
        return flat + eps * self.variance().reshape(-1).sqrt()

    def push_last_layer(self, phi: torch.Tensor, bias: bool) -> LogitGaussian:
        s = self.variance()
        return LogitGaussian(_affine(phi, self.mean.T, bias), _affine(phi.square(), s.T, bias))

    def push_jacobian(self, f: torch.Tensor, jac: torch.Tensor) -> LogitGaussian:
        s = self.variance().reshape(-1)
        cov = torch.einsum("nkp,p,nlp->nkl", jac, s, jac)
        return LogitGaussian(f, cov.diagonal(dim1=1, dim2=2).clone(), cov)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "curvature_diag": self.h}


class KronGaussian(WeightGaussian):
    """Last-layer ``H ≈ G ⊗ A`` (``G [K,K]`` summed over data, ``A [D+1,D+1]`` averaged), with
    the prior added exactly on the eigenvalues: precision eigenvalues ``g_i a_j + δ``."""

    structure = "kron"

    def __init__(self, mean: torch.Tensor, G: torch.Tensor, A: torch.Tensor, delta: float = 1.0) -> None:
        k, d1 = mean.shape
        if G.shape != (k, k) or A.shape != (d1, d1):
            raise ValueError(
                f"Kronecker factors {list(G.shape)}, {list(A.shape)} do not fit {list(mean.shape)}"
            )
        self.mean, self.G, self.A, self.delta = mean, G, A, float(delta)
        # Factors are accumulated and decomposed in float64; the predictive runs in the mean's dtype.
        g, q_g = torch.linalg.eigh(G.double())
        a, q_a = torch.linalg.eigh(A.double())
        self.Q_G, self.Q_A = q_g.to(mean.dtype), q_a.to(mean.dtype)
        # Eigenvalues of PSD factors may come out at -1e-16·‖·‖; they are zero in exact arithmetic.
        # They stay in float64 (the marginal likelihood's log-determinant reads them).
        self.g, self.a = g.clamp_min(0), a.clamp_min(0)
        # One GEMM gives both the logit mean and u = Q_Aᵀφ̃ for every input.
        self._mean_and_basis = torch.cat([mean.T, self.Q_A], dim=1)  # [D+1, K + D+1]
        self._Q_G2 = self.Q_G.pow(2).T.contiguous()  # var_k = Σ_i Q_G[k,i]² spectrum_i
        self._refresh()

    def _refresh(self) -> None:
        self.inv_eig = (1.0 / (torch.outer(self.g, self.a) + self.delta)).to(self.mean.dtype)  # [K, D+1]

    def log_det_precision(self, delta: float | torch.Tensor) -> torch.Tensor:
        ga = torch.outer(self.g, self.a).reshape(1, -1)
        d = torch.as_tensor(delta, dtype=torch.float64, device=ga.device).reshape(-1, 1)
        return torch.log(ga + d).sum(-1).reshape(torch.as_tensor(delta).shape)

    def sample(self, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
        eps = torch.randn(
            num, *self.mean.shape, generator=generator, dtype=self.mean.dtype, device=self.mean.device
        )
        w = self.mean + self.Q_G @ (eps * self.inv_eig.sqrt()) @ self.Q_A.T
        return w.reshape(num, -1)

    def push_last_layer(self, phi: torch.Tensor, bias: bool) -> LogitGaussian:
        k = self.mean.shape[0]
        both = _affine(phi, self._mean_and_basis, bias)  # [N, K + D+1]
        spectrum = both[:, k:].square_() @ self.inv_eig.T  # [N, K]
        return LogitGaussian(both[:, :k], spectrum @ self._Q_G2, basis=self.Q_G, spectrum=spectrum)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "kron_G": self.G, "kron_A": self.A}


class FullGaussian(WeightGaussian):
    """Dense precision ``H + δI`` (``[P, P]``, ``P ≤ MAX_FULL_PARAMS``)."""

    structure = "full"

    def __init__(self, mean: torch.Tensor, H: torch.Tensor, delta: float = 1.0) -> None:
        p = mean.numel()
        if p > MAX_FULL_PARAMS:
            raise BayescliError(
                f"a full covariance over {p:,} parameters exceeds the {MAX_FULL_PARAMS:,} limit; "
                "use hessian='kron' or 'diag'"
            )
        self.mean, self.H, self.delta = mean, H, float(delta)
        # One eigendecomposition serves every δ: Σ = Q diag(1/(λ + δ)) Qᵀ.
        sym = 0.5 * (H.double() + H.double().T)
        eig, self.Q = torch.linalg.eigh(sym)
        self.eig = eig.clamp_min(0)  # PSD in exact arithmetic
        self._refresh()

    def _refresh(self) -> None:
        self.cov_factor = (self.Q * (self.eig + self.delta).rsqrt()).to(self.mean.dtype)  # Σ = F Fᵀ

    def covariance(self) -> torch.Tensor:
        return self.cov_factor @ self.cov_factor.T

    def log_det_precision(self, delta: float | torch.Tensor) -> torch.Tensor:
        d = torch.as_tensor(delta, dtype=torch.float64, device=self.eig.device).reshape(-1, 1)
        return torch.log(self.eig.reshape(1, -1) + d).sum(-1).reshape(torch.as_tensor(delta).shape)

    def sample(self, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = self.mean.reshape(-1)
        eps = torch.randn(num, flat.numel(), generator=generator, dtype=flat.dtype, device=flat.device)
        return flat + eps @ self.cov_factor.T

    def push_last_layer(self, phi: torch.Tensor, bias: bool) -> LogitGaussian:
        phi_aug = augment(phi) if bias else phi
        k, d1 = self.mean.shape
        jl = torch.einsum("nd,kdp->nkp", phi_aug, self.cov_factor.reshape(k, d1, -1))  # J L
        cov = jl @ jl.transpose(1, 2)
        return LogitGaussian(phi_aug @ self.mean.T, cov.diagonal(dim1=1, dim2=2).clone(), cov)

    def push_jacobian(self, f: torch.Tensor, jac: torch.Tensor) -> LogitGaussian:
        jl = jac @ self.cov_factor
        cov = jl @ jl.transpose(1, 2)
        return LogitGaussian(f, cov.diagonal(dim1=1, dim2=2).clone(), cov)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "curvature_full": self.H}


def log_prior_norm(num_params: int, delta: torch.Tensor) -> torch.Tensor:
    """``(P/2) log(δ / 2π)``: the log-normaliser of the isotropic prior ``N(0, δ⁻¹ I)``."""
    return 0.5 * num_params * (torch.log(delta) - math.log(2 * math.pi))
