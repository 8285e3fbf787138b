"""Link fidelity: KL(MC ‖ link) against the exact predictive of two-class Gaussians (1-D
Gauss–Hermite quadrature of E[σ(z₁ − z₂)]), and its warnings."""

import numpy as np
import torch
from scipy.special import expit, softmax
from tolerance import assert_below, assert_close

from bayescli import devices
from bayescli.options import BridgeCorrection
from bayescli.posterior.gaussian import LogitGaussian
from bayescli.predictive import dirichlet
from bayescli.predictive.fidelity import (
    FIDELITY_INPUTS,
    FIDELITY_SAMPLES,
    MIN_SAMPLES,
    fidelity_inputs,
    fidelity_samples,
    link_fidelity,
)
from bayescli.predictive.links import bridge, monte_carlo, probit


def _exact_two_class(mu: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """E[σ(d)] and sd[σ(d)] for d = z₁ − z₂ ~ N(μ₁ − μ₂, v₁ + v₂) (200-node Gauss–Hermite:
    exact to ~1e-15 for these smooth integrands)."""
    x, w = np.polynomial.hermite_e.hermegauss(200)
    w = w / w.sum()
    d = (mu[:, 0] - mu[:, 1])[:, None] + np.sqrt(var.sum(1))[:, None] * x[None, :]
    s = expit(d)
    mean = (s * w).sum(1)
    return mean, np.sqrt((s**2 * w).sum(1) - mean**2)


def _kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return (p * np.log(p / q)).sum(1)


def test_kl_to_links_against_exact_two_class_predictive():
    rng = np.random.default_rng(0)
    mu, var = rng.normal(0, 2, (6, 2)), rng.uniform(0.5, 9, (6, 2))
    lg = LogitGaussian(torch.from_numpy(mu), torch.from_numpy(var))
    samples = 10_000
    res, _ = link_fidelity(lg, None, samples, seed=0)
    p1, sd = _exact_two_class(mu, var)
    exact = np.c_[p1, 1 - p1]
    links = {
        "probit": probit(lg).numpy(),
        "bridge": dirichlet.mean(bridge(lg)).numpy(),
        "map": softmax(mu, axis=1),
    }
    for name, q in links.items():
        # KL(p̂ ‖ q) − KL(p ‖ q) ≈ Δp₁·(log(p₁/q₁) − log(p₂/q₂)) + Δp₁²/(2 p₁ p₂) with
        # |Δp₁| ≤ 6 SE, SE = sd/√M (the MC mean's standard error): a per-input bound, averaged
        se = sd / np.sqrt(samples)
        slope = np.abs(np.log(exact[:, 0] / q[:, 0]) - np.log(exact[:, 1] / q[:, 1]))
        bound = (6 * se * slope + (6 * se) ** 2 / (2 * exact[:, 0] * exact[:, 1])).mean()
        assert_close(res[name]["kl_mean"], _kl(exact, q).mean(), atol=bound, what=f"KL(MC ‖ {name})")


def test_point_mass_links_agree_and_bridge_does_not():
    """With Σ → 0 the MC predictive, probit and SODPP all become softmax(μ); the bridge mean
    does not (α_k ∝ 1 − 2/K + e^{μ_k} Σ_l e^{−μ_l} / K², not e^{μ_k}) — the effect the link
    fidelity section exists to show."""
    rng = np.random.default_rng(1)
    mu = torch.from_numpy(rng.normal(0, 3, (20, 5)))
    lg = LogitGaussian(mu, torch.full_like(mu, 1e-10))
    res, warnings = link_fidelity(lg, None, 2000, seed=0, threshold=0.01)
    # first-order effect of Σ = 1e-10 I on the predictive: KL ~ 1e-20, MC noise ~ 1e-10·K/M
    for name in ("map", "probit", "sodpp"):
        assert_below(res[name]["kl_mean"], 1e-8, what=f"KL(MC ‖ {name}) at a point mass")
    # zero-sum correction of σ²I: μ ← μ − mean(μ), diag Σ ← σ²(1 − 1/K); then eq. 7's mean
    m = mu.numpy() - mu.numpy().mean(1, keepdims=True)
    k = m.shape[1]
    raw = 1 - 2 / k + np.exp(m) * np.exp(-m).sum(1, keepdims=True) / k**2
    expected = _kl(softmax(mu.numpy(), axis=1), raw / raw.sum(1, keepdims=True)).mean()
    # MC of a 1e-10-variance Gaussian is softmax(μ) to ~1e-5 relative in p, ~1e-5 in this KL
    assert_close(res["bridge"]["kl_mean"], expected, rtol=1e-3, what="KL(MC ‖ bridge) at a point mass")
    assert expected > 0.01 and any(w.startswith("the bridge link") for w in warnings)
    _, only = link_fidelity(lg, None, 2000, seed=0, threshold=0.01, warn_for={"probit"})
    assert only == []  # warnings only for the links asked about


def test_fidelity_inputs_budget():
    # MAX_WORK = 6.4e7 multiply-adds, 10× the default 32 inputs × 2000 draws × K² at K = 10
    assert fidelity_inputs(10_000, 10, "eig", FIDELITY_INPUTS, FIDELITY_SAMPLES) == 32
    assert fidelity_inputs(10_000, 10, "eig", 1000, 2000) == 320  # 6.4e7 / (2000 · 100)
    assert fidelity_inputs(20, 10, "diag", 256, 2000) == 20
    assert fidelity_inputs(10_000, 10, "diag", 256, 2000) == 256  # 6.4e7 / (2000 · 10) = 3200
    assert fidelity_inputs(10_000, 1000, "eig", 256, 2000) == 8  # 6.4e7 / (2000 · 1e6) → the minimum
    assert fidelity_inputs(10_000, 1000, "diag", 256, 2000) == 32  # 6.4e7 / (2000 · 1e3)


def test_fidelity_samples_budget():
    """Draws are cut only where the inputs are already at their minimum, never below 1000."""
    assert fidelity_samples(32, 10, "eig", FIDELITY_SAMPLES) == FIDELITY_SAMPLES
    assert fidelity_samples(8, 100, "eig", 10_000) == MIN_SAMPLES  # 800 affordable → the floor
    assert fidelity_samples(8, 30, "eig", 10_000) == 8888  # 6.4e7 / (8 · 900)
    assert fidelity_samples(8, 1000, "eig", 2000) == MIN_SAMPLES  # 8 affordable → the floor
    assert fidelity_samples(8, 1000, "eig", 500) == 500  # never more than asked


def test_fidelity_defaults_agree():
    """The CLI, the config and the API run the check on FIDELITY_INPUTS by default."""
    import inspect

    from bayescli.cli.evaluate import evaluate_cmd
    from bayescli.evaluation.config import BaselineConfig
    from bayescli.evaluation.evaluate import evaluate

    assert BaselineConfig().fidelity_inputs == FIDELITY_INPUTS
    assert inspect.signature(evaluate).parameters["fidelity_inputs"].default == FIDELITY_INPUTS
    assert inspect.signature(evaluate_cmd).parameters["fidelity_inputs"].default == FIDELITY_INPUTS


def test_a_degenerate_bridge_is_null_with_a_reason_never_nan():
    """Issue 23: at logit variances ≈ 0 (a huge prior precision δ) the norm-corrected bridge's
    Dirichlet is not finite; its fidelity row is null with the reason, not NaN, and the report
    (JSON) holds no NaN."""
    import json

    rng = np.random.default_rng(1)
    mu = torch.from_numpy(rng.normal(0, 3, (20, 5)))
    lg = LogitGaussian(mu, torch.full_like(mu, 1e-10))
    assert not torch.isfinite(bridge(lg, BridgeCorrection.NORM)).all()  # the case: α overflows
    res, warnings = link_fidelity(lg, torch.zeros(20, dtype=torch.long), 500, seed=0)
    row = res["bridge-norm"]
    assert row["kl_mean"] is None and row["kl_max"] is None and row["nll"] is None
    assert "logit variances ≈ 0" in row["undefined"] and "20 of 20" in row["undefined"]
    assert any(w.startswith("link fidelity of bridge-norm: undefined") for w in warnings)
    json.dumps(res, allow_nan=False)  # raises on any NaN or infinity
    assert res["bridge"]["kl_mean"] > 0  # the other links keep their numbers


def test_a_native_dirichlet_is_the_reference_and_mc_through_its_gaussian_image_an_approximation():
    """Issue 23 part 3. For the Gaussian image of a native Dirichlet (``lg.alpha``) the reference
    is ``α/α₀``: the bridge returns it (KL exactly 0), MC through the image is a link compared
    with it and labelled an approximation. The image is poor for ``α_k < 1``: with one class at
    α = 6 and the others from 0.5 down to 1e-4 (a fitted digits posterior's values: 75 % of its
    α are < 1, the median row's smallest 1.3e-4), ``Σ_kk ≈ 1/α_k`` and
    ``E[exp z_k] ∝ α_k exp(Σ_kk/2)`` put the MC predictive's mass on the smallest-α class."""
    base = torch.tensor([6.0, 0.5, 0.2, 0.07, 0.03, 0.01, 3e-3, 1e-3, 3e-4, 1e-4], dtype=torch.float64)
    alpha = torch.stack([base.roll(i % 10) for i in range(30)])
    mu, cov = dirichlet.dirichlet_to_gaussian(alpha)
    lg = LogitGaussian(mu, cov.diagonal(dim1=1, dim2=2).clone(), cov, alpha=alpha, exact=False)
    labels = torch.arange(30) % 10
    res, warnings = link_fidelity(lg, labels, 2000, seed=0, threshold=0.05)
    ref = alpha / alpha.sum(-1, keepdim=True)
    assert res["dirichlet"]["reference"] is True
    assert_close(res["dirichlet"]["nll"], -np.log(6 / base.sum().item()), rtol=1e-12, what="Dirichlet NLL")
    for name in ("bridge", "bridge-none", "bridge-norm"):
        assert res[name]["kl_mean"] == 0 and "approximation" not in res[name]
    mc = monte_carlo(lg, 2000, devices.generator(lg.mean.device, 0)).probs.double()
    expected = (ref * (ref.log() - mc.log())).sum(-1).mean().item()
    assert_close(res["mc"]["kl_mean"], expected, rtol=1e-9, what="KL(Dirichlet ‖ MC through the image)")
    assert res["mc"]["approximation"].startswith("gaussian image of the Dirichlet")
    assert res["probit"]["approximation"] == res["mc"]["approximation"] and "noise_floor" in res["mc"]
    assert (mc.argmax(-1) == alpha.argmin(-1)).all()  # the 17 %-accuracy mechanism
    log_w = mu + cov.diagonal(dim1=1, dim2=2) / 2  # log E[exp z_k] up to a constant
    assert (log_w.argmax(-1) == alpha.argmin(-1)).all()
    assert any(w.startswith("the mc link is") and "Dirichlet predictive" in w for w in warnings)
    # a plain Gaussian keeps MC as its reference
    plain, _ = link_fidelity(LogitGaussian(mu, cov.diagonal(dim1=1, dim2=2).clone(), cov), None, 500)
    assert "noise_floor" in plain["mc"] and "dirichlet" not in plain
    assert "approximation" not in plain["probit"]
