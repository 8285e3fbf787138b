"""Uncertainty-aware top-k (seed 004, Algorithm 1) and its summary.

Sort ``α`` descending (``α̃``); class ``i`` joins the set while the upper ``T/2`` quantile of its
Beta marginal ``Beta(α̃_i, α₀ − α̃_i)`` exceeds the lower ``T/2`` quantile of the previous class's
marginal; the first failure stops the scan. At least one class, at most ``max_k``.

The marginals are evaluated in ``O(1)`` per value at any ``α`` (:class:`BetaMarginals`): scipy's
exact Beta where ``α₀ ≤ EXACT_MAX_PRECISION`` (there its inverse is fast), and above it the
Beta's large-precision limits, where scipy's inverse takes ~10 ms per value: a normal
``N(m, m(1 − m)/(α₀ + 1))`` when both parameters are at least ``NORMAL_MIN``, else the Gamma
limit of the small side (``Beta(a, b) ≈ G/(G + b)``, ``G ~ Gamma(a)``, relative error ``≲ a/α₀``);
an infinite parameter (a point-mass Dirichlet, e.g. a confident net's bridge) is a point mass at
the limit of ``α_k/α₀``.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.special import (
    betainc,
    betaincinv,
    betaln,
    digamma,
    expit,
    gammainc,
    gammaincc,
    gammaincinv,
    gammaln,
    ndtr,
    ndtri,
)

# Above this precision scipy's Beta inverse slows from ~2 µs to ~10 ms per value; the limits
# below are then accurate to ≲ 1e-3 of the marginal's spread.
EXACT_MAX_PRECISION = 1e5
NORMAL_MIN = 1e3  # both Beta parameters at least this: the normal limit (skewness ≤ 0.06)


class BetaMarginals:
    """The Beta marginals ``Beta(a, b)`` of Dirichlet components (``a``, ``b`` arrays of one
    shape, float64), with ``cdf``, ``pdf`` and ``ppf`` in ``O(1)`` per value at any precision.

    Each entry is one of: ``exact`` (scipy, ``a + b ≤ EXACT_MAX_PRECISION``), ``normal``, ``gamma``
    (``a`` small, ``b`` huge), ``mirror`` (``b`` small, ``a`` huge: ``1 − X`` is ``gamma``) or a
    point mass at ``point`` (an infinite parameter; ``point`` is NaN elsewhere).
    """

    def __init__(self, a: np.ndarray, b: np.ndarray, point: np.ndarray | None = None) -> None:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        self.a, self.b = a, b
        if point is None:
            point = np.where(np.isinf(a), 1.0, np.where(np.isinf(b), 0.0, np.nan))
        self.point = point
        finite = np.isnan(point)
        with np.errstate(invalid="ignore"):
            total = np.where(finite, a + b, 1.0)
        self.exact = finite & (total <= EXACT_MAX_PRECISION)
        big = finite & ~self.exact
        self.normal = big & (np.minimum(a, b) >= NORMAL_MIN)
        self.gamma = big & ~self.normal & (a <= b)
        self.mirror = big & ~self.normal & ~self.gamma
        with np.errstate(all="ignore"):
            self.m = np.where(finite, a / total, point)
            self.s = np.where(self.normal, np.sqrt(self.m * (1 - self.m) / (total + 1)), 0.0)
        # each marginal's log normaliser, once (the CDF root-finding evaluates the pdf many times)
        self.log_norm = np.zeros_like(a)
        self.log_norm[self.exact] = betaln(a[self.exact], b[self.exact])
        self.log_norm[self.gamma] = gammaln(a[self.gamma])
        self.log_norm[self.mirror] = gammaln(b[self.mirror])

    def ppf(self, q: float, idx: np.ndarray | None = None) -> np.ndarray:
        """The ``q`` quantile of every marginal (of those at flat indices ``idx`` when given)."""
        fields = (
            self.a,
            self.b,
            self.m,
            self.s,
            self.point,
            self.exact,
            self.normal,
            self.gamma,
            self.mirror,
        )
        a, b, m, s, point, e, n, g, r = (v if idx is None else v.ravel()[idx] for v in fields)
        out = np.where(np.isnan(point), 0.0, point)
        out[e] = betaincinv(a[e], b[e], q)
        out[n] = m[n] + s[n] * ndtri(q)
        x = gammaincinv(a[g], q)
        out[g] = x / (x + b[g])
        y = gammaincinv(b[r], 1 - q)
        out[r] = a[r] / (y + a[r])
        return out

    def cdf_pdf(self, x: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(F(x), f(x))`` of the continuous marginals at flat indices ``idx`` (``x`` as long)."""
        a, b, m, s, lz = (v.ravel()[idx] for v in (self.a, self.b, self.m, self.s, self.log_norm))
        e, n, g, r = (v.ravel()[idx] for v in (self.exact, self.normal, self.gamma, self.mirror))
        cdf, pdf = np.zeros_like(x), np.zeros_like(x)
        with np.errstate(all="ignore"):
            xe = x[e]
            cdf[e] = betainc(a[e], b[e], xe)
            pdf[e] = np.exp((a[e] - 1) * np.log(xe) + (b[e] - 1) * np.log1p(-xe) - lz[e])
            z = (x[n] - m[n]) / s[n]
            cdf[n] = ndtr(z)
            pdf[n] = np.exp(-0.5 * z * z) / (s[n] * np.sqrt(2 * np.pi))
            for mask, shape, scale, flip in ((g, a, b, False), (r, b, a, True)):
                u = 1 - x[mask] if flip else x[mask]
                k, c = shape[mask], scale[mask]
                t = c * u / (1 - u)  # the Gamma variable G with G/(G + c) = u
                cdf[mask] = gammaincc(k, t) if flip else gammainc(k, t)
                pdf[mask] = np.exp((k - 1) * np.log(t) - t - lz[mask]) * c / (1 - u) ** 2
        return cdf, np.nan_to_num(pdf, posinf=0.0)


