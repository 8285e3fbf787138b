import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import eq7
from tolerance import assert_close

from bayescli.errors import BayescliError
from bayescli.predictive import dirichlet
from bayescli.predictive.dirichlet import bridge_alpha, laplace_bridge

# float64 formulas, values up to e^160: rounding ≲ K·eps ≈ 2e-13 relative (K ≤ 1000); 500× margin
F64 = 1e-10


@pytest.mark.parametrize(("k", "scale"), [(3, 1.0), (10, 5.0), (1000, 1.0), (50, 80.0)])
def test_alpha_matches_direct_transcription_of_eq7(k, scale):
    gen = torch.Generator().manual_seed(k)
    mu = (torch.rand(20, k, generator=gen, dtype=torch.float64) * 2 - 1) * scale  # |μ| up to 80
    var = torch.rand(20, k, generator=gen, dtype=torch.float64) + 0.01
    ours = laplace_bridge(mu, var, correction="none")
    assert_close(ours, eq7(mu, var), rtol=F64, what=f"eq. 7, K={k}, |mu| up to {scale}")


def test_bridge_survives_logits_that_break_the_direct_formula():
    """Eq. 7 is shift-invariant in μ; the log-space form keeps it so where exp over/underflows."""
    mu = torch.tensor([[750.0, 740.0, 745.0]], dtype=torch.float64)
    var = torch.tensor([[0.5, 1.0, 2.0]], dtype=torch.float64)
    with np.errstate(all="ignore"):
        assert not torch.isfinite(eq7(mu, var)).all()  # e^750 = inf, e^-740 = 0
    alpha = bridge_alpha(mu, var)
    assert_close(alpha, eq7(mu - 745.0, var), rtol=F64, what="eq. 7 in log space, mu ~ 750")
    big = torch.tensor([[60.0, -60.0, 0.0]])  # float32: e^120 overflows, α does not
    assert torch.isfinite(laplace_bridge(big, torch.ones(1, 3), "none")).all()


def _eq7_by_logs(mu: list[float], var: list[float]) -> list[float]:
    """Eq. 7 element by element in Python floats, through logs: e^{μ_k} Σ_l e^{−μ_l} / (K² Σ_kk) =
    exp(μ_k + log Σ_l e^{−μ_l} − 2 log K − log Σ_kk) stays finite while α does."""
    k, m = len(mu), max(-v for v in mu)
    lse = m + math.log(math.fsum(math.exp(-v - m) for v in mu))
    return [
        math.exp(u + lse - 2 * math.log(k) - math.log(s)) + (1 - 2 / k) / s
        for u, s in zip(mu, var, strict=True)
    ]


def test_bridge_where_e_to_the_t_overflows_on_host_and_device():
    # Row 0: t₀ = μ₀ + log Σ e^{−μ} − 2 log K ≈ 718 > 709.8, so e^{t₀} overflows float64 while
    # α₀ = e^{t₀}/Σ₀₀ ≈ 1e301 does not (the log form); row 1 is ordinary (the direct form). On a
    # GPU the form is chosen per element (no look at max t): the same values, nothing read back.
    from emulated_cuda import emulated_cuda

    mu = torch.tensor([[720.0, 0.0, 5.0], [1.0, -2.0, 0.5]], dtype=torch.float64)
    var = torch.tensor([[1e10, 1.0, 1.0], [0.3, 0.2, 1.5]], dtype=torch.float64)
    expected = torch.tensor(
        [_eq7_by_logs(m, v) for m, v in zip(mu.tolist(), var.tolist(), strict=True)], dtype=torch.float64
    )
    assert_close(bridge_alpha(mu, var), expected, rtol=1e-12, what="eq. 7 past exp's range, host")
    with emulated_cuda() as stats:
        alpha = bridge_alpha(mu.to("cuda"), var.to("cuda"))
        assert alpha.device.type == "cuda" and stats.host_reads == 0
        alpha = alpha.cpu()
    # exp of a ~718 argument: its float64 rounding (≤ 718·eps ≈ 2e-13 relative) bounds the error
    assert_close(alpha, expected, rtol=1e-12, what="eq. 7 past exp's range, device")


