"""Sparse variational GP numerics of GGP VI (one whitened SVGP per class).

``whitening`` turns the inducing kernel into ``W`` with ``W K(Z, Z) Wᵀ = I`` (rank ``r``, small
eigenvalues dropped); :class:`Projected` holds ``a(x) = W k(Z, x)`` and the residual variance;
``svgp_moments``/``predict_svgp`` give the per-class logit moments of ``q(u) = N(m, LLᵀ)``;
``kl_whitened`` is ``KL(q ‖ N(0, I))``; ``train_svgp`` maximises the ELBO with Adam.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bayescli import devices
from bayescli.errors import require
from bayescli.posterior.gaussian import LogitGaussian
from bayescli.posterior.vi.softmax_expectations import expected_log_softmax
from bayescli.progress import track

# Eigenvalues of K(Z, Z) below this fraction of the largest are dropped from the whitening.
RANK_TOL = 1e-10
CHUNK = 2048


def whitening(kernel: torch.Tensor) -> torch.Tensor:
    """``W = diag(λ^{-½}) Uᵀ`` ``[C, r, M]`` for ``K = U diag(λ) Uᵀ`` ``[C, M, M]`` (float64).

    ``r`` is the largest number of eigenvalues above ``RANK_TOL·λ_max`` over the classes; rows of a
    class's dropped eigenvalues are zero (those directions carry no prior variance).
    """
    evals, evecs = torch.linalg.eigh(kernel.double())
    evals, evecs = evals.flip(-1), evecs.flip(-1)  # descending
    keep = evals > evals[..., :1].clamp_min(1e-300) * RANK_TOL
    rank = int(keep.sum(-1).max())
    require(rank > 0, "the GGP kernel on the inducing points is zero; check the features")
    inv = torch.where(keep, evals.clamp_min(1e-300).rsqrt(), torch.zeros_like(evals))[..., :rank]
    return (evecs[..., :rank] * inv[..., None, :]).transpose(-1, -2)


@dataclass
class Projected:
    """Kernel quantities of ``N`` inputs against the inducing points at ``δ = 1``.

    ``a [C|1, r, N] = W₁ k₁(Z, x)``, ``kres [C|1, N] = k₁(x, x) − ‖a‖²`` (≥ 0; computed in float64,
    where it cancels) and the prior mean ``[N, C]``. At ``δ`` the kernel is ``k₁/δ``, so
    ``a ∝ δ^{-½}`` and ``kres ∝ δ⁻¹``.
    """

    a: torch.Tensor
    kres: torch.Tensor
    prior_mean: torch.Tensor

    def at(self, delta: float) -> Projected:
        return Projected(self.a / math.sqrt(delta), self.kres / delta, self.prior_mean)

    def columns(self, idx: torch.Tensor | slice) -> Projected:
        return Projected(self.a[..., idx], self.kres[..., idx], self.prior_mean[idx])


def _chol(raw_lower: torch.Tensor, log_diag: torch.Tensor) -> torch.Tensor:
    """``R = tril(raw, −1) + diag(exp(log_diag))`` ``[C, r, r]`` (positive diagonal by construction)."""
    return torch.tril(raw_lower, -1) + torch.diag_embed(log_diag.exp())


def svgp_moments(
    proj: Projected, mean: torch.Tensor, chol: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictive mean and variance ``[N, C]`` of every class at the inputs of ``proj``."""
    f = proj.prior_mean + torch.einsum("crn,cr->nc", proj.a.expand(mean.shape[0], -1, -1), mean)
    lta = chol.transpose(1, 2) @ proj.a  # [C, r, N]
    var = (proj.kres + lta.square().sum(1)).T
    return f, var


def kl_whitened(mean: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """``Σ_c KL(N(m_c, R_c R_cᵀ) ‖ N(0, I))``."""
    r = mean.shape[1]
    logdet = 2 * torch.log(chol.diagonal(dim1=1, dim2=2)).sum()
    return 0.5 * (chol.square().sum() + mean.square().sum() - mean.shape[0] * r - logdet)


def predict_svgp(proj: Projected, mean: torch.Tensor, chol: torch.Tensor) -> LogitGaussian:
    """The SVGP logit Gaussian (diagonal: classes are independent), in chunks of inputs."""
    means, variances = [], []
    n = proj.prior_mean.shape[0]
    with torch.no_grad():
        for start in range(0, n, CHUNK):
            f, v = svgp_moments(proj.columns(slice(start, start + CHUNK)), mean, chol)
            means.append(f)
            variances.append(v)
    return LogitGaussian(torch.cat(means), torch.cat(variances))


@dataclass
class SVGPResult:
    mean: torch.Tensor
    chol: torch.Tensor
    objective: list[float]


def train_svgp(
    proj: Projected,
    labels: torch.Tensor,
    init_mean: torch.Tensor,
    epochs: int,
    lr: float,
    batch_size: int,
    samples: int,
    seed: int,
) -> SVGPResult:
    """Maximise the whitened SVGP ELBO with Adam; ``init_mean [C, r]``, ``S`` starts at ``I``.

    Returns the variational means ``[C, r]``, Cholesky factors ``[C, r, r]`` and the per-epoch
    objective ``−ELBO/N`` (a minibatch average). Runs on the device of ``proj`` (``labels`` there too).
    """
    n = len(labels)
    c, r = init_mean.shape
    # float32 like GPyTorch: the O(C·B·r²) products dominate; what cancels (``kres``) was formed in
    # float64 before.
    dtype = torch.float32
    dev = init_mean.device
    proj = Projected(proj.a.to(dtype), proj.kres.to(dtype), proj.prior_mean.to(dtype))
    mean = init_mean.clone().to(dtype).requires_grad_(True)
    raw = torch.zeros(c, r, r, dtype=dtype, device=dev, requires_grad=True)
    log_diag = torch.zeros(c, r, dtype=dtype, device=dev, requires_grad=True)
    opt = torch.optim.Adam([mean, raw, log_diag], lr=lr)
    steps = epochs * math.ceil(n / batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = devices.generator(dev, seed)
    # the objective is summed on the device (float64, as Python floats would) and read once at the end
    totals = torch.zeros(epochs, dtype=torch.float64, device=dev)
    for epoch in track(range(epochs), total=epochs, description="GGP VI"):
        perm = torch.randperm(n, generator=gen, device=dev)
        for start in range(0, n, batch_size):
            idx = perm[start : start + batch_size]
            chol = _chol(raw, log_diag)
            f, var = svgp_moments(proj.columns(idx), mean, chol)
            ell = expected_log_softmax(f, var, labels[idx], samples, gen).mean()
            loss = -ell + kl_whitened(mean, chol) / n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            totals[epoch] += loss.detach().double() * len(idx)
    history = (totals / n).tolist()
    with torch.no_grad():
        return SVGPResult(mean.detach().double(), _chol(raw, log_diag).detach().double(), history)
