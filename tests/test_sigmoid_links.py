"""Multi-label (sigmoid) links against high-precision quadrature and Monte Carlo."""

import math

import mpmath as mp
import pytest
import torch
from tolerance import assert_below, assert_close

from bayescli.errors import BayescliError
from bayescli.predictive.sigmoid_links import (
    BETA_MAX_PRECISION,
    apply_sigmoid_link,
    beta_expected_entropy,
    beta_mutual_information,
    binary_entropy,
    mutual_information,
    probit,
    sigmoid_gaussian_moments,
)

M = 100_000  # Monte Carlo samples of the oracles


def assert_within(actual, expected, allowed, what: str) -> None:
    """``|actual − expected| ≤ allowed`` elementwise for a per-element ``allowed`` (e.g. 10 MC
    standard errors), logged as the worst ratio."""
    assert_below(((actual - expected).abs() / allowed).max().item(), 1.0, what=what)


def gaussian_expectation(g, mu: float, sigma: float) -> mp.mpf:
    """``E[g(z)]``, ``z ~ N(μ, σ²)``, by mpmath at 30 digits, split where the integrand bends
    (the sigmoid's step at 0 and the Gaussian's peak)."""
    mp.mp.dps = 30
    if sigma == 0:
        return g(mp.mpf(mu))
    lo, hi = mu - 14 * sigma, mu + 14 * sigma
    pts = sorted({lo, hi, mu, *(p for p in (-40, -10, 0, 10, 40) if lo < p < hi)})

    def f(z):
        return g(z) * mp.exp(-((z - mu) ** 2) / (2 * sigma**2)) / (sigma * mp.sqrt(2 * mp.pi))

    return mp.quad(f, pts)


