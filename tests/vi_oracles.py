"""Independent oracles for the GLM/GGP VI tests: ELBO maximisers by direct optimisation.

Everything here is float64, uses tensor-product Gauss–Hermite quadrature on the logit
differences (K ≤ 3) and scipy's L-BFGS with autograd gradients — no code of bayescli.posterior.vi.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import minimize
from torch import nn

_NODES = {2: 128, 3: 40}  # per dimension of the K−1 logit differences


def _quadrature(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    nodes, weights = np.polynomial.hermite_e.hermegauss(_NODES[k])
    weights = weights / math.sqrt(2 * math.pi)
    grid = np.stack(np.meshgrid(*[nodes] * (k - 1), indexing="ij"), -1).reshape(-1, k - 1)
    w = np.ones(1)
    for _ in range(k - 1):
        w = np.outer(w, weights).reshape(-1)
    return torch.tensor(grid), torch.tensor(w)


def expected_log_softmax(mean: torch.Tensor, cov: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``E[log softmax(f)_y]`` ``[N]`` for ``f ~ N(mean [N,K], cov [N,K,K])``, K ∈ {2, 3}.

    log softmax is invariant to a common shift, so it depends on ``d = f_{:K−1} − f_K`` only.
    """
    n, k = mean.shape
    diff = torch.cat([torch.eye(k - 1), -torch.ones(k - 1, 1)], 1).double()
    m = mean @ diff.T
    s = diff @ cov @ diff.T
    nodes, weights = _quadrature(k)
    chol = torch.linalg.cholesky(s + 1e-300 * torch.eye(k - 1))
    d = m[:, None, :] + torch.einsum("nij,gj->ngi", chol, nodes)  # [N, G, K−1]
    full = torch.cat([d, torch.zeros(n, d.shape[1], 1, dtype=d.dtype)], -1)
    logp = full.gather(2, y.view(-1, 1, 1).expand(-1, d.shape[1], 1)).squeeze(2) - torch.logsumexp(full, -1)
    return logp @ weights


def softmax_moments(
    mean: torch.Tensor, cov: torch.Tensor, nodes: int = 30
) -> tuple[torch.Tensor, torch.Tensor]:
    """``E[p]`` ``[N,K]`` and ``E[ppᵀ]`` ``[N,K,K]``, ``p = softmax(f)``, by tensor-product Gauss–Hermite
    over all ``K`` dimensions of ``f ~ N(mean, cov)`` (``nodes^K`` points)."""
    z, w = np.polynomial.hermite_e.hermegauss(nodes)
    k = mean.shape[1]
    grid = torch.cartesian_prod(*[torch.tensor(z)] * k)
    weights = torch.ones(1, dtype=torch.float64)
    for _ in range(k):
        weights = torch.outer(weights, torch.tensor(w / math.sqrt(2 * math.pi))).reshape(-1)
    p = (mean[:, None, :] + grid @ torch.linalg.cholesky(cov).transpose(1, 2)).softmax(-1)  # [N, G, K]
    return torch.einsum("g,ngk->nk", weights, p), torch.einsum("g,ngk,ngl->nkl", weights, p, p)


