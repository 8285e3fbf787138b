"""Links against Monte Carlo with 10⁵ samples and against autograd Taylor expansions.

Tolerances (absolute, on probabilities) come from the approximation error of each link plus
the MC standard error (≤ 0.5/√10⁵ = 0.0016 per probability): probit 0.02 (see PROBIT_TOL),
the bridge mean's miss by the second-order term (+ 6 SE), SODPP 0.002 at logit variances
≈ 0.01 (its neglected fourth-order term is O(σ⁴) ≈ 1e-4); float64 identities at 1e-10.
"""

import math

import numpy as np
import pytest
import torch
from scipy.special import expit
from tolerance import assert_close

from bayescli.posterior.gaussian import LogitGaussian
from bayescli.predictive import dirichlet
from bayescli.predictive.links import apply_link, bridge, monte_carlo, probit, sodpp


def random_gaussians(n: int, k: int, scale: float, seed: int = 0) -> LogitGaussian:
    gen = torch.Generator().manual_seed(seed)
    mu = 2 * torch.randn(n, k, generator=gen, dtype=torch.float64)
    a = torch.randn(n, k, k, generator=gen, dtype=torch.float64)
    cov = scale * a @ a.transpose(1, 2) / k
    return LogitGaussian(mu, cov.diagonal(dim1=1, dim2=2).clone(), cov)


def mc(lg: LogitGaussian, m: int = 100_000, seed: int = 1) -> torch.Tensor:
    return monte_carlo(lg, m, torch.Generator().manual_seed(seed)).probs


# sup over (m, σ²) of |σ(m/√(1 + πσ²/8)) − E[σ(m + σε)]| is 0.0086 (quadrature on m ∈ [−4, 4],
# σ² ∈ [0.25, 25]); the MC standard error is ≤ 0.5/√10⁵ = 0.0016, so 0.0086 + 6·0.0016 ≈ 0.02.
PROBIT_TOL = 0.02


def test_probit_matches_mc_where_softmax_of_the_mean_does_not():
    """Two classes, variance on the first logit only: extended probit is MacKay's approximation
    of the logistic–Gaussian integral, compared with 10⁵ independent NumPy draws."""
    m = np.linspace(-3, 3, 13)
    grid_m, grid_v = np.meshgrid(m, [1.0, 4.0, 9.0])
    mu = np.stack([grid_m.ravel(), np.zeros(grid_m.size)], 1)
    var = np.stack([grid_v.ravel(), np.zeros(grid_v.size)], 1)
    eps = np.random.default_rng(0).standard_normal(100_000)
    exact = expit(mu[:, :1] + np.sqrt(var[:, :1]) * eps[None, :]).mean(1)
    lg = LogitGaussian(torch.from_numpy(mu), torch.from_numpy(var))
    assert_close(probit(lg)[:, 0], exact, atol=PROBIT_TOL, what="probit vs MC, K=2")
    map_error = np.abs(expit(mu[:, 0]) - exact).max()
    assert map_error > 5 * PROBIT_TOL  # the test separates probit from plain softmax(μ)


def test_probit_formula():
    lg = random_gaussians(7, 4, 1.0)
    expected = torch.softmax(lg.mean / torch.sqrt(1 + math.pi * lg.var / 8), -1)
    # float64, the same formula with rsqrt instead of 1/sqrt: a few ulps
    assert_close(probit(lg), expected, rtol=1e-10, what="probit formula")


@pytest.mark.parametrize("alpha", [[11.0, 11.0, 51.0], [50.0, 30.0, 20.0], [110.0, 110.0, 510.0]])
def test_bridge_mean_misses_mc_by_the_second_order_term(alpha):
    """On a Dirichlet-consistent Gaussian (eqs. 5–6) the bridge mean is ``softmax(μ)``, and
    ``E[softmax z]`` is ``softmax(μ) + T + R``: ``T = ½ Σ_ij ∂²softmax/∂z_i∂z_j Σ_ij`` (autograd) is
    the bridge's O(1/α₀) approximation error, ``R`` the higher-order remainder."""
    a = torch.tensor([alpha], dtype=torch.float64)
    mu, cov = dirichlet.dirichlet_to_gaussian(a)
    lg = LogitGaussian(mu, cov.diagonal(dim1=1, dim2=2).clone(), cov)
    ours = dirichlet.mean(bridge(lg))[0]
    # μ = log α − mean log α makes α/α₀ = softmax(μ): float64, a few ulps
    assert_close(ours, mu[0].softmax(-1), rtol=1e-12, what=f"bridge mean = softmax(μ), alpha={alpha}")
    hess = torch.autograd.functional.jacobian(
        lambda z: torch.autograd.functional.jacobian(lambda u: u.softmax(-1), z, create_graph=True), mu[0]
    )
    t = 0.5 * torch.einsum("kij,ij->k", hess, cov[0])
    m = 1_000_000
    z = np.random.default_rng(0).multivariate_normal(mu[0].numpy(), cov[0].numpy(), size=m, method="eigh")
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    # MC: 6 standard errors of each mean. R: each further order of the expansion brings one more
    # factor of the variance, so |R| ≲ |T|·max Σ_kk (max Σ_kk = 0.053, 0.028, 0.0053 for these α;
    # the measured |R| is about a third of that bound at α₀ = 73)
    atol = 6 * p.std(0) / m**0.5 + t.abs().numpy() * cov[0].diagonal().max().item()
    assert_close(p.mean(0), ours + t, atol=atol, what=f"MC mean = bridge mean + T, alpha={alpha}")
    # T is the bridge's error and the check resolves it: without T the comparison would fail
    assert t.abs().max() > 3 * atol.max()


