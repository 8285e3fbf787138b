"""Links: logit Gaussian ``N(μ [N,K], Σ)`` → predictive probabilities ``[N, K]``.

* ``none``   — MAP: ``softmax(μ)``.
* ``probit`` — extended MacKay (seed 004 eq. 38): ``softmax(μ_k / √(1 + π Σ_kk / 8))``.
* ``sodpp``  — Wu et al.'s second-order delta (seed 004 eq. 39), the second-order Taylor
  expansion of ``E[softmax(z)]``: ``p ⊙ (1 + pᵀΣp − Σp + ½ diag Σ − ½ pᵀ diag Σ)`` with
  ``p = softmax(μ)``; it sums to one but can go negative, so it is clipped at 0 and renormalised.
* ``mc``     — mean of ``softmax`` over ``M`` draws (exact square roots for diagonal and
  eigen-form covariances, Cholesky with jitter for full ones), seeded.
* ``bridge`` — mean of the Laplace-bridge Dirichlet ``α/α₀``.

Every link also gives its own log-probabilities ``[N, K]`` in float64, exact where the
probabilities saturate (a wrong class at ``p < 1e-30``, or one that underflows to 0): the NLL,
temperature's objective and the OOD/selective scores are computed from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bayescli import devices
from bayescli.errors import BayescliError
from bayescli.options import DEFAULT_CORRECTION, BridgeCorrection, Link
from bayescli.posterior.gaussian import LogitGaussian, cholesky_jitter
from bayescli.predictive import dirichlet

# Chunk sizes (:func:`bayescli.devices.chunk_elements`): these on a CPU, a memory budget on CUDA.
MC_CHUNK_ELEMENTS = 1 << 18  # samples × inputs × classes per chunk: 1 MiB of float32 per buffer
BRIDGE_CHUNK_ELEMENTS = 1 << 18  # inputs × classes per chunk
# Live [inputs, K, M] buffers of one MC chunk, in the logits' dtype: the draws (softmaxed in
# place), their exponentials, and the two products of the reductions (probs·d, probs − mean).
MC_BUFFERS = 4
# Float64 [inputs, K, M] copies a Dirichlet fit to the samples adds: probs.double(), its clamp, its log.
MC_DIRICHLET_BYTES = 3 * 8
# Live float64 [inputs, K] arrays of one bridge chunk at its peak: μ, diag Σ, Σ1 and their corrected
# copies, then t, the clamped variances and, on a GPU, both forms of α (log bracket, its pieces,
# the direct form, the merged result); 16 bounds them.
BRIDGE_BYTES = 16 * 8


@dataclass
class LinkOutput:
    """``probs [N, K]``; ``alpha [N, K]`` for the bridge (or a Dirichlet fitted to MC samples);
    for MC, ``std [N, K]`` the spread of the samples' probabilities and ``expected_entropy [N]``
    the samples' mean entropy (so that mutual information = H[probs] − expected_entropy);
    ``log_probs [N, K]`` the link's own ``log probs`` in float64 (exact where ``probs`` saturate)."""

    probs: torch.Tensor
    alpha: torch.Tensor | None = None
    std: torch.Tensor | None = None
    expected_entropy: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None


def probit_logits(lg: LogitGaussian) -> torch.Tensor:
    """The probit link's scaled mean ``μ_k / √(1 + π Σ_kk / 8)`` ``[N, K]``."""
    return (lg.var * (math.pi / 8)).add_(1).rsqrt_().mul_(lg.mean)


def probit(lg: LogitGaussian) -> torch.Tensor:
    """Extended MacKay approximation of ``E[softmax(z)]``."""
    return probit_logits(lg).softmax(-1)


def sodpp(lg: LogitGaussian) -> torch.Tensor:
    """Second-order delta approximation of ``E[softmax(z)]`` (clipped, renormalised)."""
    return sodpp_output(lg).probs


def sodpp_output(lg: LogitGaussian) -> LinkOutput:
    """Second-order delta approximation of ``E[softmax(z)]`` (clipped, renormalised).

    ``log out = log_softmax(μ) + log bracket − log Σ out``, so a class at ``p < 1e-300`` keeps its
    exact log; a clipped class (bracket ≤ 0) counts as the smallest float64."""
    log_p = lg.mean.double().log_softmax(-1)
    p = log_p.exp()
    sp = lg.cov_matvec(p.to(lg.mean.dtype)).double()
    var = lg.var.double()
    bracket = 1 + (p * sp).sum(-1, keepdim=True) - sp + 0.5 * var - 0.5 * (p * var).sum(-1, keepdim=True)
    out = (p * bracket).clamp_min(0)
    total = out.sum(-1, keepdim=True)
    log_probs = log_p + bracket.clamp_min(torch.finfo(torch.float64).tiny).log() - total.log()
    return LinkOutput((out / total).to(lg.mean.dtype), log_probs=log_probs)


