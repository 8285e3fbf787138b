"""Multi-label links: per-label logit Gaussians ``N(μ [N,K], σ² [N,K])`` → probabilities ``[N,K]``.

Each label ``k`` of a sigmoid-per-class head is its own Bernoulli, ``π = sigmoid(z)``,
``z ~ N(μ, σ²)``; only the diagonal of the logit covariance matters for these marginals.

* ``none``   — MAP: ``sigmoid(μ)``.
* ``probit`` — MacKay: ``E[π] ≈ sigmoid(μ / √(1 + πσ²/8))`` (matches ``Φ(λz)`` to ``sigmoid(z)``
  with ``λ² = π/8``; absolute error below ~0.02 over all ``μ, σ``).
* ``mc``     — mean of ``sigmoid`` over ``M`` seeded draws, with each label's spread ``std``,
  expected binary entropy ``E[H_b(π)]`` and mutual information ``H_b(π̄) − E[H_b(π)]``.
* ``beta``   — the Bernoulli analogue of the Laplace bridge: the ``Beta(a, b)`` whose mean ``m``
  and variance ``v`` are those of ``π`` (a Beta is the Dirichlet on two outcomes). ``m`` and
  ``v`` come from quadrature (:func:`sigmoid_gaussian_moments`), then
  ``s = a + b = m(1 − m)/v − 1``, ``a = m s``, ``b = (1 − m) s``. The Beta's mutual
  information between label and weights is, with ``ψ`` the digamma function,
  ``I = H_b(m) − E[H_b(π)]``, ``E[H_b(π)] = −m (ψ(a+1) − ψ(s+1)) − (1−m) (ψ(b+1) − ψ(s+1))``
  (from ``E[π ln π] = (a/s) E_{Beta(a+1, b)}[ln π] = m (ψ(a+1) − ψ(s+1))`` and its mirror).

Everything is computed in float64 and returned in the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from bayescli import devices
from bayescli.errors import BayescliError
from bayescli.posterior.vi.bernoulli_expectations import log_mean_sigmoid

# Chunk sizes (:func:`bayescli.devices.chunk_elements`): these on a CPU, a memory budget on CUDA.
MC_CHUNK_ELEMENTS = 1 << 18  # samples × inputs × labels per chunk (as in links.py)
# Live [inputs, K, M] buffers of one MC chunk in the logits' dtype: the draws, the entropy's
# sigmoid, two softplus, their products and sum, then the sigmoid and its deviation from the mean.
MC_BUFFERS = 8
QUADRATURE_NODES = 64
QUADRATURE_CHUNK = 1 << 14  # labels per chunk: buffers of chunk × nodes float64 (8 MiB)
# Bytes per label of a quadrature chunk: ~16 live float64 [labels, nodes] buffers (the Hermite
# sigmoid and its squared deviation, the Laguerre densities, their differences and products).
QUADRATURE_LABEL_BYTES = 16 * QUADRATURE_NODES * 8
# Below this σ the integrand sigmoid(μ + σ√2 x) is smooth on Gauss–Hermite's scale; above it the
# sigmoid's unit-width step falls between the nodes, and the Laguerre form (whose integrand varies
# on the scale σ) takes over. At 1.5 both have absolute error ≲ 1e-13 (against mpmath, |μ| ≤ 30).
_SWITCH_SIGMA = 1.5
# Beta precision bounds. σ² → 0 sends v → 0 and s → ∞ (a point mass): s is capped at 1e10, where
# the Beta's std is ≤ 5e-6 and its mutual information ≈ 1/(2s) = 5e-11, i.e. a point mass at
# probability precision, and ψ(a+1) − ln m still resolves the MI in float64 (ψ(x) ≈ ln x + 1/(2x),
# so larger s would lose the 1/(2s) to rounding of ln s). σ² → ∞ sends v → m(1 − m) and s → 0:
# the floor keeps s positive where rounding would make v ≥ m(1 − m).
BETA_MAX_PRECISION = 1e10
BETA_MIN_PRECISION = 1e-8


class SigmoidLink(str, Enum):
    NONE = "none"
    PROBIT = "probit"
    MC = "mc"
    BETA = "beta"


@dataclass
class SigmoidLinkOutput:
    """Per-label results, all ``[N, K]``: ``probs``; ``alpha``/``beta`` for the Beta link; ``std``
    (spread of the per-label probability), ``expected_entropy`` (``E[H_b(π)]``) and
    ``mutual_information`` (``H_b(probs) − expected_entropy``) for ``mc`` and ``beta``; float64
    ``log_odds`` ``s`` with ``probs = sigmoid(s)`` for every link (``none`` and ``probit``: a
    scaled mean; ``mc``: ``log mean σ(z) − log mean σ(−z)`` over the draws; ``beta``: its mean's,
    :func:`~bayescli.posterior.vi.bernoulli_expectations.log_mean_sigmoid`), so the per-label NLL
    from ``log sigmoid(±s)`` is exact where ``probs`` round to 0 or 1."""

    probs: torch.Tensor
    alpha: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    std: torch.Tensor | None = None
    expected_entropy: torch.Tensor | None = None
    mutual_information: torch.Tensor | None = None
    log_odds: torch.Tensor | None = None


def _check(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Validate shapes; return ``var`` clamped at 0 (pushforwards can round to −1e-17)."""
    if mean.dim() != 2 or mean.shape != var.shape:
        raise BayescliError(
            "per-label logit mean and variance must both be [N, K], "
            f"got {list(mean.shape)} and {list(var.shape)}"
        )
    return var.clamp_min(0)


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    """``H_b(p) = −p ln p − (1 − p) ln(1 − p)`` in nats, elementwise (``0 ln 0 = 0``)."""
    return -(torch.special.xlogy(p, p) + torch.special.xlogy(1 - p, 1 - p))


