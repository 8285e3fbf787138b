"""The Dirichlet fVI predictive's fast path (issue 25 part 4): vectorised ψ/ψ₁ gaps, Minka from
them, and the fused sample means give the α of the old algorithm (float32 smoothed samples, float64
``torch.digamma``/``polygamma`` Minka from Stirling's start) run to full convergence, to 1e-6 relative."""

import math

import mpmath as mp
import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_close

from bayescli.dirichlet import _VECTORISED_STEPS, digamma_gaps, fit_precision_vectorised
from bayescli.options import Subset
from bayescli.posterior.vi.dirichlet_fvi_posterior import (
    MINKA_CHUNK_ELEMENTS,
    DirichletFVIPosterior,
    normalised_means,
    sample_means,
)

GAMMA = 1e-4
MINKA_ROWS = MINKA_CHUNK_ELEMENTS // 1000  # rows per Minka/bridge block at K = 1000


def old_sample_means(logits: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The old predictive's float32 sample stage on ``logits [M, N, K]``: means over members of
    ``f̃ = (1 − γ) softmax + γ/K`` and of ``ln f̃``."""
    ft = torch.softmax(logits, -1) * (1 - gamma) + gamma / logits.shape[-1]
    return ft.mean(0), ft.log().mean(0)


def old_alpha(mean_ft: torch.Tensor, mean_log_ft: torch.Tensor, m: int, lo: float, hi: float) -> torch.Tensor:
    """The old algorithm to full convergence: ``ᾱ`` normalised in float64, Stirling's start, exact
    float64 Minka steps on ``1/z`` clamped to ``[lo, hi]`` (``1/z ≤ 0`` → ``hi``; ``M = 1`` → ``hi``)
    until no row moves by more than 1e-13 relative."""
    a_bar = mean_ft.double()
    a_bar = a_bar / a_bar.sum(-1, keepdim=True)
    a_log = mean_log_ft.double()
    if m == 1:
        return hi * a_bar
    k = a_bar.shape[-1]
    denom = -2 * (a_bar * (a_log - a_bar.log())).sum(-1)
    z = torch.where(denom > 0, (k - 1) / denom.clamp_min(1e-300), torch.full_like(denom, hi)).clamp(lo, hi)
    for _ in range(500):
        zab = z[:, None] * a_bar
        d1 = torch.digamma(z) - (a_bar * torch.digamma(zab)).sum(-1) + (a_bar * a_log).sum(-1)
        d2 = torch.polygamma(1, z) - (a_bar**2 * torch.polygamma(1, zab)).sum(-1)
        inv = 1 / z + d1 / (z**2 * d2)
        z, previous = torch.where(inv > 0, 1 / inv.clamp_min(1e-300), torch.full_like(z, hi)).clamp(lo, hi), z
        if bool(((z - previous).abs() <= 1e-13 * z).all()):
            break
    return z[:, None] * a_bar


def logit_ensembles(k: int, seed: int) -> dict[str, torch.Tensor]:
    """Logit samples ``[M, N, K]`` (float32) from diverse to near-degenerate rows."""
    gen = torch.Generator().manual_seed(seed)
    n, m = 30, 10
    centre = torch.randn(1, n, k, generator=gen) * 2
    spread = lambda s: centre + s * torch.randn(m, n, k, generator=gen)  # noqa: E731
    return {
        "diverse": spread(1.0),
        "moderate": spread(0.3),
        "agreeing (z near the cap)": spread(0.03),
        "identical members": centre.expand(m, n, k).clone(),
        "almost identical": spread(1e-5),
        "confident (mass on one class)": spread(0.3) * 15,
        "confident, disagreeing": torch.randn(m, n, k, generator=gen) * 30,
        "two members": spread(0.5)[:2],
        "mixed rows": torch.cat([spread(1e-4)[:, :10], spread(0.5)[:, 10:20], spread(0.5)[:, 20:] * 20], 1),
    }


def test_digamma_gaps_match_mpmath():
    """g = ψ − ln and h = ψ₁ − 1/x from x = 1e−6 to 1e6 against mpmath at 30 digits, for each of
    Minka's vectorised steps (tolerances ≥ 10× the observed errors in the comments): the float64
    step's g sets the root, so it must be ≈ 1e−10; its h and the float32 steps only set step lengths
    or the start of the next step."""
    mp.mp.dps = 30
    x = torch.logspace(-6, 6, 601, dtype=torch.float64)
    points = [mp.mpf(v) for v in x.tolist()]
    g_ref = torch.tensor([float(mp.digamma(v) - mp.log(v)) for v in points], dtype=torch.float64)
    h_ref = torch.tensor([float(mp.psi(1, v) - 1 / v) for v in points], dtype=torch.float64)
    # (g rtol, h rtol) per step; observed: rough 1.1e-3, 1.4e-3; accurate 1.1e-5, 2.2e-4;
    # float64 4e-11, 3.2e-5
    tolerances = ((1.5e-2, 1.5e-2), (1.5e-4, 3e-3), (1e-9, 5e-4))
    assert _VECTORISED_STEPS[-1][-1] == torch.float64
    for step, (g_tol, h_tol) in zip(_VECTORISED_STEPS, tolerances, strict=True):
        shift, psi_terms, trigamma_terms, dtype = step
        g, h = digamma_gaps(x.to(dtype), shift, psi_terms, trigamma_terms)
        assert g.dtype == h.dtype == dtype
        assert_close(g.double(), g_ref, rtol=g_tol, what=f"{dtype} step (shift {shift}): ψ(x) − ln x")
        assert_close(h.double(), h_ref, rtol=h_tol, what=f"{dtype} step (shift {shift}): ψ₁(x) − 1/x")


@pytest.mark.parametrize("k", [3, 100, 1000])
def test_vectorised_minka_is_the_converged_fixed_point(k):
    """The same ᾱ, ᾰ: the vectorised steps land on the old iteration's converged root (to 1e−7:
    the float64 step's ``tol = 5e−4`` leaves Newton's ≈ 0.05·tol²)."""
    n_data = 20_000
    for name, logits in logit_ensembles(k, seed=k).items():
        mean_ft, mean_log_ft = old_sample_means(logits, GAMMA)
        m = logits.shape[0]
        ref = old_alpha(mean_ft, mean_log_ft, m, k, n_data)
        a_bar = mean_ft.double() / mean_ft.double().sum(-1, keepdim=True)
        z, iterations = fit_precision_vectorised(a_bar, a_bar.log(), mean_log_ft.double(), m, k, n_data)
        assert_close(z[:, None] * a_bar, ref, rtol=1e-7, what=f"{name}, K={k}: alpha vs the converged root")
        # the vectorised steps converge every row at K ≥ 100: none goes on to the exact (scalar ψ) loop
        assert iterations <= (k < 100), f"{name}, K={k}: {iterations} exact iterations"


def test_rows_left_moving_go_on_with_exact_steps():
    """A tolerance no float64 step can meet sends every interior row to the exact loop, which
    lands on the same root (the straggler path)."""
    k, n_data = 1000, 20_000
    logits = logit_ensembles(k, seed=5)["moderate"]
    mean_ft, mean_log_ft = old_sample_means(logits, GAMMA)
    a_bar = mean_ft.double() / mean_ft.double().sum(-1, keepdim=True)
    ref = old_alpha(mean_ft, mean_log_ft, 10, k, n_data)
    z, iterations = fit_precision_vectorised(
        a_bar, a_bar.log(), mean_log_ft.double(), 10, k, n_data, max_iter=5, tol=1e-300
    )
    assert iterations == 5
    assert_close(z[:, None] * a_bar, ref, rtol=1e-9, what="alpha after the exact steps")


@pytest.mark.parametrize("gamma", [GAMMA, 0.0])
def test_sample_means_are_the_smoothed_means(gamma):
    """The fused [N, M, K] pass equals the plain float64 means of f̃ and ln f̃ (to float32 rounding)."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 10, 50, generator=gen) * 8  # [N, M, K]; tails below γ/K
    ft = torch.softmax(logits.double(), -1) * (1 - gamma) + gamma / 50
    a_bar, log_a_bar, a_log = normalised_means(sample_means(logits, gamma))
    ref = ft.mean(1) / ft.mean(1).sum(-1, keepdim=True)
    assert_close(a_bar, ref, rtol=1e-6, what="ᾱ")
    assert_close(log_a_bar, ref.log(), atol=1e-6, what="ln ᾱ")
    assert_close(a_log, ft.log().mean(1), rtol=1e-6, atol=1e-6, what="ᾰ")


