"""Expectations of the Bernoulli (sigmoid-per-label) likelihood under Gaussian logits.

A multi-label head models ``K`` independent labels ``y_k ∈ {0, 1}`` with ``p_k = σ(f_k)``;
under logits ``f_k ~ N(μ_k, v_k)`` every expectation the VI objectives need is a 1-D integral per
label, so the logit covariance enters through its diagonal only:

* ``E[log p(y_k | f_k)] = y_k μ_k − E[softplus(f_k)]`` (``log σ(f) = f − softplus(f)``; the
  form of PyTorch's ``binary_cross_entropy_with_logits``); summed over labels it is MNVI's and
  GLM VI's expected log-likelihood;
* ``E[σ(f_k)]``: the residual ``y − E[σ]`` of GLM VI's gradient and the per-label predictive;
* ``E[σ(f_k)(1 − σ(f_k))]``: GLM VI's curvature (``Λ = diag(σ(1 − σ))``).

Each is a smooth function of ``(μ, √v)``, computed in float64 by one of two rules:

* ``√v ≤ 1.5``: Gauss–Hermite, ``E[g(f)] = Σ_i w_i g(μ + √v z_i)`` (the integrand is smooth on
  the nodes' scale), with as few nodes as the cell's ``√v`` allows (:data:`HERMITE_BANDS`). The
  integrands are analytic in the strip ``|Im z| < π/√v`` (the sigmoid's poles sit at ``f = iπ(2m+1)``),
  so the rule's error decays like ``exp(−c√n/√v)``: measured against 200-node Gauss–Hermite over
  ``|μ| ≤ 40`` the largest error of the three falls below 1e-13 absolute and 1e-10 relative at
  6, 9, 15, 25 and 37 nodes for ``√v ≤`` 0.1, 0.25, 0.5, 0.75 and 1; the bands use a few more.
  Above 1 the full 64 nodes err by ≤ 6e-13 (at ``√v = 1.5``);
* ``√v > 1.5``: the sigmoid's unit-width step falls between Gauss–Hermite nodes (64 nodes err by
  ~2e-3 at ``√v = 10``), so the step is split off and the rest, decaying like ``e^{−|f|}``, is
  integrated by Gauss–Laguerre against ``N(±t) = N(±t; μ, v)`` (the three integrals share the
  densities):
  ``E[σ] = Φ(μ/√v) + ∫₀^∞ e^{−t} σ(t) (N(−t) − N(t)) dt``,
  ``E[σ(1 − σ)] = ∫₀^∞ e^{−t} σ(t)² (N(t) + N(−t)) dt``,
  ``E[softplus] = μΦ(μ/√v) + √v φ(μ/√v) + ∫₀^∞ e^{−t} eᵗ log(1 + e^{−t}) (N(t) + N(−t)) dt``
  (``softplus(f) = max(f, 0) + log(1 + e^{−|f|})``).

Both rules are differentiable in ``μ`` and ``v`` (MNVI backpropagates through them). Measured
against adaptive quadrature (tests/test_vi_bernoulli.py, ``|μ| ≤ 40``, ``√v ≤ 50``) the absolute
error is ≲ 1e-12. The nodes are evaluated once per cell for all three integrands (one sigmoid, one
softplus), which is most of GLM VI's per-iteration cost on a multi-label head.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import nn

from bayescli.posterior.selection import Scored
from bayescli.posterior.vi.softmax_expectations import gauss_hermite

# (largest √v, Gauss–Hermite nodes) per band, each a few nodes above the measured need (module docs);
# above the last band the Laguerre rule takes over.
HERMITE_BANDS = ((0.1, 8), (0.25, 12), (0.5, 18), (0.75, 28), (1.0, 40), (1.5, 64))
LAGUERRE_NODES = 64
# Laguerre nodes whose weight is below this are dropped (37 of 64 remain, ~40% less work):
# every integrand above is ≤ 1 times two densities ≤ 0.27 (√v > 1.5), so they add < 1e-23, and
# tail probabilities keep the full rule's relative accuracy (~1e-5 at e^{−38}).
LAGUERRE_WEIGHT_FLOOR = 1e-25
# Gauss–Hermite up to this logit standard deviation, the split-off-the-step Laguerre form above.
SWITCH_STD = HERMITE_BANDS[-1][0]
# softplus(f) is f to float64 round-off above this (e^{−40} = 4e-18); PyTorch's default threshold,
# 20, errs by e^{−20} = 2e-9 just above it
SOFTPLUS_LINEAR = 40.0
# keeps √v differentiable where a logit variance is exactly 0
_VAR_FLOOR = 1e-20
_SQRT_2PI = math.sqrt(2 * math.pi)


@functools.cache
def _laggauss(num: int) -> tuple[np.ndarray, np.ndarray]:
    nodes, weights = np.polynomial.laguerre.laggauss(num)
    keep = weights >= LAGUERRE_WEIGHT_FLOOR
    return nodes[keep], weights[keep]


def _laguerre(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    nodes, weights = _laggauss(LAGUERRE_NODES)
    return (
        torch.as_tensor(nodes, dtype=torch.float64, device=device),
        torch.as_tensor(weights, dtype=torch.float64, device=device),
    )


def _density(t: torch.Tensor, mu: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * ((t - mu) / std).square()) / (std * _SQRT_2PI)


def _step_split(mu: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``[E softplus, E σ, E σ(1 − σ)]`` ``[3, n]`` for ``f ~ N(mu [n], std [n]²)`` by the
    Laguerre form (module docs); the two densities are shared by the three integrals."""
    t, w = _laguerre(mu.device)
    m, s = mu[:, None], std[:, None]
    pos, neg = _density(t, m, s), _density(-t, m, s)
    both = pos + neg
    sig = torch.sigmoid(t)
    z = mu / std
    step = torch.special.ndtr(z)
    # eᵗ log(1 + e^{−t}) = log1p(e^{−t}) / e^{−t}, → 1 as t grows
    tail = torch.log1p(torch.exp(-t)) * torch.exp(t)
    relu = mu * step + std * torch.exp(-0.5 * z.square()) / _SQRT_2PI
    softplus = relu + (tail * both) @ w
    sigmoid = step + (sig * (neg - pos)) @ w
    variance = (sig.square() * both) @ w
    return torch.stack([softplus, sigmoid, variance])