def expectations(g, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """:func:`gaussian_expectation` elementwise over tensors of the same shape (float64)."""
    pairs = zip(mu.reshape(-1).tolist(), sigma.reshape(-1).tolist(), strict=True)
    values = [float(gaussian_expectation(g, a, s)) for a, s in pairs]
    return torch.tensor(values, dtype=torch.float64).reshape(mu.shape)


def variance_of_sigmoid(mu: float, sigma: float) -> float:
    """``E[(sigmoid(z) − m)²]`` with ``m`` at 30 digits: no cancellation. Evaluated at ``−|μ|``
    (the variance is symmetric), where ``sigmoid(z) − m`` is not a difference of two numbers near 1."""
    mu = -abs(mu)
    m = gaussian_expectation(sig, mu, sigma)
    return float(gaussian_expectation(lambda z: (sig(z) - m) ** 2, mu, sigma))


def sig(z):
    return 1 / (1 + mp.exp(-z))


def entropy_of_logit(z):
    p = sig(z)
    return -(p * mp.log(p) + (1 - p) * mp.log(1 - p)) if 0 < p < 1 else mp.mpf(0)


RTOL_V = 1e-10  # observed 8.6e-12
GRID_MU = [-30.0, -8.0, -2.0, 0.0, 0.5, 3.0, 10.0, 30.0]
GRID_SIGMA = [0.0, 1e-3, 0.3, 1.0, 1.5, 1.6, 3.0, 10.0, 100.0, 1000.0]


def test_quadrature_moments_match_high_precision_integrals():
    """``m``, ``1 − m`` and ``v`` against mpmath on a grid that straddles the Hermite/Laguerre switch.

    Observed absolute errors: 6.4e-14 for ``m`` and ``1 − m``, 6.3e-13 for ``v`` (both at the switch,
    σ = 1.5), so the bounds 1e-12 and 1e-11 leave a margin above 15×. Where ``v`` is not tiny, or
    σ ≤ 1.5 near the centre, it is also held to a relative bound: the two-pass Hermite form keeps
    its relative accuracy down to σ = 1e-3.
    """
    mu = torch.tensor([[m for m in GRID_MU for _ in GRID_SIGMA]], dtype=torch.float64)
    sd = torch.tensor([[s for _ in GRID_MU for s in GRID_SIGMA]], dtype=torch.float64)
    m, mc, v = sigmoid_gaussian_moments(mu, sd**2)
    e1, e1c = (expectations(g, mu[0], sd[0]) for g in (sig, lambda z: sig(-z)))
    pairs = zip(mu[0].tolist(), sd[0].tolist(), strict=True)
    var = torch.tensor([variance_of_sigmoid(a, s) for a, s in pairs], dtype=torch.float64)
    assert_close(m[0], e1, atol=1e-12, what="E[sigmoid(z)] vs mpmath")
    assert_close(mc[0], e1c, atol=1e-12, what="1 − E[sigmoid(z)] vs mpmath")
    assert_close(v[0], var, atol=1e-11, what="Var[sigmoid(z)] vs mpmath")
    ok = (var > 1e-6) | ((sd[0] > 0) & (sd[0] <= 1.5) & (mu[0].abs() <= 3))
    assert_close(v[0][ok], var[ok], rtol=RTOL_V, what="Var[sigmoid(z)] relative")


def test_probit_is_within_its_known_error_of_the_exact_mean():
    """MacKay's probit differs from ``E[sigmoid(z)]`` by at most 0.016 over |μ| ≤ 10, σ ≤ 30 (measured
    against the quadrature here; the literature quotes ~0.02), and is exact at σ = 0.
    Against 1e5-sample MC the allowance is that 0.02 plus 10 MC standard errors."""
    mu = torch.linspace(-10, 10, 81, dtype=torch.float64)[:, None].expand(-1, 61)
    var = torch.linspace(0, 30, 61, dtype=torch.float64)[None, :].expand(81, -1) ** 2
    exact = sigmoid_gaussian_moments(mu, var)[0]
    err = (probit(mu, var) - exact).abs()
    assert_below(err.max().item(), 0.02, what="probit vs quadrature (approximation error)")
    assert_close(probit(mu[:, :1], var[:, :1]), torch.sigmoid(mu[:, :1]), rtol=1e-15, what="probit at σ = 0")
    mu_s = torch.tensor([[-3.0, 0.5, 2.0, 6.0]], dtype=torch.float64)
    var_s = torch.tensor([[9.0, 1.0, 4.0, 25.0]], dtype=torch.float64)
    mc = apply_sigmoid_link(mu_s, var_s, "mc", samples=M, seed=1)
    se = mc.std / math.sqrt(M)
    assert_within(probit(mu_s, var_s), mc.probs, 0.02 + 10 * se, what="probit vs MC")


MU = torch.tensor([[-4.0, -1.0, 0.0, 0.7, 2.5, 5.0], [1.0, -2.0, 3.0, 0.0, -0.3, 8.0]], dtype=torch.float64)
VAR = torch.tensor([[0.5, 2.0, 1.0, 9.0, 0.1, 30.0], [1e-3, 0.7, 4.0, 100.0, 1.5, 1.0]], dtype=torch.float64)


def _logit_draws(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    eps = torch.randn(*MU.shape, M, generator=gen, dtype=torch.float64)
    return MU[..., None] + VAR.sqrt()[..., None] * eps


def test_beta_matches_the_mean_and_variance_of_sigmoid_samples():
    """Beta mean = E[π] and variance = Var[π] of ``π = sigmoid(z)`` within 10 MC standard errors
    (SE of a mean: sd/√M; of a variance: √((μ₄ − v²)/M) from the same samples)."""
    out = apply_sigmoid_link(MU, VAR, "beta")
    p = torch.sigmoid(_logit_draws(2))
    mean, var = p.mean(-1), p.var(-1)
    mu4 = (p - mean[..., None]).pow(4).mean(-1)
    assert_within(out.probs, mean, 10 * p.std(-1) / math.sqrt(M), what="Beta mean vs MC")
    assert_within(out.std**2, var, 10 * ((mu4 - var**2) / M).sqrt(), what="Beta variance vs MC")
    # the Beta reproduces the quadrature moments it was fitted to
    m, _, v = sigmoid_gaussian_moments(MU, VAR)
    a, b = out.alpha, out.beta
    assert_close(a / (a + b), m, rtol=1e-12, what="Beta mean = quadrature mean")
    beta_var = a * b / ((a + b) ** 2 * (a + b + 1))
    assert_close(beta_var, v, rtol=1e-10, what="Beta variance = quadrature variance")


def test_beta_mutual_information_matches_samples_from_the_beta():
    """Closed-form ``E[H_b(π)]`` (digamma) vs the mean of ``H_b`` over 1e5 Beta draws, within 10 SEs;
    MI = H_b(mean) − E[H_b] then differs by the same amount."""
    out = apply_sigmoid_link(MU, VAR, "beta")
    draws = torch.distributions.Beta(out.alpha, out.beta).sample((M,))  # [M, N, K]
    h = binary_entropy(draws.clamp(1e-300, 1 - 1e-16))
    se = h.std(0) / math.sqrt(M)
    assert_within(out.expected_entropy, h.mean(0), 10 * se + 1e-12, what="Beta E[H_b] vs samples")
    mi_mc = binary_entropy(out.alpha / (out.alpha + out.beta)) - h.mean(0)
    assert_within(out.mutual_information, mi_mc, 10 * se + 1e-12, what="Beta MI vs samples")
    assert_close(mutual_information(out), out.mutual_information, rtol=1e-12, what="mutual_information(beta)")


def test_mc_link_matches_quadrature():
    """The MC link's mean, expected entropy and MI vs mpmath quadrature, within 10 SEs of its own
    sample (MI: |H_b'(m)|·10 SE_p + 10 SE_H, the propagated bound)."""
    out = apply_sigmoid_link(MU, VAR, "mc", samples=M, seed=3)
    m, h = (expectations(g, MU, VAR.sqrt()) for g in (sig, entropy_of_logit))
    z = _logit_draws(4)
    se_p = out.std / math.sqrt(M)
    se_h = binary_entropy(torch.sigmoid(z)).std(-1) / math.sqrt(M)
    assert_within(out.probs, m, 10 * se_p, what="MC mean vs quadrature")
    assert_within(out.expected_entropy, h, 10 * se_h + 1e-15, what="MC E[H_b] vs quadrature")
    slope = (torch.log((1 - m) / m)).abs()
    allowed = slope * 10 * se_p + 10 * se_h + 1e-15
    assert_within(out.mutual_information, binary_entropy(m) - h, allowed, what="MC MI vs quadrature")
    assert_close(mutual_information(out), out.mutual_information, atol=1e-15, what="mutual_information(mc)")


def test_limits_point_mass_and_huge_variance():
    mu = torch.tensor([[-40.0, -2.0, 0.0, 3.0, 40.0]], dtype=torch.float64)
    zero = torch.zeros_like(mu)
    out = apply_sigmoid_link(mu, zero, "beta")
    # σ² = 0: the Beta is the capped, near-point mass at sigmoid(μ), with 1 − m kept where m rounds to 1
    assert_close(out.probs, torch.sigmoid(mu), rtol=1e-12, what="Beta mean at σ² = 0")
    assert_close(out.alpha + out.beta, torch.full_like(mu, BETA_MAX_PRECISION), rtol=1e-12, what="capped s")
    assert_close(out.beta / (out.alpha + out.beta), torch.sigmoid(-mu), rtol=1e-12, what="1 − m at σ² = 0")
    assert_below(out.mutual_information.max().item(), 1e-9, what="MI of a point mass")
    # ... yet float64 still resolves the capped Beta's MI ≈ 1/(2s) (a, b ≫ 1) at m = ½
    assert_close(out.mutual_information[0, 2], 0.5 / BETA_MAX_PRECISION, rtol=1e-3, what="MI at the cap")
    # σ → ∞: π piles up at 0 and 1, s → 0, MI → ln 2
    wide = apply_sigmoid_link(mu, torch.full_like(mu, 1e8), "beta")
    assert torch.isfinite(wide.alpha).all() and (wide.alpha > 0).all() and (wide.beta > 0).all()
    assert_close(wide.mutual_information, math.log(2), atol=1e-3, what="MI at σ² = 1e8")
    assert_close(apply_sigmoid_link(mu, zero, "none").probs, torch.sigmoid(mu), rtol=1e-15, what="none link")
    mc = apply_sigmoid_link(mu, zero, "mc", samples=16)
    assert_below(mc.mutual_information.max().item(), 1e-12, what="MC MI at σ² = 0")


def test_expected_entropy_digamma_identity():
    """Beta(1, 1) is uniform: ``E[−π ln π] = ∫₀¹ −π ln π dπ = 1/4``, so E[H_b] = 1/2 nat and
    MI = ln 2 − 1/2 (the mean is ½)."""
    one = torch.ones(1, 1, dtype=torch.float64)
    assert_close(beta_expected_entropy(one, one), 0.5, rtol=1e-14, what="E[H_b] of Beta(1,1)")
    assert_close(beta_mutual_information(one, one), math.log(2) - 0.5, rtol=1e-13, what="MI of Beta(1,1)")


def test_mc_link_is_seeded_and_dtype_preserving():
    mu32, var32 = MU.float(), VAR.float()
    a = apply_sigmoid_link(mu32, var32, "mc", samples=500, seed=7)
    b = apply_sigmoid_link(mu32, var32, "mc", samples=500, seed=7)
    assert torch.equal(a.probs, b.probs) and a.probs.dtype == torch.float32
    assert apply_sigmoid_link(mu32, var32, "beta").alpha.dtype == torch.float32


def test_bad_inputs_raise():
    with pytest.raises(BayescliError, match=r"\[N, K\]"):
        apply_sigmoid_link(MU, VAR[:, :3], "probit")
    with pytest.raises(BayescliError, match=r"\[N, K\]"):
        apply_sigmoid_link(MU[0], VAR[0], "beta")
    with pytest.raises(BayescliError, match="at least 1 sample"):
        apply_sigmoid_link(MU, VAR, "mc", samples=0)
    with pytest.raises(BayescliError, match="'mc' or 'beta'"):
        mutual_information(apply_sigmoid_link(MU, VAR, "probit"))
