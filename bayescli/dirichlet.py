"""The Laplace bridge and Dirichlet utilities (seed ``laplace-bridge-fast-predictive-uncertainty``)
and Minka's Dirichlet fit to simplex samples (seed ``function-space-vi-dirichlet-prior``).

Pure maths on floor 1, so that posteriors (Dirichlet fVI) and predictives both use it;
:mod:`bayescli.predictive.dirichlet` re-exports it. Shapes: ``mean [N, K]``, ``var [N, K]`` or
``cov [N, K, K]``, ``alpha [N, K]``; all maths in float64. ``α₀ = Σ_k α_k`` is the Dirichlet precision.
"""

from __future__ import annotations

import math

import torch

from bayescli.errors import BayescliError
from bayescli.options import DEFAULT_CORRECTION, BridgeCorrection


def _as_var(cov_or_var: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(diag Σ [N,K], Σ1 [N,K])`` from a covariance ``[N,K,K]`` or variances ``[N,K]``."""
    c = cov_or_var.double()
    if c.dim() == 3 and c.shape[-2:] == (k, k):
        return c.diagonal(dim1=1, dim2=2), c.sum(-1)
    if c.dim() == 2 and c.shape[-1] == k:
        return c, c
    raise BayescliError(f"expected covariances [N,{k},{k}] or variances [N,{k}], got {list(c.shape)}")


# tr Σ (squared logits) at or below which a logit Gaussian is a point mass for the bridge.
POINT_MASS_TRACE = 1e-8


def correct(
    mean: torch.Tensor, var: torch.Tensor, rowsum: torch.Tensor, correction: BridgeCorrection | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply ``correction`` given ``μ``, ``diag Σ`` and ``Σ1`` (all ``[N,K]``); returns ``(μ, diag Σ)``."""
    correction = BridgeCorrection(correction)
    mu, var = mean.double(), var.double()
    if correction is BridgeCorrection.NONE:
        return mu, var
    rowsum = rowsum.double()
    total = rowsum.sum(-1, keepdim=True)  # 1ᵀΣ1
    # A Σ with 1ᵀΣ1 ≈ 0 (e.g. eq. 6's) already lives on the zero-sum subspace: nothing to do. Nor
    # for a (numerically) zero Σ — a point mass, tr Σ ≤ POINT_MASS_TRACE in squared logits: its rounding
    # noise would otherwise shift μ by (Σ1)(1ᵀμ)/(1ᵀΣ1), a ratio of two noises.
    var_sum = var.sum(-1, keepdim=True)
    degenerate = (total <= 1e-12 * var_sum) | (var_sum <= POINT_MASS_TRACE)
    total = total.masked_fill(degenerate, math.inf)  # unconditionally: no host read per chunk
    mu = torch.addcmul(mu, rowsum, mu.sum(-1, keepdim=True) / total, value=-1)
    var = torch.addcmul(var, rowsum, rowsum / total, value=-1)
    if correction is BridgeCorrection.NORM:
        c = var.mean(-1, keepdim=True) / math.sqrt(mu.shape[-1] / 2)
        mu, var = mu / c.sqrt(), var / c
    return mu, var


def _bridge_terms(mu: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor]:
    """``t = μ_k + logsumexp(−μ) − 2 log K`` (so that eq. 7's bracket is ``e^t + const``), ``const =
    1 − 2/K`` and the variances the bridge divides by (point masses' rows made isotropic, floored)."""
    k = mu.shape[-1]
    if k < 2:
        raise BayescliError("the Laplace bridge needs at least 2 classes")
    t = mu + (torch.logsumexp(-mu, dim=-1, keepdim=True) - 2 * math.log(k))
    # A point mass (zero logit variance: temperature scaling, a MAP fallback) has no bridge: α → ∞.
    # The floor keeps α₀ ≤ ~1e300 and its mean finite, so a report shows the degenerate Dirichlet
    # (with its near-zero-variance note) instead of NaN; real variances are far above it.
    # A point mass's Σ is rounding noise (exact zeros beside 1e-13s): α = bracket/var would make its
    # mean one-hot on the zeros. Its rows get the isotropic limit instead: one variance per row.
    point = var.sum(-1, keepdim=True) <= POINT_MASS_TRACE
    var = torch.where(point, var.amax(-1, keepdim=True), var).clamp_min(1e-30)
    return t, 1 - 2 / k, var


def _log_bracket(t: torch.Tensor, const: float) -> torch.Tensor:
    return t if const == 0 else torch.logaddexp(t, torch.full_like(t, math.log(const)))


def bridge_alpha(mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Eq. 7, ``α_k = (1/Σ_kk)(1 − 2/K + e^{μ_k}/K² Σ_l e^{−μ_l})``, evaluated in log space.

    ``e^{μ_k} Σ_l e^{−μ_l} = exp(μ_k + logsumexp(−μ))``, so ``|μ|`` in the hundreds neither
    overflows nor underflows; ``α`` itself overflows only beyond float64's range (then
    :func:`bridge_log_alpha` still holds it).
    """
    t, const, var = _bridge_terms(mu, var)
    # Where e^t is finite (t < 700) the direct form is exact and cheapest. On the CPU one look at
    # max t picks the form for the whole block; on a GPU that look would stall the queue, so
    # both forms are evaluated and merged elementwise (a few more passes over [N, K]).
    on_host = t.device.type == "cpu"
    if on_host and float(t.max()) < 700:
        return t.exp_().add_(const).div_(var)
    log_form = torch.exp(_log_bracket(t, const) - var.log())
    if on_host:
        return log_form
    return torch.where(t < 700, t.clamp(max=700).exp().add_(const).div_(var), log_form)


def bridge_log_alpha(mu: torch.Tensor, var: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``log α [N, K]`` of :func:`bridge_alpha`'s ``alpha`` for the same ``μ, diag Σ``, finite
    where ``α`` overflowed to ``inf`` (or underflowed to 0, ``K = 2``): those entries are taken
    in log space, ``log(e^t + const) − log Σ_kk``. On a CPU the log form runs only for a block that
    needs it; on a GPU always (no host read)."""
    log_alpha = alpha.log()
    bad = ~torch.isfinite(log_alpha)
    if alpha.device.type == "cpu" and not bool(bad.any()):
        return log_alpha
    t, const, var = _bridge_terms(mu, var)
    return torch.where(bad, _log_bracket(t, const) - var.log(), log_alpha)


def laplace_bridge(
    mean: torch.Tensor, cov_or_var: torch.Tensor, correction: BridgeCorrection | str = DEFAULT_CORRECTION
) -> torch.Tensor:
    """Dirichlet ``α [N, K]`` approximating softmax(z), ``z ~ N(mean, Σ)`` (eq. 7 + ``correction``).

    ``cov_or_var`` is ``Σ [N, K, K]`` or its diagonal ``[N, K]`` (then ``Σ1 = diag Σ``).
    """
    mean = mean.double()
    var, rowsum = _as_var(cov_or_var, mean.shape[-1])
    mu, var = correct(mean, var, rowsum, correction)
    return bridge_alpha(mu, var)


def dirichlet_to_gaussian(alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward map, eqs. 5–6: ``α [N,K]`` → ``(μ [N,K], Σ [N,K,K])`` in the softmax basis."""
    a = alpha.double()
    k = a.shape[-1]
    mu = a.log() - a.log().mean(-1, keepdim=True)
    inv = 1.0 / a
    cov = torch.diag_embed(inv) - (inv[:, :, None] + inv[:, None, :] - inv.sum(-1)[:, None, None] / k) / k
    return mu, cov


def dirichlet_to_gaussian_diag(alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. 5–6 without building ``Σ``: ``(μ [N,K], diag Σ [N,K])``, for large ``K``.

    ``Σ_kk = 1/α_k − (1/K)(2/α_k − (1/K) Σ_u 1/α_u) = (1 − 2/K)/α_k + Σ_u (1/α_u) / K²``.
    """
    a = alpha.double()
    k = a.shape[-1]
    log_a = a.log()
    inv = 1.0 / a
    return log_a - log_a.mean(-1, keepdim=True), inv * (1 - 2 / k) + inv.sum(-1, keepdim=True) / k**2


# -- Dirichlet utilities ----------------------------------------------------------------------


def precision(alpha: torch.Tensor) -> torch.Tensor:
    """``α₀ [N]``."""
    return alpha.sum(-1)


def mean(alpha: torch.Tensor) -> torch.Tensor:
    """``E[π] = α/α₀`` ``[N, K]`` (eq. 11); a row with infinite ``α_k`` (a bridge that overflowed
    float64: a point mass) has its mean shared equally by its infinite entries, never NaN."""
    a0 = alpha.sum(-1, keepdim=True)
    out = alpha / a0
    if alpha.device.type == "cpu" and bool(torch.isfinite(a0).all()):
        return out
    inf = torch.isinf(alpha).to(alpha.dtype)
    return torch.where(torch.isinf(a0), inf / inf.sum(-1, keepdim=True).clamp_min(1), out)


def variance(alpha: torch.Tensor) -> torch.Tensor:
    """``Var[π_k] = α_k(α₀ − α_k) / (α₀²(α₀ + 1))`` ``[N, K]``."""
    a0 = alpha.sum(-1, keepdim=True)
    return alpha * (a0 - alpha) / (a0.pow(2) * (a0 + 1))


def beta_marginals(alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``π_k ~ Beta(α_k, α₀ − α_k)``: returns the two ``[N, K]`` parameter arrays."""
    return alpha, alpha.sum(-1, keepdim=True) - alpha


def aggregate(alpha: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
    """Dirichlet of grouped probabilities (eq. 12): ``Σ_{k∈g} π_k ~`` component ``Σ_{k∈g} α_k``.

    ``groups`` must partition the classes; returns ``[N, len(groups)]``.
    """
    flat = sorted(i for g in groups for i in g)
    if flat != list(range(alpha.shape[-1])):
        raise BayescliError("groups must partition the classes 0..K-1 exactly once")
    return torch.stack([alpha[:, g].sum(-1) for g in groups], dim=-1)


def entropy_of_mean(alpha: torch.Tensor) -> torch.Tensor:
    """``H[E[π]]`` ``[N]`` (total predictive uncertainty, nats)."""
    p = mean(alpha).double()
    return -(p * p.clamp_min(1e-300).log()).sum(-1)


def expected_entropy(alpha: torch.Tensor) -> torch.Tensor:
    """``E_{π~Dir(α)}[H[π]] = ψ(α₀+1) − Σ_k (α_k/α₀) ψ(α_k+1)`` ``[N]`` (aleatoric part)."""
    a = alpha.double()
    a0 = a.sum(-1)
    return torch.digamma(a0 + 1) - (a / a0[:, None] * torch.digamma(a + 1)).sum(-1)


def mutual_information(alpha: torch.Tensor) -> torch.Tensor:
    """``H[E[π]] − E[H[π]]`` ``[N]`` (epistemic part, ≥ 0)."""
    return (entropy_of_mean(alpha) - expected_entropy(alpha)).clamp_min(0)


def dirichlet_entropy(alpha: torch.Tensor) -> torch.Tensor:
    """Differential entropy of ``Dir(α)`` ``[N]``."""
    a = alpha.double()
    a0 = a.sum(-1)
    k = a.shape[-1]
    log_b = torch.lgamma(a).sum(-1) - torch.lgamma(a0)
    return log_b + (a0 - k) * torch.digamma(a0) - ((a - 1) * torch.digamma(a)).sum(-1)


def log_density(alpha: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``log Dir(π | α)`` for ``probs [N, K]`` (or ``[M, N, K]``) on the simplex."""
    a = alpha.double()
    log_norm = torch.lgamma(a.sum(-1)) - torch.lgamma(a).sum(-1)
    return log_norm + ((a - 1) * probs.double().clamp_min(1e-300).log()).sum(-1)


def fit_precision(
    a_bar: torch.Tensor,
    a_log: torch.Tensor,
    num_samples: int,
    min_precision: float,
    max_precision: float,
    max_iter: int = 100,
    tol: float = 1e-5,
) -> tuple[torch.Tensor, int]:
    """Minka's fixed-mean precision ``z [N]`` from ``ᾱ [N, K]`` (mean) and ``ᾰ [N, K]`` (mean log).

    Seed ``function-space-vi-dirichlet-prior`` App. F, eqs. 29–32: ``1/z ← 1/z + Δ₁/(z² Δ₂)`` with
    ``Δ₁ = M(ψ(z) − Σ ᾱ_k ψ(zᾱ_k) + Σ ᾱ_k ᾰ_k)``, ``Δ₂ = M(ψ₁(z) − Σ ᾱ_k² ψ₁(zᾱ_k))`` (``M``
    cancels), started from Stirling's ``z⁰ = (K−1) / (−2 Σ ᾱ_k (ᾰ_k − log ᾱ_k))`` (eq. 32 prints
    ``log ᾰ_k``; ``ᾰ_k`` is already a mean log). ``z`` is clamped to ``[min_precision,
    max_precision]``; a step that would make ``1/z ≤ 0`` (the samples barely vary) goes to the
    upper bound, as does ``M = 1`` (no spread to measure; the seed sets ``z = z_max``). Rows stop
    once ``|Δz| ≤ tol·z`` (relative, so one tolerance serves ``z`` from ``K`` to ``N``) and are
    masked out of later iterations, so a slow row does not make every row pay. Returns ``z`` and
    the iterations the slowest row took (≤ ``max_iter``).
    """
    a_bar, a_log = a_bar.double(), a_log.double()
    n = a_bar.shape[0]
    lo, hi = float(min_precision), float(max_precision)
    if num_samples == 1:
        return torch.full((n,), hi, dtype=torch.float64, device=a_bar.device), 0
    z = stirling_precision(a_bar, a_log, a_bar.clamp_min(1e-300).log(), lo, hi)
    return minka_iterate(z, a_bar, (a_bar * a_log).sum(-1), lo, hi, tol, max_iter)


def stirling_precision(
    a_bar: torch.Tensor, a_log: torch.Tensor, log_a_bar: torch.Tensor, lo: float, hi: float
) -> torch.Tensor:
    """Stirling's start ``z⁰ = (K−1) / (−2 Σ ᾱ_k (ᾰ_k − log ᾱ_k))`` ``[N]`` (eq. 32), clamped to
    ``[lo, hi]``; rows whose samples barely vary (denominator ≤ 0) start at ``hi``."""
    k = a_bar.shape[-1]
    denom = -2 * (a_bar * (a_log - log_a_bar)).sum(-1)
    return torch.where(denom > 0, (k - 1) / denom.clamp_min(1e-300), torch.full_like(denom, hi)).clamp(lo, hi)


def minka_step(z: torch.Tensor, d1: torch.Tensor, d2: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """``1/z ← 1/z + Δ₁/(z² Δ₂)`` (Newton on ``1/z``, eqs. 29–31) clamped to ``[lo, hi]``; a step
    that would make ``1/z ≤ 0`` goes to ``hi``."""
    inv = 1 / z + d1 / (z.square() * d2)
    return torch.where(inv > 0, 1 / inv.clamp_min(1e-300), torch.full_like(z, hi)).clamp(lo, hi)


def minka_iterate(
    z: torch.Tensor,
    a_bar: torch.Tensor,
    cross: torch.Tensor,
    lo: float,
    hi: float,
    tol: float,
    max_iter: int,
    trigamma_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, int]:
    """Exact Minka steps from ``z [N]`` (float64) for ``ᾱ [N, K]`` and ``cross = Σ ᾱ_k ᾰ_k [N]``.

    ``ψ`` is evaluated in float64; ``ψ₁``, which sets only the step length and not the root, in
    ``trigamma_dtype``. Rows stop once ``|Δz| ≤ tol·z`` and are masked out of later iterations.
    Returns ``z`` and the iterations of the slowest row.

    On a CPU the rows still moving are gathered each iteration (reading their count back is
    free there); on a GPU that read would stall the queue once per iteration, so there every row
    takes every step with the converged ones frozen (:func:`_minka_iterate_masked`).
    """
    if z.device.type != "cpu":
        return _minka_iterate_masked(z, a_bar, cross, lo, hi, tol, max_iter, trigamma_dtype)
    n = z.shape[0]
    ab_sq_all = a_bar.to(trigamma_dtype).square()
    active = torch.arange(n, device=a_bar.device)
    iterations = 0
    while active.numel() and iterations < max_iter:
        every = active.numel() == n  # no gather/scatter while every row still moves
        rows = slice(None) if every else active
        za, ab, ab_sq, cr = z[rows], a_bar[rows], ab_sq_all[rows], cross[rows]
        zab = za[:, None] * ab
        d1 = torch.digamma(za) - (ab * torch.digamma(zab)).sum(-1) + cr
        psi1 = torch.polygamma(1, zab.to(trigamma_dtype))
        d2 = torch.polygamma(1, za) - (ab_sq * psi1).sum(-1, dtype=torch.float64)
        z_new = minka_step(za, d1, d2, lo, hi)
        moving = (z_new - za).abs() > tol * za
        if every:
            z = z_new
        else:
            z[active] = z_new
        active = active[moving]
        iterations += 1
    return z, iterations


# Steps between two reads of "is any row still moving?" in the masked fixed point: a GPU runs
# this many steps (cheap, queued) per host read; the exact loop typically ends within a few.
MINKA_STEPS_PER_READ = 8


def _minka_iterate_masked(
    z: torch.Tensor,
    a_bar: torch.Tensor,
    cross: torch.Tensor,
    lo: float,
    hi: float,
    tol: float,
    max_iter: int,
    trigamma_dtype: torch.dtype,
    active: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """:func:`minka_iterate`'s steps for every row at once, on any device: a row's ``z`` stops
    changing (``torch.where``) once its step moved it by ``≤ tol·z``, exactly where the gathered
    loop drops it, so each row takes the same steps. ``active [N]`` (bool) marks the rows that
    still move at the start (all if ``None``). Host reads: one before each ``MINKA_STEPS_PER_READ``
    steps, one more for the slowest row's count if any step was taken."""
    z = z.clone()
    ab_sq = a_bar.to(trigamma_dtype).square()
    active = torch.ones_like(z, dtype=torch.bool) if active is None else active.clone()
    steps = torch.zeros_like(z, dtype=torch.int32)
    iterations = 0
    while iterations < max_iter and bool(active.any()):
        for _ in range(min(MINKA_STEPS_PER_READ, max_iter - iterations)):
            zab = z[:, None] * a_bar
            d1 = torch.digamma(z) - (a_bar * torch.digamma(zab)).sum(-1) + cross
            psi1 = torch.polygamma(1, zab.to(trigamma_dtype))
            d2 = torch.polygamma(1, z) - (ab_sq * psi1).sum(-1, dtype=torch.float64)
            z_new = minka_step(z, d1, d2, lo, hi)
            steps += active
            moving = active & ((z_new - z).abs() > tol * z)
            z = torch.where(active, z_new, z)
            active = moving
            iterations += 1
    return z, int(steps.max()) if iterations else 0


# ψ(y) − ln y + 1/(2y) = −Σ_j c_j y^(−2j) with c_j = B_2j/(2j), and ψ₁(y) − 1/y − 1/(2y²) = Σ_j B_2j y^(−2j−1)
_PSI_SERIES = (1 / 12, -1 / 120, 1 / 252, -1 / 240, 1 / 132, -691 / 32760)
_TRIGAMMA_SERIES = (1 / 6, -1 / 30, 1 / 42, -1 / 30)
# (shift, ψ terms, ψ₁ terms, dtype) of fit_precision_vectorised's Newton steps after Stirling's start, with
# digamma_gaps' worst relative errors over x in [1e−6, 1e6] (mpmath): a rough float32 step (g, h 1.5e−3:
# z from ≈ 30 % to ≈ 1e−2), an accurate float32 one (g 1.1e−5, h 2.2e−4: z to float32's ≈ 1e−5) and a
# float64 one (g 4e−11; h 3e−5 sets only the step length: z to ≈ 2e−10); the fewest passes measured to
# do so (a rougher float32 pair leaves rows to the exact loop).
_VECTORISED_STEPS = ((1, 1, 1, torch.float32), (2, 2, 1, torch.float32), (4, 6, 1, torch.float64))


def _series(ry2: torch.Tensor, coefficients: tuple[float, ...], out: torch.Tensor) -> torch.Tensor:
    """``Σ_j c_j ry2^j`` (``j ≥ 1``) by Horner's rule, into ``out`` (``ry2``'s shape): one pass a
    term (``c + s·ry2`` as one ``addcmul`` with ``c`` as a 0-dim tensor)."""
    if len(coefficients) == 1:
        return torch.mul(ry2, coefficients[0], out=out)

    def scalar(c: float) -> torch.Tensor:
        return torch.full((), c, dtype=ry2.dtype, device=ry2.device)

    torch.add(scalar(coefficients[-2]), ry2, alpha=coefficients[-1], out=out)
    for c in reversed(coefficients[:-2]):
        torch.addcmul(scalar(c), out, ry2, out=out)
    return out.mul_(ry2)


def digamma_gaps(
    x: torch.Tensor,
    shift: int,
    psi_terms: int,
    trigamma_terms: int,
    work: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = ψ(x) − ln x`` and ``h = ψ₁(x) − 1/x`` for ``x > 0`` (any shape, ``x``'s dtype).

    ``torch.digamma``/``polygamma`` are scalar loops (a float64 digamma over ``[N, K]`` costs ~50
    vectorised passes); this is ~30 in-place vectorised passes with one ``log1p``: the recurrences
    ``ψ(x) = ψ(x + n) − Σ_{i<n} 1/(x + i)`` (the same for ``ψ₁`` with squares) to ``y = x + shift``,
    then ``psi_terms``/``trigamma_terms`` terms of the asymptotic series at ``y``. Minka wants the gaps,
    not ``ψ``, ``ψ₁``: summed over ``ᾱ`` they carry no ``ln z``/``1/z`` that cancels (module's
    :func:`fit_precision_vectorised`); ``ln(y/x) = log1p(shift/x)`` keeps ``g ≈ −1/(2x)`` accurate
    to relative rounding at large ``x``, and ``ψ₁(y) − 1/x = −shift/(xy) + …`` is formed without
    the cancellation of ``1/y − 1/x``. ``work``: five scratch tensors of ``x``'s shape and dtype
    (overwritten; ``g`` and ``h`` are the last two), so that repeated calls allocate nothing — a
    fresh temporary costs ~3 in-place passes (page faults and cold cache lines).
    """
    r, ry, ry2, g, h = work if work is not None else [torch.empty_like(x) for _ in range(5)]
    torch.reciprocal(x, out=r)
    torch.add(x, shift, out=ry).reciprocal_()
    torch.mul(ry, ry, out=ry2)
    # g = ln(y/x) + (ψ(y) − ln y) − Σ_{i<shift} 1/(x+i);  h = (ψ₁(y) − 1/x) + Σ_{i<shift} 1/(x+i)²
    _series(ry2, _PSI_SERIES[:psi_terms], g).add_(ry, alpha=0.5).add_(r)
    torch.sub(torch.mul(r, shift, out=h).log1p_(), g, out=g)
    _series(ry2, _TRIGAMMA_SERIES[:trigamma_terms], h).mul_(ry).add_(ry2, alpha=0.5)
    h.addcmul_(r, ry, value=-shift).addcmul_(r, r)
    for i in range(1, shift):
        torch.add(x, i, out=r).reciprocal_()
        g.sub_(r)
        h.addcmul_(r, r)
    return g, h


def fit_precision_vectorised(
    a_bar: torch.Tensor,
    log_a_bar: torch.Tensor,
    a_log: torch.Tensor,
    num_samples: int,
    min_precision: float,
    max_precision: float,
    max_iter: int = 100,
    tol: float = 5e-4,
    workspace: dict[torch.dtype, list[torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, int]:
    """:func:`fit_precision`'s root ``z [N]`` for ``ᾱ``, ``ln ᾱ`` and ``ᾰ`` (``[N, K]``, float64) with
    vectorised special functions (:func:`digamma_gaps`) instead of ``torch.digamma``/``polygamma``.

    With ``Σ ᾱ_k = 1`` Minka's ``Δ₁ = g(z) − Σ ᾱ_k g(zᾱ_k) + Σ ᾱ_k (ᾰ_k − ln ᾱ_k)`` and
    ``Δ₂ = h(z) − Σ ᾱ_k² h(zᾱ_k)`` (``g = ψ − ln``, ``h = ψ₁ − 1/x``): the same Newton step on ``1/z``
    from the same Stirling start, but the ``ln z`` and ``1/z`` that cancel in ``ψ``'s form are never
    formed, so a float32 step lands within float32's ``≈ 1e−5`` of the root. The steps
    (``_VECTORISED_STEPS``): a rough and an accurate float32 one, then one in float64 (``g`` to
    ``1e−10``); rows whose float64 step still moved ``z`` by more than ``tol`` (relative; Newton's
    next step would then be ``≈ 0.05·tol²``) go on with :func:`minka_iterate`'s exact steps.
    ``num_samples = 1`` gives the upper bound (as :func:`fit_precision`). ``workspace``: a dict the
    caller keeps across calls on row blocks (scratch tensors, reused while ``N`` fits and ``K`` is
    the same, so that the blocks allocate nothing); ``None`` allocates per call. Returns ``z``
    (float64) and the exact iterations the slowest row needed after the vectorised steps (0 typically).
    """
    n, k = a_bar.shape
    lo, hi = float(min_precision), float(max_precision)
    if num_samples == 1:
        return torch.full((n,), hi, dtype=torch.float64, device=a_bar.device), 0
    if workspace is None:
        workspace = {}
    views = {}
    for dtype in dict.fromkeys(step[-1] for step in _VECTORISED_STEPS):
        buffers = workspace.get(dtype)
        if buffers is None or buffers[0].shape[0] < n or buffers[0].shape[1] != k + 1:
            # ᾱ, ᾱ², x = zᾱ and digamma_gaps' five
            buffers = workspace[dtype] = [a_bar.new_empty(n, k + 1, dtype=dtype) for _ in range(8)]
        ab, ab_sq, *_ = views[dtype] = [t[:n] for t in buffers]
        # z itself rides along as a last column (ᾱ = 1) so that each step is one pass of
        # elementwise ops (at ~2 µs a dispatch, a pass over [N] costs as much as the [N, K] work)
        ab[:, :k] = a_bar
        ab[:, k] = 1
        torch.mul(ab, ab, out=ab_sq)
    # Σ ᾱ_k (ᾰ_k − ln ᾱ_k) ≤ 0 (Jensen), summed as one difference: no cancellation of two sums
    scratch = views[torch.float64][2][:, :k]  # x's buffer, free until the float64 step
    spread = torch.sub(a_log, log_a_bar, out=scratch).mul_(a_bar).sum(-1)
    # Stirling's start, as stirling_precision, from the same sum
    denom = -2 * spread
    z = torch.where(denom > 0, (k - 1) / denom.clamp_min(1e-300), torch.full_like(denom, hi)).clamp(lo, hi)
    for shift, psi_terms, trigamma_terms, dtype in _VECTORISED_STEPS:
        ab, ab_sq, x, *work = views[dtype]
        torch.mul(ab, z.to(dtype)[:, None], out=x)
        g, h = digamma_gaps(x, shift, psi_terms, trigamma_terms, work)
        # Δ₁ = g(z) − Σ ᾱ_k g(zᾱ_k) + spread, Δ₂ = h(z) − Σ ᾱ_k² h(zᾱ_k)
        g.mul_(ab)
        h.mul_(ab_sq)
        d1 = (2 * g[:, k] - g.sum(-1)).double() + spread
        d2 = (2 * h[:, k] - h.sum(-1)).double()
        z_prev, z = z, minka_step(z, d1, d2, lo, hi)
    moving = (z - z_prev).abs() > tol * z_prev
    if z.device.type != "cpu":
        # no gather of the stragglers (its size is a host read): every row, the others frozen
        cross = (a_bar * a_log).sum(-1)
        return _minka_iterate_masked(z, a_bar, cross, lo, hi, tol, max_iter, torch.float64, moving)
    moving = moving.nonzero().squeeze(1)
    if not moving.numel():
        return z, 0
    a_moving = a_bar[moving]
    cross = (a_moving * a_log[moving]).sum(-1)
    z[moving], iterations = minka_iterate(z[moving], a_moving, cross, lo, hi, tol, max_iter)
    return z, iterations


def smoothed(probs: torch.Tensor, smoothing: float) -> torch.Tensor:
    """``f̃ = (1 − γ) f + γ/K`` (the seed's label smoothing inside the KL, App. F), any ``[..., K]``."""
    return probs if smoothing == 0 else probs * (1 - smoothing) + smoothing / probs.shape[-1]


def dirichlet_from_samples(
    probs: torch.Tensor,
    max_iter: int = 100,
    tol: float = 1e-5,
    max_precision: float | None = None,
    min_precision: float | None = None,
    smoothing: float = 0.0,
) -> torch.Tensor:
    """Fit ``α [N, K]`` to simplex samples ``probs [M, N, K]`` (MC or ensemble members).

    The mean ``ᾱ`` is matched to the sample mean and the precision ``z`` comes from
    :func:`fit_precision` (Minka), so ``α = z·ᾱ``. ``smoothing`` ``γ`` first maps each sample to
    ``(1 − γ) f + γ/K`` (Dirichlet fVI uses ``γ = 1e−4``, so ``log f̃`` stays finite). ``z`` is
    clamped to ``[min_precision, max_precision]``, by default ``[K, max(M, K)]`` (DESIGN §3):
    below ``K`` the fit would be flatter than the uniform Dirichlet, and the upper bound stops
    the iteration from running away when the samples barely vary (Dirichlet fVI uses ``N``).
    """
    p = smoothed(probs.double(), smoothing).clamp_min(1e-300)
    m, _, k = p.shape
    upper = float(max_precision if max_precision is not None else max(m, k))
    lower = float(min_precision if min_precision is not None else k)
    a_bar = p.mean(0)
    a_bar = a_bar / a_bar.sum(-1, keepdim=True)
    z, _ = fit_precision(a_bar, p.log().mean(0), m, lower, upper, max_iter, tol)
    return z[:, None] * a_bar