def network_jacobian_autograd(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[N, K]`` and ``J [N, K, P]`` by ``torch.autograd.functional.jacobian``, input by input."""
    names = [n for n, _ in net.named_parameters()]
    params = [p.detach().double() for p in net.parameters()]
    netd = _double(net)

    def f(xi: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(netd, dict(zip(names, ps, strict=True)), (xi[None],))[0]

    jacs, outs = [], []
    for xi in x.double():
        out = f(xi, *params)
        jac = torch.autograd.functional.jacobian(lambda *ps, xi=xi: f(xi, *ps), tuple(params))
        jacs.append(torch.cat([j.reshape(out.shape[0], -1) for j in jac], 1))
        outs.append(out.detach())
    return torch.stack(outs), torch.stack(jacs)


def _double(net: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(net).double()


def expected_log_bernoulli(mean: torch.Tensor, cov: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``Σ_k E[y_k log σ(f_k) + (1 − y_k) log(1 − σ(f_k))]`` ``[N]`` for ``f ~ N(mean [N,K], cov [N,K,K])``
    and multi-label ``y [N, K]``: independent labels, so only the variances matter; 200-node
    Gauss–Hermite per label on ``log σ(±f)``."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(200)
    z, w = torch.tensor(nodes), torch.tensor(weights / math.sqrt(2 * math.pi))
    std = cov.diagonal(dim1=1, dim2=2).clamp_min(0).sqrt()
    f = mean[:, :, None] + std[:, :, None] * z  # [N, K, G]
    yy = y.double()[:, :, None]
    logp = yy * nn.functional.logsigmoid(f) + (1 - yy) * nn.functional.logsigmoid(-f)
    return (logp @ w).sum(1)


def glm_elbo(
    jac: torch.Tensor,
    offset: torch.Tensor,
    y: torch.Tensor,
    delta: float,
    mu: torch.Tensor,
    chol: torch.Tensor,
    expected=expected_log_softmax,
) -> torch.Tensor:
    """The GLM ELBO of ``q = N(μ, LLᵀ)`` (``chol`` = L, lower triangular with positive diagonal);
    ``expected(mean, cov, y)`` is the likelihood's expected log-likelihood per input."""
    p = jac.shape[2]
    jl = jac @ chol
    ell = expected(offset + jac @ mu, jl @ jl.transpose(1, 2), y).sum()
    kl = 0.5 * (
        delta * chol.square().sum()
        + delta * mu @ mu
        - p
        - p * math.log(delta)
        - 2 * torch.log(chol.diagonal()).sum()
    )
    return ell - kl


def maximise_elbo(
    jac: torch.Tensor,
    offset: torch.Tensor,
    y: torch.Tensor,
    delta: float,
    pattern: torch.Tensor,
    expected=expected_log_softmax,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``argmax`` of the GLM ELBO over ``N(μ, LLᵀ)`` with ``L`` lower triangular, zero outside the
    boolean ``pattern [P, P]`` (all lower: full; the diagonal: mean field; blocks: independent
    groups). Logits ``offset [N,K] + jac [N,K,P] θ``, prior ``N(0, δ⁻¹ I)``, likelihood by
    ``expected`` (softmax by default; :func:`expected_log_bernoulli`). Returns ``μ, Σ, ELBO``.
    """
    p = jac.shape[2]
    rows, cols = torch.nonzero(torch.tril(pattern), as_tuple=True)
    on_diag = rows == cols

    def unpack(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vals = torch.where(on_diag, v[p:].exp(), v[p:])
        lower = torch.zeros(p, p, dtype=torch.float64).index_put((rows, cols), vals)
        return v[:p], lower

    def negative(v_np: np.ndarray) -> tuple[float, np.ndarray]:
        v = torch.tensor(v_np, requires_grad=True)
        out = -glm_elbo(jac, offset, y, delta, *unpack(v), expected)
        out.backward()
        return out.item(), v.grad.numpy()

    res = minimize(
        negative,
        np.zeros(p + len(rows)),
        jac=True,
        method="L-BFGS-B",
        options={"gtol": 1e-11, "ftol": 1e-16, "maxiter": 20000, "maxcor": 50},
    )
    mu, lower = unpack(torch.tensor(res.x))
    return mu, lower @ lower.T, -float(res.fun)


def last_layer_design(x: torch.Tensor, k: int) -> torch.Tensor:
    """``J_n = I_K ⊗ [x_n; 1]ᵀ`` ``[N, K, K(D+1)]`` (row-major ``[K, D+1]`` parameters)."""
    xt = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)
    return torch.einsum("kl,nd->nkld", torch.eye(k, dtype=torch.float64), xt).reshape(len(x), k, -1)


def gp_vi_optimum(
    prior_mean: torch.Tensor, kernels: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (non-sparse) Gaussian VI of a GP classifier with independent classes on ``N`` points.

    ``q(f_c) = N(a_c, B_c B_cᵀ)`` on the points, prior ``N(prior_mean[:, c], kernels[c])``; returns the
    optimal marginal means and variances ``[N, C]``.
    """
    n, c = prior_mean.shape
    rows, cols = torch.tril_indices(n, n)
    on_diag = rows == cols
    kchol = torch.linalg.cholesky(kernels)
    logdet_k = 2 * torch.log(kchol.diagonal(dim1=1, dim2=2)).sum(1)
    per = n + len(rows)

    def unpack(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        means, factors = [], []
        for j in range(c):
            block = v[j * per : (j + 1) * per]
            vals = torch.where(on_diag, block[n:].exp(), block[n:])
            factors.append(torch.zeros(n, n, dtype=torch.float64).index_put((rows, cols), vals))
            means.append(block[:n])
        return torch.stack(means, 1), torch.stack(factors)

    def negative(v_np: np.ndarray) -> tuple[float, np.ndarray]:
        v = torch.tensor(v_np, requires_grad=True)
        a, b = unpack(v)
        var = b.square().sum(2).T  # [N, C]
        ell = expected_log_softmax(a, torch.diag_embed(var), y).sum()
        kl = 0.0
        for j in range(c):
            sol_b = torch.cholesky_solve(b[j], kchol[j])
            resid = (a[:, j] - prior_mean[:, j])[:, None]
            kl = kl + 0.5 * (
                torch.trace(b[j].T @ sol_b)
                + (resid.T @ torch.cholesky_solve(resid, kchol[j])).squeeze()
                - n
                + logdet_k[j]
                - 2 * torch.log(b[j].diagonal()).sum()
            )
        out = kl - ell
        out.backward()
        return out.item(), v.grad.numpy()

    start = np.concatenate(
        [np.concatenate([prior_mean[:, j].numpy(), np.zeros(len(rows))]) for j in range(c)]
    )
    res = minimize(
        negative, start, jac=True, method="L-BFGS-B", options={"gtol": 1e-11, "ftol": 1e-16, "maxiter": 20000}
    )
    a, b = unpack(torch.tensor(res.x))
    return a, b.square().sum(2).T
