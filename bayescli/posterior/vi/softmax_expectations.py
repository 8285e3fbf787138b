"""Expectations of the softmax likelihood under Gaussian logits ``f ~ N(mean, cov)``.

Shared by GLM VI (natural-gradient updates), GGP VI (the SVGP objective) and their validation
predictives. ``K = 2``: exact, by 64-node Gauss–Hermite on the logit difference ``f₀ − f₁`` (the
softmax depends on nothing else). ``K > 2``: Monte Carlo with seeded draws.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import nn

from bayescli import devices
from bayescli.posterior.gaussian import LogitGaussian, cholesky_jitter
from bayescli.posterior.selection import Scored

GH_NODES = 64
# Draws of the Monte-Carlo predictive that scores a candidate on validation data.
VAL_SAMPLES = 100


@functools.cache
def _hermegauss(num: int) -> tuple[np.ndarray, np.ndarray]:
    nodes, weights = np.polynomial.hermite_e.hermegauss(num)
    return nodes, weights / math.sqrt(2 * math.pi)


def gauss_hermite(
    dtype: torch.dtype, num: int = GH_NODES, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights with ``E_{z~N(0,1)}[g(z)] ≈ Σ_i w_i g(z_i)`` (exact for degree < 2·num),
    on ``device`` (default: the CPU)."""
    nodes, weights = _hermegauss(num)
    as_tensor = functools.partial(torch.as_tensor, dtype=dtype, device=device)
    return as_tensor(nodes), as_tensor(weights)


def _difference(mean: torch.Tensor, cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of ``f₀ − f₁`` for ``K = 2`` (``cov`` a variance or ``[B,2,2]``)."""
    var = cov[:, 0] + cov[:, 1] if cov.dim() == 2 else cov[:, 0, 0] + cov[:, 1, 1] - 2 * cov[:, 0, 1]
    return mean[:, 0] - mean[:, 1], var.clamp_min(0).sqrt()


def _draws(mean: torch.Tensor, cov: torch.Tensor, samples: int, generator: torch.Generator) -> torch.Tensor:
    """``samples`` float32 logit draws ``[S, B, K]`` (``cov`` a variance ``[B,K]`` or ``[B,K,K]``).

    float32: the Monte-Carlo error (~1/√S) dwarfs its round-off, and drawing and exponentiating
    S·B·K numbers dominates an iteration's time.
    """
    eps = torch.randn(samples, *mean.shape, generator=generator, dtype=torch.float32, device=mean.device)
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
        nodes, weights = gauss_hermite(mean.dtype, device=mean.device)
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
        block = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=mean.dtype, device=mean.device)
        return ell, onehot - probs, lam[:, None, None] * block
    # classes on the middle axis, [S, K, B]: CPU kernels that reduce over a short last axis (K = 10)
    # are ~10x slower than over a middle one, and the softmax is most of an iteration's time; the
    # results are [K, B]-contiguous, so their transposes feed the next GEMMs (Jᵀ r) without copies
    logp = _draws(mean, cov, samples, generator).transpose(1, 2).contiguous().log_softmax(1)
    p = logp.exp()
    ell = logp.gather(1, labels.view(1, 1, -1).expand(samples, 1, -1)).squeeze(1).mean(0)
    p_mean = p.mean(0).T
    if diag_only:
        lam = (p - p.square()).mean(0).T
    else:
        lam = torch.diag_embed(p_mean) - torch.einsum("skb,slb->bkl", p, p) / samples
    dtype = mean.dtype
    return ell.to(dtype), onehot - p_mean.to(dtype), lam.to(dtype)


def expected_log_softmax(
    mean: torch.Tensor, var: torch.Tensor, labels: torch.Tensor, samples: int, generator: torch.Generator
) -> torch.Tensor:
    """Differentiable ``E[log softmax(f)_y] [B]`` for independent ``f_k ~ N(mean, var)`` ``[B,K]``.

    ``K = 2``: Gauss–Hermite on ``f₀ − f₁``; ``K > 2``: reparameterised Monte Carlo.
    """
    if mean.shape[1] == 2:
        nodes, weights = gauss_hermite(mean.dtype, device=mean.device)
        m, s = _difference(mean, var)
        sign = 1.0 - 2.0 * labels.to(mean.dtype)
        return nn.functional.logsigmoid(sign[:, None] * (m[:, None] + s[:, None] * nodes)) @ weights
    eps = torch.randn(samples, *mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
    logp = (mean + eps * var.clamp_min(1e-30).sqrt()).log_softmax(-1)
    return logp.gather(2, labels.view(1, -1, 1).expand(samples, -1, 1)).squeeze(2).mean(0)


def expectation_label(num_classes: int, samples: int) -> str:
    """How the likelihood's expectations are computed (recorded in the posterior's metadata)."""
    if num_classes == 2:
        return f"exact: {GH_NODES}-node Gauss-Hermite on f0 - f1"
    return f"Monte Carlo: {samples} logit draws per input and step (seeded)"


def log_mean_softmax(draws: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log((1/S) Σ_s softmax(z_s))`` in float64 for draws ``z [S, ...]`` (softmax over ``dim``):
    a log-sum-exp of the draws' log-softmax, so a class whose mean probability rounds to 0 keeps
    its log (the NLL of a confidently wrong input is exact, not that of ``log 0``)."""
    return (draws.log_softmax(dim).logsumexp(0) - math.log(len(draws))).double()


def mc_predictive(lg: LogitGaussian, seed: int, samples: int = VAL_SAMPLES) -> Scored:
    """The Monte-Carlo predictive ``E[softmax f] [N, K]``, ``f ~ lg`` (``samples`` seeded draws),
    with its log-probabilities (:func:`log_mean_softmax`)."""
    draws = lg.sample(samples, devices.generator(lg.mean.device, seed))
    draws = draws.transpose(1, 2).contiguous()  # classes on the middle axis: a faster softmax
    return Scored(draws.softmax(1).mean(0).T, log_mean_softmax(draws, 1).T)