def overlap_levels(marg: BetaMarginals, t_range: tuple[float, float], max_iter: int = 100) -> np.ndarray:
    """The critical level ``T*`` of every adjacent pair of ``marg [N, kmax]`` ``[N, kmax − 1]``:
    class ``i + 1`` overlaps class ``i`` at level ``T`` iff ``T < T*`` (0 where no level in
    ``t_range`` overlaps, ``t_range[1]`` where every one does).

    ``Q_c(1 − T/2) = Q_p(T/2)`` at ``T*``: both equal the ``x*`` with ``F_c(x*) + F_p(x*) = 1``,
    and ``T* = F_p(x*) + 1 − F_c(x*)``. ``x*`` is found by safeguarded Newton on the CDFs, all
    pairs at once, from the crossing of the marginals' normal approximations (a point mass at
    ``m`` gives ``x* = m`` directly).
    """
    n, kmax = marg.a.shape
    flat = np.arange(n * kmax).reshape(n, kmax)
    ip, ic = flat[:, :-1].ravel(), flat[:, 1:].ravel()
    m, pt = marg.m.ravel(), ~np.isnan(marg.point.ravel())
    t_star = np.zeros(len(ip))
    both = pt[ip] & pt[ic]
    t_star[both] = np.where(m[ic][both] > m[ip][both], 1.0, 0.0)
    only_p = pt[ip] & ~pt[ic]  # overlap iff Q_c(1 − T/2) > m_p
    t_star[only_p] = 2 * (1 - marg.cdf_pdf(m[ip][only_p], ic[only_p])[0])
    only_c = ~pt[ip] & pt[ic]  # overlap iff m_c > Q_p(T/2)
    t_star[only_c] = 2 * marg.cdf_pdf(m[ic][only_c], ip[only_c])[0]
    act = np.flatnonzero(~pt[ip] & ~pt[ic])
    x = _logit_normal_crossing(marg, ip[act], ic[act])
    lo, hi = np.zeros_like(x), np.ones_like(x)
    level = np.zeros_like(x)  # T* = F_p + 1 − F_c at the last point evaluated
    todo = np.arange(len(act))
    for _ in range(max_iter):
        if not len(todo):
            break
        xt = x[todo]
        fc, dc = marg.cdf_pdf(xt, ic[act[todo]])
        fp, dp = marg.cdf_pdf(xt, ip[act[todo]])
        g = fc + fp - 1
        level[todo] = fp + 1 - fc
        lo[todo] = np.where(g < 0, xt, lo[todo])
        hi[todo] = np.where(g > 0, xt, hi[todo])
        lt, ht = lo[todo], hi[todo]
        with np.errstate(all="ignore"):
            # Halley's step: g'' from each density's log-derivative (a − 1)/x − (b − 1)/(1 − x)
            # (the Beta's; its limits' are close), cubic convergence from the logit-normal start
            d1 = dc + dp
            d2 = dc * _log_slope(marg, ic[act[todo]], xt) + dp * _log_slope(marg, ip[act[todo]], xt)
            newton = xt - 2 * g * d1 / (2 * d1 * d1 - g * d2)
        # a step outside the bracket bisects it, geometrically: x* can be 1e-30
        mid = np.where(lt > 0, np.sqrt(lt * ht), 1e-3 * ht)
        step = np.where(np.isfinite(newton) & (newton > lt) & (newton < ht), newton, mid)
        step = np.where(g == 0, xt, step)  # a root (or both CDFs saturated at it): stay
        x[todo] = step
        # |g| bounds the error of T* (|∂T*/∂x| = |f_p − f_c| ≤ f_p + f_c = |∂g/∂x|): below
        # LEVEL_TOL the level is final, as it is once x stops moving or its bracket closes
        moving = (np.abs(g) > LEVEL_TOL) & (np.abs(step - xt) > 1e-14 * xt) & (ht - lt > 1e-15 * ht)
        todo = todo[moving]
    t_star[act] = level
    lo_t, hi_t = t_range
    t_star = np.where(t_star > lo_t, np.minimum(t_star, hi_t), 0.0)
    return t_star.reshape(n, kmax - 1)


