"""The Dirichlet fVI predictive's fast path (issue 25 part 4): vectorised ψ/ψ₁ gaps, Minka from
them, the member-by-member head GEMMs and the float64 sample means give the α of the float64
estimator of the same float32 softmax samples (float64 smoothing, means and logs, ``torch.digamma``/
``polygamma`` Minka from Stirling's start run to full convergence) to far better than 1e-6 relative."""

import math

import mpmath as mp
import pytest
import torch
from tolerance import assert_close

from bayescli.dirichlet import _VECTORISED_STEPS, digamma_gaps, fit_precision_vectorised
from bayescli.options import Subset
from bayescli.posterior.vi.dirichlet_fvi_posterior import (
    DirichletFVIPosterior,
    normalised_means,
    sample_means,
)
from bayescli.posterior.vi.dirichlet_fvi_samples import ensemble_member_logits, head_logits

GAMMA = 1e-4


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


def float64_means(logits: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 estimator's sample stage on ``logits [M, N, K]``: the float32 softmax (the samples,
    as in training) widened, then the means over members of ``f̃ = (1 − γ) p + γ/K`` and ``ln f̃``."""
    ft = torch.softmax(logits, -1).double() * (1 - gamma) + gamma / logits.shape[-1]
    if gamma == 0:  # ln f = log_softmax: float64 from the same float32 logits
        return ft.mean(0), torch.log_softmax(logits.double(), -1).mean(0)
    return ft.mean(0), ft.log().mean(0)


@pytest.mark.parametrize(
    ("gamma", "members", "classes"),
    [(GAMMA, 10, 50), (0.0, 10, 50), (GAMMA, 3, 50), (GAMMA, 1, 50), (GAMMA, 120, 50), (1e-30, 25, 7)],
)
def test_sample_means_are_the_smoothed_means(gamma, members, classes):
    """``sample_means`` equals the plain float64 means of f̃ and ln f̃ of the float32 softmax, to float64
    rounding: with tails under the smoothing floor γ/K, and with so many members (120 at K = 50) or
    so small a floor (γ = 1e−30) that the product of the factors p + c ≥ c is taken in several runs
    (one run would underflow: c¹²⁰ ≈ 1e−684, c²⁵ ≈ 1e−791)."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(members, 7, classes, generator=gen) * 8  # [M, N, K]
    mean_ft, mean_log_ft = float64_means(logits, gamma)
    a_bar, log_a_bar, a_log = normalised_means(sample_means(logits, gamma))
    ref = mean_ft / mean_ft.sum(-1, keepdim=True)
    assert_close(a_bar, ref, rtol=1e-12, what="ᾱ")
    assert_close(log_a_bar, ref.log(), atol=1e-12, what="ln ᾱ")
    # γ = 0: float32 log_softmax, rounded to ≈ 2e−7 relative of |ln p| ≤ 60 here (observed 6e−8)
    rtol = 2e-6 if gamma == 0 else 1e-12
    assert_close(a_log, mean_log_ft, rtol=rtol, atol=1e-12, what="ᾰ")


def test_ensemble_member_logits_are_the_stacked_heads():
    """One GEMM per member into the buffer gives head_logits' members (to float32 GEMM rounding)."""
    gen = torch.Generator().manual_seed(3)
    params = {"weight": torch.randn(4, 30, 16, generator=gen), "bias": torch.randn(4, 30, generator=gen)}
    phi = torch.randn(11, 16, generator=gen)
    buffer = torch.full((4, 20, 30), math.nan)
    out = ensemble_member_logits(params, phi, buffer)
    assert out.shape == (4, 11, 30) and out.data_ptr() == buffer.data_ptr()
    exact = (
        torch.einsum("nd,mkd->mnk", phi.double(), params["weight"].double())
        + params["bias"].double()[:, None]
    )
    assert_close(out.double(), exact, rtol=1e-5, atol=1e-5, what="member logits")
    assert_close(
        out, head_logits("ensemble", params, phi, 4, None, 0.0), rtol=1e-5, atol=1e-5, what="vs stacked"
    )


@pytest.mark.parametrize("members", [10, 3, 1])
def test_predictive_alpha_is_the_float64_estimator(members, monkeypatch):
    """α of the whole predictive (member GEMMs, float64 means, vectorised Minka, bridge) against the
    float64 estimator of the same member logits' float32 softmax run to full convergence, with
    diverse, agreeing and near-identical members and overconfident inputs; the bridge's diag Σ and
    μ follow. The chunks are cut small (20-row member chunks, 7-row sample-mean passes, 9-row Minka
    blocks) so that every boundary is crossed; to 1e−7 (the vectorised steps' tol leaves ≈ 1e−8).
    The reference takes the very logits the predictive computed: a float32 GEMM's rounding depends
    on its shape and thread count, and moves the smallest probabilities by ~1e−6."""
    k, d, n_data = 1000, 64, 20_000
    module = "bayescli.posterior.vi.dirichlet_fvi_posterior"
    recorded = []

    def recording(params: dict, phi: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        out = ensemble_member_logits(params, phi, buffer)
        recorded.append(out.clone())
        return out

    monkeypatch.setattr(f"{module}.ensemble_member_logits", recording)
    monkeypatch.setattr(f"{module}.MEMBER_CHUNK_ELEMENTS", 20 * k)
    monkeypatch.setattr(f"{module}.CACHE_CHUNK_ELEMENTS", 7 * k * members)
    monkeypatch.setattr(f"{module}.MINKA_CHUNK_ELEMENTS", 9 * k)
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(k, d, generator=gen) / d**0.5 * 3
    noise = torch.randn(members, k, d, generator=gen)
    phi = torch.randn(90, d, generator=gen).relu()
    # overconfident rows (most classes under the smoothing floor γ/K) interleaved with the others, so
    # that each Minka block holds rows with interior z
    phi[::3] *= 10
    for spread in (0.5, 0.2, 0.02, 1e-6):
        params = {"weight": w + spread * noise, "bias": torch.zeros(members, k)}
        post = DirichletFVIPosterior(
            "ensemble", Subset.LAST_LAYER, params, torch.ones(k), members, n_data, 0.01, 0.0, 0
        )
        recorded.clear()
        lg = post.logit_gaussian(phi)
        logits = torch.cat(recorded, 1)
        assert logits.shape == (members, len(phi), k) and len(recorded) == 5  # 20-row chunks
        ref = old_alpha(*float64_means(logits, GAMMA), members, k, n_data)
        what = f"spread {spread}, M={members}: alpha vs the float64 estimator"
        assert_close(lg.alpha, ref, rtol=1e-7, what=what)
        inv = 1 / ref
        var = inv * (1 - 2 / k) + inv.sum(-1, keepdim=True) / k**2
        assert_close(lg.var, var, rtol=1e-7, what=f"spread {spread}: bridge variances")
        log_ref = ref.log()
        assert_close(lg.mean, log_ref - log_ref.mean(-1, keepdim=True), atol=1e-7, what="bridge means")
        assert math.isclose(float(post.alpha_features(phi).sub(lg.alpha).abs().max()), 0.0)
        if members > 1 and spread == 0.2:  # interior z in the last member chunk and Minka block too
            z = lg.alpha[81:].sum(-1)
            assert bool(((z > 1.01 * k) & (z < 0.99 * n_data)).any())