def test_sodpp_equals_second_order_taylor_expansion():
    lg = random_gaussians(6, 4, 0.01, seed=2)
    for n in range(6):
        mu, cov = lg.mean[n], lg.cov[n]
        hess = torch.autograd.functional.jacobian(
            lambda z: torch.autograd.functional.jacobian(lambda u: u.softmax(-1), z, create_graph=True), mu
        )  # [K, K, K]: d²p_k / dz_i dz_j
        taylor = mu.softmax(-1) + 0.5 * torch.einsum("kij,ij->k", hess, cov)
        # float64 on probabilities ≤ 1 and Σ ≈ 0.01: rounding ≈ 1e-16; 1e-10 is far above it
        assert_close(sodpp(lg)[n], taylor, atol=1e-10, what="SODPP = second-order Taylor")
    assert_close(sodpp(lg), mc(lg), atol=0.002, what="SODPP vs MC")


def test_mc_error_shrinks_like_one_over_sqrt_m():
    lg = random_gaussians(400, 4, 1.0, seed=3)
    # Two independent M-draw estimates differ by a mean of M independent terms minus another:
    # variance 2σ²/M per probability, with no reference estimate whose own error would bias the
    # ratio (and 10× cheaper than a 200,000-draw reference)
    err = {m: (mc(lg, m, seed=5) - mc(lg, m, seed=6)).pow(2).mean().sqrt().item() for m in (100, 10_000)}
    # the ratio is √(10000/100) = 10; each RMS over 1600 probabilities has a relative SE ≈
    # 1/√3200 ≈ 2%, so the ratio's SE is ≈ 10·√2·2% ≈ 0.3: 4 is above 10 SE and still separates
    # 1/√M from 1/M (100) or no decay (1)
    assert_close(err[100] / err[10_000], 10.0, atol=4.0, what="MC error ratio for 100× the samples")


def test_mc_forms_agree():
    """Diagonal, eigen-form and full covariances describe the same Gaussian."""
    gen = torch.Generator().manual_seed(4)
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=gen, dtype=torch.float64))
    spec = torch.rand(50, 4, generator=gen, dtype=torch.float64)
    mu = torch.randn(50, 4, generator=gen, dtype=torch.float64)
    eig = LogitGaussian(mu, spec @ q.pow(2).T, basis=q, spectrum=spec)
    full = LogitGaussian(mu, eig.var, eig.covariance())
    # two MC estimates with different square roots of Σ: difference SE ≤ √2·0.0016 = 0.0023 per
    # probability; 0.01 is 4.4 of them, the max over 200 probabilities
    assert_close(mc(eig), mc(full), atol=0.01, what="MC, eigen form vs full covariance")
    for link in ("probit", "sodpp", "bridge"):
        # float64; the eigen form rebuilds Σ = Q diag(s) Qᵀ, rounding ≈ K·eps
        same = apply_link(full, link).probs
        assert_close(apply_link(eig, link).probs, same, atol=1e-10, what=f"{link}, eigen form vs full")


def test_mc_dirichlet_and_std_are_returned():
    lg = random_gaussians(5, 3, 0.5)
    out = monte_carlo(lg, 2000, torch.Generator().manual_seed(0), fit_dirichlet=True)
    assert out.alpha.shape == (5, 3) and out.std.shape == (5, 3) and (out.alpha > 0).all()
    # Minka's fit keeps the sample mean exactly (α = z·p̄): only float64 rounding remains
    assert_close(dirichlet.mean(out.alpha), out.probs, atol=1e-12, what="MC Dirichlet mean = MC mean")


@pytest.mark.parametrize("kind", ["diag", "eig", "full"])
def test_mc_spread_and_expected_entropy_against_numpy_sampling(kind):
    """The samples' spread ``std`` and mean entropy against an independent NumPy sampler of the
    same Gaussians (10⁵ draws); tolerances are 6 standard errors of the difference, from the
    reference's own draws (var of a sample sd ≈ (μ₄ − σ⁴)/(4σ²M))."""
    gen = torch.Generator().manual_seed(6)
    k, m_ours, m_ref = 4, 20_000, 100_000
    q, _ = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))
    spec = 2 * torch.rand(6, k, generator=gen, dtype=torch.float64)
    mu = torch.randn(6, k, generator=gen, dtype=torch.float64)
    eig = LogitGaussian(mu, spec @ q.pow(2).T, basis=q, spectrum=spec)
    lg = {
        "diag": LogitGaussian(mu, spec),
        "eig": eig,
        "full": LogitGaussian(mu, eig.var, eig.covariance()),
    }[kind]
    out = monte_carlo(lg, m_ours, torch.Generator().manual_seed(1))
    rng = np.random.default_rng(0)
    cov = lg.covariance().numpy()
    for i in range(len(mu)):
        z = rng.multivariate_normal(mu[i].numpy(), cov[i], size=m_ref)
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        sd, c = p.std(0, ddof=1), p - p.mean(0)
        mu4 = (c**4).mean(0)
        se_sd = np.sqrt((mu4 - sd**4) / (4 * sd**2) * (1 / m_ours + 1 / m_ref))
        assert_close(out.std[i], sd, atol=6 * se_sd, what=f"MC spread ({kind})")
        h = -(p * np.log(p)).sum(1)
        se_h = h.std() * np.sqrt(1 / m_ours + 1 / m_ref)
        assert_close(out.expected_entropy[i], h.mean(), atol=6 * se_h, what=f"MC mean entropy ({kind})")