def _log_slope(marg: BetaMarginals, idx: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``d log f / dx = (a − 1)/x − (b − 1)/(1 − x)`` of the marginals at flat indices ``idx``."""
    return (marg.a.ravel()[idx] - 1) / x - (marg.b.ravel()[idx] - 1) / (1 - x)


# Root-finding stops where |F_c + F_p − 1| is below this: T* is then within it of exact (scipy's
# incomplete Beta is itself accurate to ~1e-15).
LEVEL_TOL = 1e-14


def _trigamma(x: np.ndarray) -> np.ndarray:
    """``ψ'(x)`` to ~1e-3 (a starting point only): ``1/x² + ψ'(x + 1)`` with the asymptotic series
    at ``x + 1 ≥ 1`` (scipy's ``polygamma`` goes through ``zeta``, 10× slower)."""
    y = x + 1
    return 1 / (x * x) + 1 / y + 1 / (2 * y * y) + 1 / (6 * y**3)


def _logit_normal_crossing(marg: BetaMarginals, ip: np.ndarray, ic: np.ndarray) -> np.ndarray:
    """A start for ``x*`` with ``F_c(x*) + F_p(x*) = 1`` for the pairs at flat indices ``ip``,
    ``ic``: the crossing of the marginals' logit-normal approximations (``logit X`` has mean
    ``ψ(a) − ψ(b)`` and variance ``ψ'(a) + ψ'(b)``), where ``(y − μ_c)/σ_c = −(y − μ_p)/σ_p``.
    A Beta is close to logit-normal, so the root-finding starts a few digits from the root."""
    a, b = marg.a.ravel(), marg.b.ravel()
    with np.errstate(all="ignore"):
        mu = digamma(a) - digamma(b)
        sd = np.sqrt(_trigamma(a) + _trigamma(b))
        y = (mu[ic] * sd[ip] + mu[ip] * sd[ic]) / (sd[ip] + sd[ic])
    return np.clip(np.nan_to_num(expit(y), nan=0.5), 1e-300, 1 - 1e-16)


def sorted_marginals(alpha: torch.Tensor, max_k: int) -> tuple[np.ndarray, BetaMarginals]:
    """``(order [N, kmax], marginals [N, kmax])``: the ``kmax = min(max_k, K)`` classes of
    largest ``α`` per row (descending, ties by index) and their Beta marginals. A row with an
    infinite ``α_k`` is the Dirichlet's limit: a point mass at ``1/#inf`` on each infinite class
    and at 0 on the others (its ``α₀ − α_k`` would be ``∞ − ∞``)."""
    a = alpha.double().cpu().numpy()
    kmax = max(1, min(int(max_k), a.shape[1]))
    order = np.argsort(-a, axis=1, kind="stable")[:, :kmax]
    a_sorted = np.take_along_axis(a, order, axis=1)
    inf = np.isinf(a)
    with np.errstate(invalid="ignore"):
        rest = a.sum(1, keepdims=True) - a_sorted
    point = np.full(a_sorted.shape, np.nan)
    rows = inf.any(1)
    if rows.any():
        share = np.take_along_axis(inf, order, axis=1)[rows] / inf[rows].sum(1, keepdims=True)
        point[rows] = share
        rest[rows] = 1.0  # unused: a point mass
    return order, BetaMarginals(a_sorted, rest, point)


def topk_sizes(
    alpha: torch.Tensor, threshold: float = 0.05, max_k: int = 10
) -> tuple[np.ndarray, np.ndarray]:
    """``(order [N, max_k], k [N])``: classes by descending ``α`` and each input's set size."""
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    order, marg = sorted_marginals(alpha, max_k)
    n, kmax = order.shape
    k = np.ones(n, dtype=np.int64)
    flat = np.arange(n * kmax).reshape(n, kmax)
    point = ~np.isnan(marg.point.ravel())
    rows = np.arange(n)
    # Column by column over the rows still scanning (the first failure stops a row): class j + 1
    # overlaps class j iff its upper quantile Q_c(1 − T/2) exceeds l = Q_p(T/2), i.e. iff
    # F_c(l) < 1 − T/2 — one Beta inverse and one (cheaper) Beta CDF per pair, not two inverses
    for j in range(kmax - 1):
        if not len(rows):
            break
        ip, ic = flat[rows, j], flat[rows, j + 1]
        lower = marg.ppf(threshold / 2, ip)
        cdf, _ = marg.cdf_pdf(lower, ic)
        overlap = np.where(point[ic], marg.m.ravel()[ic] > lower, cdf < 1 - threshold / 2)
        rows = rows[overlap]
        k[rows] += 1
    return order, k


def uncertainty_topk(alpha: torch.Tensor, threshold: float = 0.05, max_k: int = 10) -> list[torch.Tensor]:
    """Algorithm 1 for each row of ``alpha [N, K]``: a list of class-index tensors (best first)."""
    order, k = topk_sizes(alpha, threshold, max_k)
    return [torch.from_numpy(order[i, : k[i]].copy()) for i in range(len(k))]


def topk_summary(
    sets: list[torch.Tensor], probs: torch.Tensor, labels: torch.Tensor | None, max_k: int = 10
) -> dict:
    """Set sizes (mean, histogram 1..max_k) and, with labels, top-1 accuracy, set accuracy
    (label ∈ set) and fixed top-k accuracy for k = 1..5."""
    sizes = np.array([len(s) for s in sets])
    out: dict = {
        "mean_k": float(sizes.mean()),
        "k_histogram": {str(i): int((sizes == i).sum()) for i in range(1, max_k + 1)},
    }
    if labels is not None:
        y = labels.cpu().numpy()
        out["top1_accuracy"] = float((probs.argmax(-1).cpu().numpy() == y).mean())
        out["set_accuracy"] = float(np.mean([int(y[i]) in set(s.tolist()) for i, s in enumerate(sets)]))
        ranked = probs.argsort(-1, descending=True).cpu().numpy()
        out["fixed_topk_accuracy"] = {
            str(k): float((ranked[:, :k] == y[:, None]).any(1).mean())
            for k in range(1, min(5, probs.shape[1]) + 1)
        }
    return out