def test_zero_sum_correction_matches_matrix_formula():
    gen = torch.Generator().manual_seed(0)
    mu = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    a = torch.randn(8, 5, 5, generator=gen, dtype=torch.float64)
    cov = a @ a.transpose(1, 2)
    one = torch.ones(5, 1, dtype=torch.float64)
    s1 = cov @ one
    total = (one.T @ cov @ one).squeeze(-1)
    mu_c = mu - (s1.squeeze(-1) * mu.sum(-1, keepdim=True)) / total
    cov_c = cov - s1 @ s1.transpose(1, 2) / total[..., None]
    expected = eq7(mu_c, cov_c.diagonal(dim1=1, dim2=2))
    # κ(Σ) of a 5×5 Wishart draw is ≲ 1e3: the correction loses ≲ κ·eps ≈ 2e-13 relative
    assert_close(laplace_bridge(mu, cov, "zero-sum"), expected, rtol=F64, what="zero-sum correction")
    c = cov_c.diagonal(dim1=1, dim2=2).mean(-1, keepdim=True) / math.sqrt(5 / 2)
    expected_norm = eq7(mu_c / c.sqrt(), cov_c.diagonal(dim1=1, dim2=2) / c)
    assert_close(laplace_bridge(mu, cov, "norm"), expected_norm, rtol=F64, what="norm correction")


def test_round_trip_dirichlet_gaussian_dirichlet():
    alpha = torch.tensor([[2.0, 2.0, 6.0], [11.0, 11.0, 51.0], [0.5, 3.0, 9.0]], dtype=torch.float64)
    mu, cov = dirichlet.dirichlet_to_gaussian(alpha)
    # log α ≤ 4, so the centred logits sum to zero up to K·4·eps ≈ 3e-15
    assert_close(mu.sum(-1), 0.0, atol=1e-12, what="forward map is zero-sum")
    for correction in ("none", "zero-sum"):
        assert_close(laplace_bridge(mu, cov, correction), alpha, rtol=F64, what=f"round trip ({correction})")


def test_variances_and_full_covariances_give_same_alpha_without_correction():
    gen = torch.Generator().manual_seed(1)
    mu = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    var = torch.rand(4, 6, generator=gen, dtype=torch.float64) + 0.1
    same = laplace_bridge(mu, torch.diag_embed(var), "none")
    assert_close(laplace_bridge(mu, var, "none"), same, rtol=F64, what="variances = diagonal covariance")
    with pytest.raises(BayescliError):
        laplace_bridge(mu, torch.rand(4, 5))


@settings(max_examples=60, deadline=None)
@given(
    mu=st.lists(st.floats(-4, 4), min_size=3, max_size=6),
    var=st.lists(st.floats(0.05, 3), min_size=6, max_size=6),
    k=st.integers(0, 5),
    factor=st.floats(1.05, 3.0),
)
def test_proposition_1_variance_grows_with_sigma_kk(mu, var, k, factor):
    m = torch.tensor([mu], dtype=torch.float64)
    v = torch.tensor([var[: m.shape[1]]], dtype=torch.float64)
    k = k % m.shape[1]
    alpha = laplace_bridge(m, v, "none")
    rest = alpha.sum() - alpha[0, k]
    condition = alpha[0, k] > 0.25 * (torch.sqrt(9 * rest**2 + 10 * rest + 1) - rest - 1)
    v2 = v.clone()
    v2[0, k] *= factor
    alpha2 = laplace_bridge(m, v2, "none")
    cond2 = alpha2[0, k] > 0.25 * (torch.sqrt(9 * rest**2 + 10 * rest + 1) - rest - 1)
    if bool(condition) and bool(cond2):
        assert dirichlet.variance(alpha2)[0, k] > dirichlet.variance(alpha)[0, k]


def test_minka_recovers_alpha_from_samples():
    for alpha in ([2.0, 5.0, 3.0], [20.0, 1.0, 4.0, 0.5], [40.0, 60.0]):
        a = torch.tensor(alpha, dtype=torch.float64)
        torch.manual_seed(0)
        samples = torch.distributions.Dirichlet(a).sample((100_000,))[:, None, :]
        est = dirichlet.dirichlet_from_samples(samples, max_precision=1e6)[0]
        # with 10⁵ draws the MLE's relative SE (inverse Fisher information) is ≤ 0.45% for these α;
        # the moment-matched mean makes this fit a little less efficient: 0.05 is 11 MLE SEs
        assert_close(est, a, rtol=0.05, what=f"Minka fit of {alpha}")


def test_minka_precision_is_clamped_to_k_and_m():
    flat = torch.full((50, 1, 4), 0.25, dtype=torch.float64)  # no spread: precision → ∞
    assert_close(
        dirichlet.dirichlet_from_samples(flat).sum(), 50.0, rtol=1e-12, what="precision clamped at M"
    )