def _draws(lg: LogitGaussian, eps: torch.Tensor, sl: slice) -> torch.Tensor:
    """Logit draws ``[n, K, M]`` for rows ``sl`` from standard normals ``eps [n, K, M]``."""
    mean = lg.mean[sl].unsqueeze(-1)
    if lg.cov is not None:
        return torch.baddbmm(mean, cholesky_jitter(lg.cov[sl]), eps)
    if lg.basis is not None:
        scaled = eps.mul_(lg.spectrum[sl].clamp_min(0).sqrt().unsqueeze(-1))
        return torch.matmul(lg.basis, scaled).add_(mean)
    return eps.mul_(lg.var[sl].clamp_min(0).sqrt().unsqueeze(-1)).add_(mean)


def monte_carlo(
    lg: LogitGaussian, samples: int, generator: torch.Generator, fit_dirichlet: bool = False
) -> LinkOutput:
    """MC estimate of ``E[softmax(z)]`` with ``samples`` independent draws per input.

    Draws are laid out ``[inputs, K, M]`` and processed in chunks: reductions over classes then
    run along a strided axis with the samples contiguous (PyTorch's softmax over a last axis of 10
    classes is ~25× slower per element), and the softmax and its entropy share one exponential (no
    log of probabilities). On a CPU a chunk holds ``MC_CHUNK_ELEMENTS`` draws, so that its buffers
    stay in cache; on CUDA the device's budget over ``MC_BUFFERS`` buffers in the logits' dtype
    (plus ``MC_DIRICHLET_BYTES`` with ``fit_dirichlet``) per draw.
    """
    n, k = lg.mean.shape
    per_draw = MC_BUFFERS * lg.mean.element_size() + (MC_DIRICHLET_BYTES if fit_dirichlet else 0)
    chunk = devices.chunk_rows(lg.mean.device, samples * k, MC_CHUNK_ELEMENTS, per_draw)
    means, stds, alphas, ents, logs = [], [], [], [], []
    eps = torch.empty(min(chunk, n), k, samples, dtype=lg.mean.dtype, device=lg.mean.device)
    for start in range(0, n, chunk):
        sl = slice(start, start + chunk)
        rows = len(lg.mean[sl])
        z = _draws(lg, eps[:rows].normal_(generator=generator), sl)  # [n, K, M]
        d = z.sub_(z.amax(1, keepdim=True))  # ≤ 0
        e = torch.exp(d)
        total = e.sum(1, keepdim=True)
        probs = e.div_(total)  # [n, K, M]
        log_total = total.log_()
        # H = log Σe − Σ_k p_k d_k: a sum of non-negative terms, so no cancellation when H is tiny
        ents.append((log_total.squeeze(1) - (probs * d).sum(1)).mean(-1))
        mean = probs.mean(-1)
        # two-pass spread; torch.std_mean over the last axis is ~10× slower here
        spread = torch.linalg.vector_norm(probs - mean.unsqueeze(-1), dim=-1)
        means.append(mean)
        stds.append(spread / math.sqrt(samples - 1) if samples > 1 else spread)
        logs.append(_mc_log_mean(mean, d, log_total, samples))  # d is spent here
        if fit_dirichlet:
            alphas.append(dirichlet.dirichlet_from_samples(probs.permute(2, 0, 1)))
    alpha = torch.cat(alphas) if fit_dirichlet else None
    return LinkOutput(torch.cat(means), alpha, torch.cat(stds), torch.cat(ents), torch.cat(logs))


# Below this mean probability the log of the float32 mean loses digits (subnormals from 1.2e-38)
# or is log 0: those classes take the exact logsumexp of the draws' log-softmax instead.
MC_LOG_EXACT_BELOW = 1e-30