@functools.cache
def _hermite(num: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    z, w = gauss_hermite(torch.float64, num)
    return z.to(device), w.to(device)


def _hermite_rule(mu: torch.Tensor, std: torch.Tensor, num: int) -> torch.Tensor:
    """``[E softplus, E σ, E σ(1 − σ)]`` ``[3, n]`` by ``num``-node Gauss–Hermite; the sigmoid at
    the nodes serves both of its integrands."""
    z, w = _hermite(num, mu.device)
    f = torch.addcmul(mu[:, None], std[:, None], z)
    sig = torch.sigmoid(f)
    softplus = nn.functional.softplus(f, threshold=SOFTPLUS_LINEAR)
    return torch.stack([softplus @ w, sig @ w, (sig * (1 - sig)) @ w])


def gaussian_expectations(mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(E[softplus(f)], E[σ(f)], E[σ(f)(1 − σ(f))])`` elementwise for ``f ~ N(mean, var)`` (any
    shape, float64); each cell by the rule of its standard deviation's band (module docs)."""
    shape = mean.shape
    mu = mean.double().reshape(-1)
    std = var.double().reshape(-1).clamp_min(_VAR_FLOOR).sqrt()
    edges = torch.tensor([top for top, _ in HERMITE_BANDS], dtype=std.dtype, device=std.device)
    band = torch.bucketize(std.detach(), edges)  # edges[b − 1] < std ≤ edges[b]; len(edges): wide
    rules = [functools.partial(_hermite_rule, num=num) for _, num in HERMITE_BANDS] + [_step_split]
    out = mu.new_zeros(3, len(mu))
    for b in torch.unique(band).tolist():
        cells = (band == b).nonzero().squeeze(1)
        out = out.index_copy(1, cells, rules[b](mu[cells], std[cells]))
    return tuple(part.reshape(shape) for part in out)


def expected_log_likelihood(mean: torch.Tensor, var: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``E[log p(y | f)] = Σ_k (y_k μ_k − E[softplus(f_k)])`` ``[B]`` (float64) for
    ``f ~ N(mean [B, K], diag var [B, K])`` and labels ``[B, K]`` in ``{0, 1}`` (``log σ(f) = f −
    softplus(f)``, ``log(1 − σ(f)) = −softplus(f)``); differentiable."""
    softplus = gaussian_expectations(mean, var)[0]
    return (labels.to(torch.float64) * mean.double() - softplus).sum(1)


def expected_sigmoid(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """The per-label predictive ``E[σ(f)]`` ``[N, K]`` (in ``mean``'s dtype)."""
    return gaussian_expectations(mean, var)[1].to(mean.dtype)


def log_mean_sigmoid(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``log E[σ(f)]`` elementwise in float64, ``f ~ N(mean, var)``, at any margin.

    Where ``μ + v < 0``, ``E[σ(f)]`` may lie below float64's range (``e^{−800}``), so it is taken
    through the exponential tilt ``σ(f) = e^f σ(−f)``: ``E[σ(f)] = e^{μ + v/2} E[σ(−f′)]`` with
    ``f′ ~ N(μ + v, v)``, and ``E[σ(−f′)] ≥ ½`` there (``f′`` is symmetric about a non-positive
    mean), so its log keeps every digit; elsewhere ``E[σ(f)]`` is computed directly."""
    mu, v = mean.double(), var.double().clamp_min(0)
    out = gaussian_expectations(mu, v)[1].clamp_min(torch.finfo(torch.float64).tiny).log()
    tilt = mu + v < 0
    if tilt.any():
        m, w = mu[tilt], v[tilt]
        out[tilt] = m + w / 2 + gaussian_expectations(-(m + w), w)[1].log()
    return out


def sigmoid_predictive(mean: torch.Tensor, var: torch.Tensor) -> Scored:
    """The per-label predictive ``E[σ(f)]`` ``[N, K]`` (in ``mean``'s dtype) with its float64
    log-odds ``log E[σ(f)] − log E[σ(−f)]`` (:func:`log_mean_sigmoid` each), so that the
    per-label NLL stays exact at any margin."""
    log_p = log_mean_sigmoid(mean, var)
    return Scored(log_p.exp().to(mean.dtype), log_odds=log_p - log_mean_sigmoid(-mean, var))


def bernoulli_expectations(
    mean: torch.Tensor, var: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``E[log p(y|f)] [B]``, ``E[y − σ(f)] [B, K]`` and the diagonal ``E[σ(f)(1 − σ(f))] [B, K]``
    of ``E[Λ]`` for ``f ~ N(mean [B, K], diag var [B, K])`` (``var`` may be a ``[B, K, K]``
    covariance: only its diagonal matters), in ``mean``'s dtype; one pass of the rules."""
    if var.dim() == 3:
        var = var.diagonal(dim1=1, dim2=2)
    y = labels.to(torch.float64)
    softplus, sigmoid, variance = gaussian_expectations(mean, var)
    ell = (y * mean.double() - softplus).sum(1)
    dtype = mean.dtype
    return ell.to(dtype), (y - sigmoid).to(dtype), variance.to(dtype)