def test_dirichlet_utilities_against_sampling():
    alpha = torch.tensor([[3.0, 1.5, 0.7, 5.0]], dtype=torch.float64)
    torch.manual_seed(0)
    draws = torch.distributions.Dirichlet(alpha[0]).sample((200_000,))
    m = len(draws)
    # statistical checks at 6 standard errors, each estimated from the draws themselves
    se_mean = draws.std(0) / m**0.5
    assert_close(
        dirichlet.mean(alpha)[0], draws.mean(0), atol=6 * se_mean.numpy(), what="mean vs sampling (6 SE)"
    )
    se_var = ((draws - draws.mean(0)).pow(2).var(0) / m).sqrt()
    assert_close(
        dirichlet.variance(alpha)[0],
        draws.var(0),
        atol=6 * se_var.numpy(),
        what="variance vs sampling (6 SE)",
    )
    per_draw = -(draws * draws.log()).sum(-1)
    se_ent = per_draw.std() / m**0.5
    ent = dirichlet.expected_entropy(alpha)[0]
    assert_close(ent, per_draw.mean(), atol=6 * se_ent, what="expected entropy vs sampling (6 SE)")
    a, b = dirichlet.beta_marginals(alpha)
    assert_close(a / (a + b), dirichlet.mean(alpha), rtol=F64, what="Beta marginal means")
    agg = dirichlet.aggregate(alpha, [[0, 2], [1], [3]])
    grouped = torch.stack([draws[:, [0, 2]].sum(-1), draws[:, 1], draws[:, 3]], -1)
    se_agg = ((grouped - grouped.mean(0)).pow(2).var(0) / m).sqrt()
    agg_var = dirichlet.variance(agg)[0]
    assert_close(
        agg_var, grouped.var(0), atol=6 * se_agg.numpy(), what="aggregated variance vs sampling (6 SE)"
    )
    # lgamma/digamma of arguments ≤ 11 in float64: a few ulps of values of order 1
    reference = torch.distributions.Dirichlet(alpha).entropy()
    assert_close(
        dirichlet.dirichlet_entropy(alpha), reference, rtol=F64, atol=1e-12, what="Dirichlet entropy"
    )
    reference = torch.distributions.Dirichlet(alpha[0]).log_prob(draws[:5])
    assert_close(dirichlet.log_density(alpha, draws[:5]), reference, rtol=F64, atol=1e-12, what="log density")
    assert dirichlet.mutual_information(alpha).item() >= 0
    with pytest.raises(BayescliError):
        dirichlet.aggregate(alpha, [[0, 1], [1, 2, 3]])


@pytest.mark.parametrize(
    "alpha", [[3.0, 1.5, 0.7, 5.0], [0.3, 0.3, 0.3], [40.0, 2.0, 1.0, 1.0, 1.0], [200.0, 150.0]]
)
def test_mutual_information_against_sampling(alpha):
    """MI = H[E π] − E H[π]: the second term by 10⁵ NumPy Dirichlet draws, 6 standard errors."""
    a = np.array(alpha)
    draws = np.random.default_rng(0).dirichlet(a, size=100_000)
    ent = -(draws * np.log(np.clip(draws, 1e-300, None))).sum(1)
    mean = a / a.sum()
    mi_mc = -(mean * np.log(mean)).sum() - ent.mean()
    se = ent.std() / np.sqrt(len(ent))
    ours = dirichlet.mutual_information(torch.tensor([alpha], dtype=torch.float64))[0]
    assert_close(ours, mi_mc, atol=6 * se, what="mutual information vs MC (6 SE)")
    expected_entropy = dirichlet.expected_entropy(torch.tensor([alpha], dtype=torch.float64))[0]
    assert_close(expected_entropy, ent.mean(), atol=6 * se, what="expected entropy vs MC (6 SE)")


def test_the_bridge_of_a_point_mass_is_finite_and_isotropic():
    """A zero-variance posterior's logit 'variances' are rounding noise (zeros beside 1e-13s): the
    bridge takes the isotropic limit per row (one variance) instead of a one-hot or NaN mean."""
    from bayescli.dirichlet import bridge_alpha, correct
    from bayescli.options import DEFAULT_CORRECTION

    gen = torch.Generator().manual_seed(0)
    mu = torch.randn(6, 10, generator=gen, dtype=torch.float64) * 8
    noise = torch.zeros(6, 10, dtype=torch.float64)
    noise[:, ::3] = 1e-13
    mean = lambda a: a / a.sum(-1, keepdim=True)  # noqa: E731
    isotropic = mean(bridge_alpha(mu, torch.full_like(mu, 1e-13)))
    got = mean(bridge_alpha(*correct(mu, noise, noise, DEFAULT_CORRECTION)))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, isotropic, rtol=1e-12, atol=1e-15)
    # an ordinary posterior's variances are untouched
    var = torch.rand(6, 10, generator=gen, dtype=torch.float64) + 0.1
    torch.testing.assert_close(bridge_alpha(mu, var), bridge_alpha(mu, var.clone()))
    assert not torch.allclose(
        mean(bridge_alpha(mu, var)), mean(bridge_alpha(mu, var.mean(-1, keepdim=True).expand_as(var)))
    )