def _mc_log_mean(mean: torch.Tensor, d: torch.Tensor, log_total: torch.Tensor, samples: int) -> torch.Tensor:
    """``log (1/M) Σ_m softmax(z_m)`` ``[n, K]`` in float64 from the chunk's mean ``[n, K]``,
    shifted draws ``d [n, K, M]`` (overwritten) and ``log_total [n, 1, M]`` (``log_softmax = d − log_total``).

    The log of the mean is exact to float32 rounding where the mean is normal; where it is tiny
    (a confident input's wrong classes) the logsumexp over the samples is taken, which stays exact
    at any margin. On a CPU it runs only for chunks that have such a class; on a GPU always (a
    host read per chunk would stall the queue)."""
    log_mean = mean.double().log()
    tiny = mean < MC_LOG_EXACT_BELOW
    if mean.device.type == "cpu" and not bool(tiny.any()):
        return log_mean
    # in place and in the draws' dtype: no buffer beyond those the chunk size counts
    exact = torch.logsumexp(d.sub_(log_total), -1).double() - math.log(samples)
    return torch.where(tiny, exact, log_mean)


def bridge(lg: LogitGaussian, correction: BridgeCorrection | str = DEFAULT_CORRECTION) -> torch.Tensor:
    """Laplace-bridge ``α [N, K]`` from a logit Gaussian, ``O(NK)`` for diagonal and eigen forms.

    The zero-sum correction needs only ``diag Σ`` and ``Σ1``, which every form provides
    without building ``Σ``. A logit Gaussian that is the bridge image of a native Dirichlet
    (``lg.alpha``) maps back to that Dirichlet exactly, whatever the correction. Rows are processed
    in chunks: of ``BRIDGE_CHUNK_ELEMENTS`` numbers on a CPU, where they keep the float64
    elementwise passes in cache (2× faster at K = 1000); of the device's budget over
    ``BRIDGE_BYTES`` per number on CUDA (10,000 × 1,000 inputs in one chunk on a large GPU).
    """
    return _bridge(lg, correction)[0]


def bridge_output(lg: LogitGaussian, correction: BridgeCorrection | str = DEFAULT_CORRECTION) -> LinkOutput:
    """The bridge link: ``α`` (:func:`bridge`), its mean ``α/α₀`` and ``log α − log α₀`` from ``log α``
    taken in log space where ``α`` overflows, so that ``α = ∞`` gives neither NaN nor ``log 0``."""
    alpha, log_alpha = _bridge(lg, correction, with_log=True)
    log_probs = log_alpha - log_alpha.logsumexp(-1, keepdim=True)
    return LinkOutput(log_probs.exp().to(lg.mean.dtype), alpha, log_probs=log_probs)


def _bridge(
    lg: LogitGaussian, correction: BridgeCorrection | str, with_log: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(α [N, K], log α [N, K] or None)`` chunk by chunk (:func:`bridge`)."""
    if lg.alpha is not None:
        return lg.alpha, lg.alpha.double().log() if with_log else None
    rowsum = lg.rowsum()
    rows = devices.chunk_rows(lg.mean.device, lg.num_classes, BRIDGE_CHUNK_ELEMENTS, BRIDGE_BYTES)
    parts, logs = [], []
    for start in range(0, len(lg), rows):
        sl = slice(start, start + rows)
        mu, var = dirichlet.correct(lg.mean[sl], lg.var[sl], rowsum[sl], correction)
        parts.append(dirichlet.bridge_alpha(mu, var))
        if with_log:
            logs.append(dirichlet.bridge_log_alpha(mu, var, parts[-1]))
    if len(parts) == 1:
        return parts[0], logs[0] if with_log else None
    return torch.cat(parts), torch.cat(logs) if with_log else None


def apply_link(
    lg: LogitGaussian,
    link: Link | str,
    samples: int = 1000,
    generator: torch.Generator | None = None,
    correction: BridgeCorrection | str = DEFAULT_CORRECTION,
    fit_dirichlet: bool = False,
) -> LinkOutput:
    """Probabilities (and, where the link gives one, a Dirichlet) for each input."""
    link = Link(link)
    if link is Link.NONE:
        return LinkOutput(lg.mean.softmax(-1), log_probs=lg.mean.double().log_softmax(-1))
    if link is Link.PROBIT:
        scaled = probit_logits(lg)
        return LinkOutput(scaled.softmax(-1), log_probs=scaled.double().log_softmax(-1))
    if link is Link.SODPP:
        return sodpp_output(lg)
    if link is Link.MC:
        gen = generator if generator is not None else devices.generator(lg.mean.device, 0)
        return monte_carlo(lg, samples, gen, fit_dirichlet)
    if link is Link.BETA:
        raise BayescliError(
            "link 'beta' (a Beta per label) is for multi-label posteriors; a softmax posterior's "
            "Dirichlet link is 'bridge'"
        )
    return bridge_output(lg, correction)