@pytest.mark.parametrize("members", [10, 1])
def test_predictive_alpha_is_the_old_algorithms(members):
    """α of the whole predictive (GEMM, fused means, vectorised Minka, sub-chunks) against the old
    algorithm to full convergence on the same heads, with diverse, agreeing and near-identical
    members and overconfident inputs; the bridge's diag Σ and μ follow."""
    k, d, n_data = 1000, 64, 20_000
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(k, d, generator=gen) / d**0.5 * 3
    noise = torch.randn(members, k, d, generator=gen)
    phi = torch.randn(90, d, generator=gen).relu()
    # overconfident rows (most classes under the smoothing floor γ/K) interleaved with the others, so
    # that each of the Minka/bridge blocks (65 rows at K = 1000) holds rows with interior z
    phi[::3] *= 10
    for spread in (0.5, 0.2, 0.02, 1e-6):
        params = {"weight": w + spread * noise, "bias": torch.zeros(members, k)}
        post = DirichletFVIPosterior(
            "ensemble", Subset.LAST_LAYER, params, torch.ones(k), members, n_data, 0.01, 0.0, 0
        )
        lg = post.logit_gaussian(phi)
        logits = torch.stack([F.linear(phi, params["weight"][i]) for i in range(members)])
        ref = old_alpha(*old_sample_means(logits, GAMMA), members, k, n_data)
        what = f"spread {spread}, M={members}: alpha vs the old algorithm"
        assert_close(lg.alpha, ref, rtol=1e-6, what=what)
        inv = 1 / ref
        var = inv * (1 - 2 / k) + inv.sum(-1, keepdim=True) / k**2
        assert_close(lg.var, var, rtol=1e-6, what=f"spread {spread}: bridge variances")
        log_ref = ref.log()
        assert_close(lg.mean, log_ref - log_ref.mean(-1, keepdim=True), atol=1e-6, what="bridge means")
        assert math.isclose(float(post.alpha_features(phi).sub(lg.alpha).abs().max()), 0.0)
        if members > 1 and spread == 0.2:  # interior z in the second block too
            z = lg.alpha[MINKA_ROWS:].sum(-1)
            assert bool(((z > 1.01 * k) & (z < 0.99 * n_data)).any())