def _entropy_of_logit(z: torch.Tensor) -> torch.Tensor:
    """``H_b(sigmoid(z)) = p softplus(−z) + (1 − p) softplus(z)``: two non-negative terms, so no
    cancellation and no ``log 0`` for large ``|z|``."""
    p = torch.sigmoid(z)
    return p * torch.nn.functional.softplus(-z) + (1 - p) * torch.nn.functional.softplus(z)


def probit(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """MacKay's ``sigmoid(μ / √(1 + πσ²/8))`` ``[N, K]``."""
    var = _check(mean, var)
    return torch.sigmoid(mean * (1 + var * (math.pi / 8)).rsqrt())


def probit_log_odds(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """The probit link's log-odds ``μ / √(1 + πσ²/8)`` ``[N, K]`` in float64 (:func:`probit` is
    their sigmoid, in the input dtype)."""
    var = _check(mean, var)
    return mean.double() * (1 + var.double() * (math.pi / 8)).rsqrt()


def monte_carlo(
    mean: torch.Tensor, var: torch.Tensor, samples: int, generator: torch.Generator
) -> SigmoidLinkOutput:
    """MC estimates per label from ``samples`` draws ``z ~ N(μ, σ²)``: ``probs = mean sigmoid(z)``,
    ``std`` (sample std of ``sigmoid(z)``), ``expected_entropy = mean H_b(sigmoid(z))`` and
    ``mutual_information``. Draws ``[rows, K, M]`` are made in chunks of ``MC_CHUNK_ELEMENTS`` on
    a CPU, of the device's budget over ``MC_BUFFERS`` buffers per draw on CUDA."""
    var = _check(mean, var)
    if samples < 1:
        raise BayescliError(f"the mc link needs at least 1 sample, got {samples}")
    n, k = mean.shape
    rows = devices.chunk_rows(mean.device, samples * k, MC_CHUNK_ELEMENTS, MC_BUFFERS * mean.element_size())
    eps = torch.empty(min(rows, n), k, samples, dtype=mean.dtype, device=mean.device)
    means, stds, ents, log_odds = [], [], [], []
    for start in range(0, n, rows):
        sl = slice(start, start + rows)
        e = eps[: len(mean[sl])].normal_(generator=generator)
        z = e.mul_(var[sl].sqrt().unsqueeze(-1)).add_(mean[sl].unsqueeze(-1))
        ents.append(_entropy_of_logit(z).mean(-1))
        # log mean σ(z) − log mean σ(−z): the 1/M of the two means cancels
        present = torch.nn.functional.logsigmoid(z).logsumexp(-1)
        log_odds.append((present - torch.nn.functional.logsigmoid(-z).logsumexp(-1)).double())
        p = torch.sigmoid(z)
        m = p.mean(-1)
        means.append(m)
        spread = torch.linalg.vector_norm(p - m.unsqueeze(-1), dim=-1)  # two-pass: no cancellation
        stds.append(spread / math.sqrt(samples - 1) if samples > 1 else spread)
    probs, expected = torch.cat(means), torch.cat(ents)
    # H_b is concave, so H_b(mean) ≥ mean H_b for the sample itself; only rounding goes below 0
    mi = (binary_entropy(probs) - expected).clamp_min(0)
    std, log_odds = torch.cat(stds), torch.cat(log_odds)
    return SigmoidLinkOutput(
        probs, std=std, expected_entropy=expected, mutual_information=mi, log_odds=log_odds
    )


def _nodes(kind: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = (np.polynomial.hermite.hermgauss if kind == "hermite" else np.polynomial.laguerre.laggauss)(
        QUADRATURE_NODES
    )
    return torch.from_numpy(x).to(device), torch.from_numpy(w).to(device)


def _normal_pdf(x: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * ((x - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))


def sigmoid_gaussian_moments(
    mean: torch.Tensor, var: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, 1 − m, v)`` ``[N, K]`` float64: mean, complement and variance of ``sigmoid(z)``,
    ``z ~ N(μ, σ²)``, by 64-node quadrature (absolute error ≲ 1e-13, measured against mpmath).

    The moments are computed for ``−|μ|`` (where ``m ≤ ½``) and mirrored, since
    ``sigmoid(−z) = 1 − sigmoid(z)``; so ``1 − m`` is accurate even where ``m`` rounds to 1.

    * ``σ ≤ 1.5``: Gauss–Hermite, ``E[g(z)] = π^{−½} Σ_i w_i g(μ + √2 σ x_i)``; ``v`` two-pass as
      ``E[(π − m)²]`` so that it keeps its relative accuracy as ``σ → 0``.
    * ``σ > 1.5``: split off the step, ``sigmoid(z) = 1[z > 0] + c(z)``, with ``c`` decaying like
      ``e^{−|z|}``: ``E[π] = Φ(μ/σ) + ∫₀^∞ e^{−t} sigmoid(t) (N(−t) − N(t)) dt`` and
      ``E[π²] = Φ(μ/σ) + ∫₀^∞ e^{−t} sigmoid(t) (e^{−t} sigmoid(t) N(−t) − (1 + sigmoid(t)) N(t)) dt``
      (``N`` the density of ``z``), by Gauss–Laguerre; then ``v = E[π²] − m²``, which does not
      cancel here (``v / E[π²]`` is bounded away from 0 once ``σ > 1``).

    In the far tails (``m ≲ 1e-10``, ``σ > 1.5``) the Laguerre values keep only ~5 significant
    digits (relative error ~1e-5 at ``|μ| = 30``); absolute accuracy is unaffected.

    Labels go through in chunks: ``QUADRATURE_CHUNK`` on a CPU, the device's budget over
    ``QUADRATURE_LABEL_BYTES`` a label on CUDA.
    """
    var = _check(mean, var)
    mu, sigma = mean.double().reshape(-1), var.double().sqrt().reshape(-1)
    chunk = devices.chunk_elements(mean.device, QUADRATURE_CHUNK, QUADRATURE_LABEL_BYTES)
    parts = [
        _moments_of_nonpositive(-mu[i : i + chunk].abs(), sigma[i : i + chunk])
        for i in range(0, len(mu), chunk)
    ]
    low, v = (torch.cat(x).reshape(mean.shape) for x in zip(*parts, strict=True))
    flip = mean.double() > 0
    return torch.where(flip, 1 - low, low), torch.where(flip, low, 1 - low), v


def _moments_of_nonpositive(mu: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E[π], Var[π])`` ``[n]`` for ``mu [n] ≤ 0`` and ``sigma [n]`` (see the caller's docs)."""
    mu, sigma = mu.unsqueeze(-1), sigma.unsqueeze(-1)  # [n, 1] against [nodes]
    x, w = _nodes("hermite", mu.device)
    p = torch.sigmoid(mu + math.sqrt(2) * sigma * x)  # [n, nodes]
    m_gh = (p @ w) / math.sqrt(math.pi)
    v_gh = ((p - m_gh.unsqueeze(-1)).pow(2) @ w) / math.sqrt(math.pi)

    t, wl = _nodes("laguerre", mu.device)
    big = sigma.clamp_min(_SWITCH_SIGMA)  # the Laguerre branch only counts where σ > 1.5
    st = torch.sigmoid(t)
    pos, neg = _normal_pdf(t, mu, big), _normal_pdf(-t, mu, big)
    step = torch.special.ndtr(mu / big).squeeze(-1)
    m_lag = step + (st * (neg - pos)) @ wl
    second = step + (st * (torch.exp(-t) * st * neg - (1 + st) * pos)) @ wl
    v_lag = second - m_lag.pow(2)

    use_gh = sigma.squeeze(-1) <= _SWITCH_SIGMA
    return torch.where(use_gh, m_gh, m_lag), torch.where(use_gh, v_gh, v_lag).clamp_min(0)


def beta_from_gaussian(mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Moment-matched ``Beta(a, b)`` per label, ``a, b [N, K]`` float64 (see module docs).

    ``s = m(1 − m)/v − 1`` is clamped to ``[BETA_MIN_PRECISION, BETA_MAX_PRECISION]``: the cap
    turns the point mass of ``σ² = 0`` into a very sharp but proper Beta.
    """
    m, mc, v = sigmoid_gaussian_moments(mean, var)
    s = (m * mc / v.clamp_min(torch.finfo(v.dtype).tiny) - 1).clamp(BETA_MIN_PRECISION, BETA_MAX_PRECISION)
    return m * s, mc * s


def beta_expected_entropy(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``E[H_b(π)]`` for ``π ~ Beta(α, β)``, elementwise:
    ``−m (ψ(α+1) − ψ(s+1)) − (1 − m)(ψ(β+1) − ψ(s+1))`` with ``s = α + β``, ``m = α/s``."""
    s = alpha + beta
    dig = torch.digamma(s + 1)
    return -(alpha / s) * (torch.digamma(alpha + 1) - dig) - (beta / s) * (torch.digamma(beta + 1) - dig)


def beta_mutual_information(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Mutual information ``H_b(α/(α+β)) − E[H_b(π)]`` of a ``Beta(α, β)`` label, elementwise.

    Written as ``m (ψ(α+1) − ψ(s+1) − ln m) + (1 − m)(ψ(β+1) − ψ(s+1) − ln(1 − m))`` so that the
    ``ln``-sized terms cancel inside each bracket rather than between two entropies.
    """
    s = alpha + beta
    m, mc = alpha / s, beta / s
    dig = torch.digamma(s + 1)
    mi = m * (torch.digamma(alpha + 1) - dig - m.log()) + mc * (torch.digamma(beta + 1) - dig - mc.log())
    return mi.clamp_min(0)  # ≥ 0 exactly (a KL divergence); rounding alone goes below


def beta_link(mean: torch.Tensor, var: torch.Tensor) -> SigmoidLinkOutput:
    """The moment-matched Beta per label: its mean, parameters, std, expected entropy and MI."""
    a, b = beta_from_gaussian(mean, var)
    s = a + b
    m = a / s
    std = (m * (b / s) / (s + 1)).sqrt()
    expected = beta_expected_entropy(a, b)
    mi = beta_mutual_information(a, b)
    dt = mean.dtype
    # the mean's, m = a / (a + b) = E[σ(f)] (moment matched), through the tilt where m underflows
    log_odds = log_mean_sigmoid(mean, var) - log_mean_sigmoid(-mean, var)
    return SigmoidLinkOutput(m.to(dt), a.to(dt), b.to(dt), std.to(dt), expected.to(dt), mi.to(dt), log_odds)


def mutual_information(out: SigmoidLinkOutput) -> torch.Tensor:
    """Per-label mutual information ``[N, K]`` of an ``mc`` or ``beta`` link output."""
    if out.alpha is not None:
        return beta_mutual_information(out.alpha.double(), out.beta.double()).to(out.probs.dtype)
    if out.expected_entropy is not None:
        return (binary_entropy(out.probs) - out.expected_entropy).clamp_min(0)
    raise BayescliError("mutual information needs the 'mc' or 'beta' link")


def apply_sigmoid_link(
    mean: torch.Tensor,
    var: torch.Tensor,
    link: SigmoidLink | str,
    samples: int = 1000,
    seed: int = 0,
) -> SigmoidLinkOutput:
    """Per-label probabilities (and, for ``mc``/``beta``, spread and mutual information) from
    ``mean [N, K]`` and ``var [N, K]`` of the logits; ``samples`` and ``seed`` are for ``mc``."""
    link = SigmoidLink(link)
    if link is SigmoidLink.NONE:
        _check(mean, var)
        return SigmoidLinkOutput(torch.sigmoid(mean), log_odds=mean.double())
    if link is SigmoidLink.PROBIT:
        return SigmoidLinkOutput(probit(mean, var), log_odds=probit_log_odds(mean, var))
    if link is SigmoidLink.MC:
        return monte_carlo(mean, var, samples, devices.generator(mean.device, seed))
    return beta_link(mean, var)
