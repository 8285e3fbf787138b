"""Dirichlet fVI (VI-SPEC A): Minka, the eq. 6 KL and its gradient, label-smoothing equivalence,
the Laplace-bridge currency, post-hoc and from-scratch families, save/load."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import minimize_scalar
from scipy.special import gammaln
from tolerance import assert_below, assert_close

from bayescli.data import load_data
from bayescli.dirichlet import (
    dirichlet_from_samples,
    dirichlet_to_gaussian,
    dirichlet_to_gaussian_diag,
    fit_precision,
    log_density,
)
from bayescli.errors import BayescliError
from bayescli.fitting.fit_source import FitSource
from bayescli.models.features import extract_features
from bayescli.models.specs import Classifier, ModelSpec, build_network, last_linear_name, load_classifier
from bayescli.options import Subset
from bayescli.posterior.base import load_posterior
from bayescli.posterior.selection import Criterion
from bayescli.posterior.vi.dirichlet_fvi import PRINCIPLED_RULE, TAU_GRID, dirichlet_nll, fit
from bayescli.posterior.vi.dirichlet_fvi_objective import (
    GAMMA,
    dirichlet_kl,
    fvi_loss,
    parse_beta,
    posterior_alpha,
)
from bayescli.posterior.vi.dirichlet_fvi_posterior import DirichletFVIPosterior
from bayescli.posterior.vi.dirichlet_fvi_samples import head_logits
from bayescli.posterior.vi.dirichlet_fvi_settings import FAMILIES, DirichletFVIConfig, default_tau
from bayescli.predictive.dirichlet import bridge_alpha, laplace_bridge
from bayescli.predictive.links import apply_link
from bayescli.training import dirichlet_fvi as scratch
from bayescli.training.classifier import TrainConfig, channel_stats, save_checkpoint, train_classifier

CPU = torch.device("cpu")
# float64 elementwise formulas over K ≤ 100 terms: rounding ≲ K·eps ≈ 2e-14 relative; 1e-10 keeps
# a margin above 10³ (observed ≤ 1e-14 below)
F64 = 1e-10


def smoothed(logits: torch.Tensor, gamma: float = GAMMA) -> torch.Tensor:
    """``f̃ = (1 − γ) softmax + γ/K`` written out independently of the module."""
    return (1 - gamma) * logits.softmax(-1) + gamma / logits.shape[-1]


# -- A-1 (a): Minka ------------------------------------------------------------------------------


def test_minka_recovers_the_precision_of_dirichlet_draws():
    conc = torch.tensor([2.0, 5.0, 1.0, 8.0], dtype=torch.float64)
    torch.manual_seed(0)
    draws = torch.distributions.Dirichlet(conc).sample((20_000,))
    a_bar = draws.mean(0, keepdim=True)
    a_bar = a_bar / a_bar.sum()
    a_log = draws.log().mean(0, keepdim=True)
    z, iterations = fit_precision(a_bar, a_log, 20_000, 4, 1e6)
    # Oracle: the fixed-mean MLE by bounded 1-D maximisation of the Dirichlet log-likelihood (scipy).
    ab, al = a_bar[0].numpy(), a_log[0].numpy()

    def neg_loglik(log_z: float) -> float:
        s = math.exp(log_z)
        return -(gammaln(s) - gammaln(s * ab).sum() + ((s * ab - 1) * al).sum())

    best = math.exp(minimize_scalar(neg_loglik, bounds=(0, 10), method="bounded", options={"xatol": 1e-12}).x)
    # Minka stops at |Δz| ≤ 1e-5·z after a quadratically converging step, so it sits ≲ 1e-8 from the
    # optimum (observed 2e-8); 1e-6 leaves a 50× margin
    assert_close(z, best, rtol=1e-6, what="Minka vs fixed-mean MLE")
    # The brief's check: within 1% of the true z = 16 (observed 15.98, 0.13%). The estimator's spread
    # at n = 2e4 is 0.58% (SD over 20 seeds), so 1% is a 1.7-SD bound that holds for this seed; the
    # MLE comparison above is what guards the implementation.
    assert_close(z, 16.0, rtol=0.01, what="Minka z vs the true precision")
    assert iterations <= 5


def test_minka_masking_matches_rows_solved_alone_and_handles_edges():
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(6, 9, 5, generator=gen, dtype=torch.float64) * 2, -1)
    probs[:, 3] = probs[0, 3]  # identical samples: no spread → z = upper bound
    probs[:, 4] = torch.softmax(torch.randn(6, 5, generator=gen, dtype=torch.float64) * 30, -1)  # → z = K
    a_bar, a_log = probs.mean(0), probs.log().mean(0)
    z, _ = fit_precision(a_bar, a_log, 6, 5, 1e4)
    alone = torch.cat([fit_precision(a_bar[i : i + 1], a_log[i : i + 1], 6, 5, 1e4)[0] for i in range(9)])
    # masking only skips finished rows; their arithmetic is the same operations in the same order
    assert_close(z, alone, rtol=1e-14, what="masked batch vs rows alone")
    assert z[3] == 1e4 and z[4] == 5
    one, _ = fit_precision(a_bar, a_log, 1, 5, 777.0)
    assert bool((one == 777.0).all())  # M = 1 ⇒ z = z_max [000:F]
    # smoothing is applied before the fit
    g = 0.01
    assert_close(
        dirichlet_from_samples(probs, smoothing=g, max_precision=1e4),
        dirichlet_from_samples((1 - g) * probs + g / 5, max_precision=1e4),
        rtol=F64,
        what="smoothing inside dirichlet_from_samples",
    )


def reference_alpha(mean_ft: torch.Tensor, mean_log_ft: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """The spec's Minka (VI-SPEC A1) written out plainly, from the sample means of f̃ and ln f̃:
    float64, Stirling's start, undamped Newton steps on 1/z for every row (no masking), clamped
    to [lo, hi], until no row moves by more than 1e-13 relative (≤ 200 steps)."""
    a_bar, a_log = mean_ft.double(), mean_log_ft.double()
    a_bar = a_bar / a_bar.sum(-1, keepdim=True)
    k = a_bar.shape[-1]
    z = ((k - 1) / (-2 * (a_bar * (a_log - a_bar.log())).sum(-1))).clamp(lo, hi)
    for _ in range(200):
        zab = z[:, None] * a_bar
        d1 = torch.digamma(z) - (a_bar * torch.digamma(zab)).sum(-1) + (a_bar * a_log).sum(-1)
        d2 = torch.polygamma(1, z) - (a_bar**2 * torch.polygamma(1, zab)).sum(-1)
        inv = 1 / z + d1 / (z**2 * d2)
        z, previous = torch.where(inv > 0, 1 / inv, torch.full_like(z, hi)).clamp(lo, hi), z
        if bool(((z - previous).abs() <= 1e-13 * z).all()):
            break
    return z[:, None] * a_bar


def sample_means(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Means over members of f̃ and ln f̃ in the logits' dtype (float32, as the module averages)."""
    ft = smoothed(logits)
    return ft.mean(0), ft.log().mean(0)


def ensembles(k: int, seed: int) -> dict[str, torch.Tensor]:
    """Logit ensembles [M, N, K] (float32, as the predictive sees them) from easy to near-degenerate."""
    gen = torch.Generator().manual_seed(seed)
    n, m = 40, 10
    centre = torch.randn(1, n, k, generator=gen) * 2
    spread = lambda s: centre + s * torch.randn(m, n, k, generator=gen)  # noqa: E731
    return {
        "diverse": spread(1.0),
        "moderate": spread(0.3),
        "agreeing": spread(0.03),  # z near or at the cap N
        "almost identical": spread(1e-5),
        "confident": spread(0.3) * 15,  # members put ~all mass on one class
        "confident, disagreeing": torch.randn(m, n, k, generator=gen) * 30,
        "two members": spread(0.5)[:2],
        "mixed rows": torch.cat([spread(1e-4)[:, :10], spread(0.5)[:, 10:20], spread(0.5)[:, 20:] * 20], 1),
    }


@pytest.mark.parametrize("k", [3, 10, 100, 1000])
def test_fast_minka_is_the_plain_fixed_point(k):
    """posterior_alpha (the KL's Minka: fit_precision_vectorised, also the predictive's) equals the
    plain fixed point to 1e-6 relative (issue 25 part 4)."""
    n_data = 20_000
    for name, logits in ensembles(k, seed=k).items():
        means = sample_means(logits)
        ref = reference_alpha(*means, k, n_data)
        alpha, iterations = posterior_alpha(*means, logits.shape[0], n_data)
        # the same inputs: only Minka differs; its root is within ~1e-8 of the converged one
        assert_close(alpha, ref, rtol=1e-6, what=f"{name} ensemble, K={k}: alpha vs the plain fixed point")
        # the vectorised steps leave at most one exact (scalar ψ) iteration, none at K ≥ 100
        assert iterations <= (k < 100), f"{name}, K={k}: {iterations} exact Minka iterations"


def test_fast_minka_predictive_matches_the_plain_fixed_point_without_exact_steps():
    k, members, d = 1000, 10, 64
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(k, d, generator=gen) / d**0.5 * 3
    params = {"weight": w + 0.2 * torch.randn(members, k, d, generator=gen), "bias": torch.zeros(members, k)}
    post = DirichletFVIPosterior(
        "ensemble", Subset.LAST_LAYER, params, torch.ones(k), members, 20_000, 0.01, 0.0, 0
    )
    phi = torch.randn(300, d, generator=gen).relu()
    lg = post.logit_gaussian(phi)
    logits = torch.stack([F.linear(phi, params["weight"][i]) for i in range(members)])
    ref = reference_alpha(*sample_means(logits), k, 20_000)
    assert 1.2 * k < float(ref.sum(-1).median()) < 0.8 * 20_000  # interior z: the iteration matters
    assert_close(lg.alpha, ref, rtol=1e-6, what="predictive alpha vs the plain fixed point")
    mu, var = dirichlet_to_gaussian_diag(ref)
    assert_close(lg.var, var, rtol=1e-6, what="bridge variances")
    assert_close(lg.mean, mu, atol=1e-6, what="bridge means")
    # the KL's Minka is the predictive's: its vectorised steps converge every row (the old rule took
    # 3 exact steps, the float32 start of issue 25 part 4 one)
    assert posterior_alpha(*sample_means(logits), members, 20_000)[1] == 0


# -- A-1 (b), (c): the KL and its gradient ---------------------------------------------------------


def test_kl_is_eq6_and_its_gradient_is_the_surrogate():
    gen = torch.Generator().manual_seed(3)
    m, s, k, n_data = 5, 7, 4, 3000
    logits = (torch.randn(m, s, k, generator=gen, dtype=torch.float64) * 1.5).requires_grad_()
    beta = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)
    kl, z, _ = dirichlet_kl(logits, beta, n_data)
    (grad,) = torch.autograd.grad(kl.sum(), logits)

    ft = smoothed(logits)
    alpha = dirichlet_from_samples(ft.detach(), max_precision=n_data, min_precision=k, max_iter=50)
    # the KL's Minka (fit_precision_vectorised) skips the confirming iteration: the same root to 1e-6
    assert_close(z, alpha.sum(-1), rtol=1e-6, what="the KL's z is Minka's on the smoothed samples")
    alpha = alpha * (z / alpha.sum(-1))[:, None]  # eq. 6 with the KL's own α
    literal = (log_density(alpha, ft.detach()) - log_density(beta.expand(s, k), ft.detach())).mean(0)
    assert_close(kl, literal, rtol=F64, atol=F64, what="eq. 6 value")
    surrogate = ((alpha - beta) * ft.log()).sum(-1).mean(0)  # (1/M) Σ_m Σ_k (sg α_k − β_k) ln f̃_k
    (expected,) = torch.autograd.grad(surrogate.sum(), logits)
    # float64 autograd of two algebraically equal graphs; α up to 3e3 scales the terms: 1e-8 absolute
    # on gradients of order 1e2 (observed ≲ 1e-12)
    assert_close(grad, expected, atol=1e-8, what="autograd of eq. 6 vs the surrogate")
    assert float(grad.abs().max()) > 0.1  # not vacuous


@pytest.mark.parametrize("z", [4, 100, 5000])
def test_map_kl_gradient_is_a_uniform_target_cross_entropy_for_any_z(z):
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(1, 6, 4, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    beta = torch.tensor([1.0, 1.0, 2.0, 0.5], dtype=torch.float64)
    kl, zs, _ = dirichlet_kl(logits, beta, z)  # M = 1 ⇒ z = z_max
    assert_close(zs, float(z), rtol=F64, what="M=1 gives z = z_max")
    (grad,) = torch.autograd.grad(kl.sum(), logits)
    (expected,) = torch.autograd.grad(-(beta * smoothed(logits).log()).sum(), logits)
    # z·Σ_k f̃_k ∇ln f̃_k = z ∇Σ_k f̃_k = 0 up to rounding of z·eps ≈ 1e-12 at z = 5000
    assert_close(grad, expected, atol=1e-9, what=f"M=1 KL gradient vs -Σ β ln f̃ (z={z})")


def test_fvi_loss_parts():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 8, 5, generator=gen, dtype=torch.float64)
    extra = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    labels = torch.randint(5, (8,), generator=gen)
    beta = torch.ones(5, dtype=torch.float64)
    nll = torch.stack([F.cross_entropy(lg, labels) for lg in logits]).mean()
    loss0, _ = fvi_loss(logits, labels, beta, 0.0, 100)
    assert_close(loss0, nll, rtol=F64, what="tau=0 is the mean cross-entropy")
    loss, stats = fvi_loss(logits, labels, beta, 0.7, 100, extra)
    kl_all = dirichlet_kl(logits, beta, 100)[0].sum() + dirichlet_kl(extra, beta, 100)[0].sum()
    assert_close(loss, nll + 0.7 / 100 * kl_all, rtol=F64, what="NLL + (tau/N) sum over batch and index")
    assert set(stats) == {"nll", "kl", "z", "minka_iterations"}


# -- A-1 (d) and the currency ------------------------------------------------------------------------


def head_posterior(k: int, d: int = 6, members: int = 4, seed: int = 6) -> DirichletFVIPosterior:
    gen = torch.Generator().manual_seed(seed)
    params = {
        "weight": torch.randn(members, k, d, generator=gen, dtype=torch.float64),
        "bias": torch.randn(members, k, generator=gen, dtype=torch.float64),
    }
    beta = torch.ones(k, dtype=torch.float64)
    return DirichletFVIPosterior("ensemble", Subset.LAST_LAYER, params, beta, members, 5000, 1.0, 0.0, 0)


@pytest.mark.parametrize("k", [5, 100])
def test_bridge_round_trip_and_links(k):
    post = head_posterior(k)
    phi = torch.randn(30, 6, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    lg = post.logit_gaussian(phi)
    alpha = post.alpha_features(phi)
    assert torch.equal(lg.alpha, alpha) and not lg.exact
    # the predictive is Minka's Dirichlet of the members' smoothed softmax, z in [K, N]
    members = torch.stack([F.linear(phi, w, b) for w, b in zip(*post.params.values(), strict=True)])
    ref = dirichlet_from_samples(
        members.softmax(-1), 50, min_precision=k, max_precision=5000, smoothing=GAMMA
    )
    # the same Minka root; fit_precision_vectorised stops without the confirming iteration (issue 25
    # part 4's bound: 1e-6 relative; observed ≲ 1e-8 at K = 5)
    assert_close(alpha, ref, rtol=1e-6, what=f"predictive alpha vs dirichlet_from_samples, K={k}")
    assert float(alpha.sum(-1).min()) >= k - 1e-9  # z ≥ K
    # the forward map then eq. 7: float64 logs/exps of α spanning ~1e-3..1e3, rounding ≲ 1e-14
    # relative (observed 4e-16); 1e-12 is the brief's bound
    assert_close(
        bridge_alpha(lg.mean, lg.var), alpha, rtol=1e-12, what=f"alpha -> (mu, Sigma) -> alpha, K={k}"
    )
    assert apply_link(lg, "bridge").alpha is lg.alpha
    probs = alpha / alpha.sum(-1, keepdim=True)
    assert_close(apply_link(lg, "none").probs, probs, rtol=1e-12, what="softmax(mu) is the Dirichlet mean")
    mu, cov = dirichlet_to_gaussian(alpha)
    mu_d, var_d = dirichlet_to_gaussian_diag(alpha)
    assert_close(mu_d, mu, rtol=F64, atol=F64, what="diag forward map: mean")
    assert_close(var_d, cov.diagonal(dim1=1, dim2=2), rtol=F64, what="diag forward map: variances")
    if k <= 64:
        assert lg.cov is not None
        assert_close(lg.cov, cov, rtol=F64, atol=F64, what="cov")
        # Σ1 = 0 (rank K−1): row sums cancel to rounding of terms ≤ 1/min α
        assert_below(lg.cov.sum(-1).abs().max() * alpha.min(), 1e-12, what="Sigma 1 = 0")
        assert_close(laplace_bridge(lg.mean, lg.cov, "zero-sum"), alpha, rtol=1e-12, what="zero-sum bridge")
        mc = apply_link(lg, "mc", samples=64, generator=torch.Generator().manual_seed(0)).probs
        assert torch.isfinite(mc).all()  # rank-deficient Σ: the Cholesky jitter copes
    else:
        assert lg.cov is None


# -- heads -------------------------------------------------------------------------------------------


def test_ensemble_heads_are_one_matmul_equal_to_a_loop():
    post = head_posterior(5)
    phi = torch.randn(11, 6, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    out = head_logits("ensemble", post.params, phi, 4, None, 0.0)
    loop = torch.stack(
        [F.linear(phi, w, b) for w, b in zip(post.params["weight"], post.params["bias"], strict=True)]
    )
    assert_close(out, loop, rtol=F64, atol=F64, what="batched heads vs a loop")


def test_mfvi_local_reparameterisation_matches_weight_sampling():
    gen = torch.Generator().manual_seed(9)
    k, d, n = 3, 4, 40_000
    w, b = torch.randn(1, k, d, generator=gen), torch.randn(1, k, generator=gen)
    w_std, b_std = torch.rand(k, d, generator=gen) * 0.5, torch.rand(k, generator=gen) * 0.5
    phi = torch.randn(2, d, generator=gen)
    params = {"weight": w, "bias": b, "weight_std": w_std, "bias_std": b_std}
    local = head_logits("mfvi", params, phi, n, gen, 0.0)  # [n, 2, K]
    ws = w[0] + w_std * torch.randn(n, k, d, generator=gen)
    bs = b[0] + b_std * torch.randn(n, k, generator=gen)
    explicit = torch.einsum("nkd,id->nik", ws, phi) + bs[:, None]
    se = explicit.std(0) * math.sqrt(2 / n)  # SE of a difference of two n-sample means
    # both are n-sample estimates: means differ by ≤ 5 SE, variances by ≤ 5·√2·√(2/n) relative
    z_mean = ((local.mean(0) - explicit.mean(0)) / se).abs()
    assert_below(z_mean, 5.0, what="mfvi mean (standard errors)")
    assert_close(
        local.var(0), explicit.var(0), rtol=5 * math.sqrt(2) * math.sqrt(2 / n), what="mfvi variance"
    )


def test_dropout_head_is_unbiased():
    gen = torch.Generator().manual_seed(10)
    w, b = torch.randn(1, 3, 5, generator=gen), torch.randn(1, 3, generator=gen)
    phi = torch.randn(2, 5, generator=gen)
    n = 40_000
    out = head_logits("dropout", {"weight": w, "bias": b}, phi, n, gen, 0.2)
    z_mean = (out.mean(0) - F.linear(phi, w[0], b[0])).abs() / (out.std(0) / math.sqrt(n))
    assert_below(z_mean, 5.0, what="E[dropout logits] (standard errors)")


# -- MAP-fVI is label smoothing ------------------------------------------------------------------


def label_smoothing_reference(train, tau: float, batch: int, epochs: int, seed: int) -> Classifier:
    """Plain cross-entropy with label smoothing ε = Kc/(1+Kc), c = τ|batch|/N, scaled by 1/(1−ε)
    (then its gradient equals MAP-fVI's up to γ), with the same init, batches and Adam."""
    torch.manual_seed(seed)
    net = build_network(ModelSpec.parse("builtin:mlp"), 10, train.input_shape, {"hidden": 32, "depth": 1})
    mean, std = channel_stats(train)
    clf = Classifier(net, last_linear_name(net), mean, std)
    opt = torch.optim.Adam(clf.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    n = len(train)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, batch):
            idx = perm[start : start + batch]
            c = tau * len(idx) / n
            eps = 10 * c / (1 + 10 * c)
            loss = F.cross_entropy(clf(train.inputs(idx)), train.y[idx], label_smoothing=eps) / (1 - eps)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return clf


@pytest.mark.parametrize(("smoothing", "bound"), [(0.0, 1e-5), (GAMMA, 1e-3)])
def test_map_fvi_equals_label_smoothing(smoothing, bound):
    train, test = load_data("digits:train"), load_data("digits:test")
    cfg = DirichletFVIConfig(
        family="map",
        tau=1.0,
        epochs=10,
        batch_size=128,
        seed=3,
        model_kwargs="hidden=32,depth=1",
        smoothing=smoothing,
    )
    clf, meta, post = scratch.train("builtin:mlp", train, None, cfg, CPU)
    ref = label_smoothing_reference(train, 1.0, 128, 10, 3)
    with torch.no_grad():
        x = test.inputs(slice(None))
        gap = (clf(x).softmax(-1) - ref(x).softmax(-1)).abs().max()
    # γ = 0: the gradients are equal, only float32 rounding differs (observed 8e-7 after 100 Adam
    # steps; 1e-5 leaves 10×). γ = 1e-4 (the seed's): the gradients differ by O(γ) (observed gap
    # 2.0e-4; 1e-3 is the brief's bound).
    assert_below(gap, bound, what=f"MAP-fVI vs label smoothing test probabilities (gamma={smoothing})")
    assert post.family == "map" and post.members == 1 and meta["training"]["method"] == "dirichlet-fvi"


# -- fits, files ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("dfvi") / "mlp.safetensors"
    clf, meta = train_classifier(
        "builtin:mlp", load_data("digits:train"), None, TrainConfig(epochs=4, seed=0)
    )
    save_checkpoint(path, clf, meta)
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_post_hoc_families_fit_save_and_load(family, mlp_ckpt, tmp_path):
    model = load_classifier("builtin:mlp", mlp_ckpt)
    train, test = load_data("digits:train"), load_data("digits:test")
    cfg = DirichletFVIConfig(family=family, members=3, epochs=2, batch_size=128)
    post = fit(FitSource(model, train), cfg)
    phi = model.classifier.features(test.inputs(slice(0, 50))).detach()
    lg = post.logit_gaussian(phi)
    assert lg.alpha.shape == (50, 10) and lg.cov.shape == (50, 10, 10)
    # no validation data: the seed's effective KL weight at this N (τ = N/60,000 for K = 10)
    assert post.members == (1 if family == "map" else 3) and post.tau == len(train) / 60_000
    assert post.metadata()["selection"] == {
        "method": "default",
        "validated": False,
        "setting": "tau",
        "chosen": post.tau,
        "rule": PRINCIPLED_RULE,
    }
    assert {"history", "fit_seconds", "config"} <= set(post.meta) and post.selection is not None
    assert math.isfinite(post.meta["history"][-1]["loss"])
    post.save(tmp_path / "p.safetensors")
    back = load_posterior(tmp_path / "p.safetensors")
    assert isinstance(back, DirichletFVIPosterior) and back.family == family
    assert torch.equal(back.logit_gaussian(phi).alpha, lg.alpha)  # same tensors, same seeded noise
    assert back.summary()["family"] == family and back.summary()["tau_method"] == "default"
    draws = back.sample_logits(6, model.classifier, None, phi, torch.Generator().manual_seed(0))
    assert draws.shape == (6, 50, 10)


def test_ensemble_members_start_apart_and_stay_diverse(mlp_ckpt):
    model = load_classifier("builtin:mlp", mlp_ckpt)
    cfg = DirichletFVIConfig(family="ensemble", members=3, epochs=1, batch_size=128)
    post = fit(FitSource(model, load_data("digits:train")), cfg)
    w = post.params["weight"]
    spread = (w - w.mean(0)).square().mean().sqrt() / model.classifier.head.weight.square().mean().sqrt()
    assert float(spread.detach()) > 0.02  # started ~0.1·rms apart (0.08 expected for 3 members)


def test_explicit_tau_is_used_as_given_and_select_false_skips_validation(mlp_ckpt):
    model = load_classifier("builtin:mlp", mlp_ckpt)
    source = FitSource(model, load_data("digits:train"), load_data("digits:val"))
    post = fit(source, DirichletFVIConfig(family="map", tau=0.3, epochs=1))
    assert post.tau == 0.3 and post.metadata()["selection"]["method"] == "fixed"
    assert not post.metadata()["selection"]["validated"]
    post = fit(source, DirichletFVIConfig(family="map", epochs=1, select=False))
    assert post.metadata()["selection"]["method"] == "default"
    assert not source.has_features(source.val)  # neither fit needed the validation features


@pytest.mark.parametrize("index_data", ["rotate:90,180", "noise:uniform", "pool"])
def test_index_data_enriches_the_kl(index_data, mlp_ckpt):
    model = load_classifier("builtin:mlp", mlp_ckpt)
    train = load_data("digits:train")
    source = FitSource(model, train)
    base = fit(source, DirichletFVIConfig(family="map", epochs=1))
    given = load_data("digits:test") if index_data == "pool" else index_data
    cfg = DirichletFVIConfig(family="map", epochs=1, index_data=given)
    assert cfg.data_specs() == {}  # keywords and loaded Data need no loading by the caller
    post = fit(source, cfg)
    assert post.meta["index_data"] == ("digits:test" if index_data == "pool" else index_data)
    # the same labelled batches, more index points: the KL term differs
    assert post.meta["history"][0]["kl"] != base.meta["history"][0]["kl"]


def test_an_index_data_spec_is_the_callers_to_load(mlp_ckpt):
    model = load_classifier("builtin:mlp", mlp_ckpt)
    cfg = DirichletFVIConfig(family="map", epochs=1, index_data="digits:test")
    assert cfg.data_specs() == {"index_data": "digits:test"}
    source = FitSource(model, load_data("digits:train"))
    with pytest.raises(BayescliError, match="index_data 'digits:test' is a data spec"):
        fit(source, cfg)
    loaded = dataclasses.replace(cfg, index_data=load_data("digits:test"))
    assert loaded.data_specs() == {}
    assert fit(source, loaded).meta["config"]["index_data"] == "digits:test"
    with pytest.raises(BayescliError, match="same shape"):
        cropped = load_data("digits:test").map_inputs(lambda x: x[..., :4], shape=(1, 8, 4))
        fit(source, dataclasses.replace(cfg, index_data=cropped))


@pytest.mark.parametrize("family", ["ensemble", "mfvi", "dropout"])
def test_from_scratch_families_checkpoint_and_posterior_round_trip(family, tmp_path):
    train = load_data("digits:train")
    x = load_data("digits:test").inputs(slice(0, 40))
    cfg = DirichletFVIConfig(
        family=family,
        members=3,
        epochs=2,
        batch_size=128,
        model_kwargs="hidden=16,depth=1",
        normalisation="pm1",
        index_data="rotate:90" if family == "dropout" else None,
    )
    clf, meta, post = scratch.train("builtin:mlp", train, None, cfg, CPU)
    assert post.subset is Subset.ALL and meta["model_kwargs"] == {"hidden": 16, "depth": 1}
    assert meta["normalisation"] == {"mean": [0.5], "std": [0.5]}
    save_checkpoint(tmp_path / "c.safetensors", clf, meta)
    post.save(tmp_path / "p.safetensors")
    loaded = load_classifier("builtin:mlp", tmp_path / "c.safetensors")
    back = load_posterior(tmp_path / "p.safetensors")
    alpha = post.alpha_inputs(clf, x)
    assert torch.equal(back.alpha_inputs(loaded.classifier, x), alpha)
    lg = back.logit_gaussian_inputs(loaded.classifier, x)
    assert torch.equal(lg.alpha, alpha)
    draws = back.sample_logits(4, loaded.classifier, x, None, torch.Generator().manual_seed(0))
    assert draws.shape == (4, 40, 10)
    with pytest.raises(BayescliError):
        back.logit_gaussian(torch.zeros(2, 16))
    if family == "ensemble":  # member 0 is the checkpoint
        assert_close(draws[0], clf(x).detach(), rtol=1e-6, atol=1e-6, what="member 0 = checkpoint")


def test_from_scratch_select_trains_one_network_per_grid_point_and_keeps_the_best():
    train, val = load_data("digits:train"), load_data("digits:val")
    cfg = DirichletFVIConfig(
        family="map", epochs=1, batch_size=128, model_kwargs="hidden=8,depth=1", select=True
    )
    clf, meta, post = scratch.train("builtin:mlp", train, val, cfg, CPU)
    record = post.metadata()["selection"]
    assert record["validated"] and record["extensions"] == 0  # each point is a training run
    assert record["grid"] == [default_tau(10) * f for f in TAU_GRID] and meta["training"]["tau"] == post.tau
    best = min(record["curve"], key=lambda row: row["nll"])
    assert post.tau == record["chosen"] == best["tau"]
    alpha = post.alpha_inputs(clf, val.inputs(slice(None)))
    # the returned network and posterior are the chosen run's: its validation NLL, recomputed
    assert_close(dirichlet_nll(alpha, val.y), best["nll"], rtol=1e-12, what="validation NLL of the kept run")
    without = scratch.train("builtin:mlp", train, val, dataclasses.replace(cfg, select=None), CPU)[2]
    assert without.tau == default_tau(10) and without.metadata()["selection"]["method"] == "default"


def test_parsing_and_bad_input(mlp_ckpt):
    assert default_tau(10) == 1.0 and default_tau(100) == 0.1 and default_tau(1000) == 0.01
    samples = {f: DirichletFVIConfig(family=f, members=4).step_samples for f in FAMILIES}
    assert samples == {"ensemble": 4, "mfvi": 4, "map": 1, "dropout": 1}
    assert torch.equal(parse_beta(2.0, 3), torch.full((3,), 2.0, dtype=torch.float64))
    assert parse_beta("1,2,3", 3).tolist() == [1.0, 2.0, 3.0]
    assert scratch.parse_model_kwargs("hidden=50, depth=2,act=relu") == {
        "hidden": 50,
        "depth": 2,
        "act": "relu",
    }
    for bad in ("1,2", "0", "x"):
        with pytest.raises(BayescliError):
            parse_beta(bad, 3)
    bad_settings = (
        ({"family": "laplace"}, "unknown family 'laplace'"),
        ({"family": "ensemble", "members": 1}, "an ensemble needs members >= 2"),
        ({"tau": -1.0}, "tau must be >= 0"),
        ({"select": True, "tau": 0.5}, "select=True chooses tau on validation data, but tau = 0.5"),
        ({"select_by": "auc"}, "select_by must be one of nll, ece, brier"),
        ({"index_data": 3}, "index_data must be a keyword"),
    )
    for values, message in bad_settings:
        with pytest.raises(BayescliError, match=message):
            DirichletFVIConfig(**values)
    assert DirichletFVIConfig(select_by="brier").select_by is Criterion.BRIER
    model = load_classifier("builtin:mlp", mlp_ckpt)
    train = load_data("digits:train")
    source = FitSource(model, train)
    with pytest.raises(BayescliError, match="give validation data"):
        fit(source, DirichletFVIConfig(select=True))
    with pytest.raises(BayescliError, match="subset last-layer"):
        fit(source, DirichletFVIConfig(subset="all"))
    with pytest.raises(BayescliError, match="builtin models"):
        scratch.train("timm:resnet18", train, None, DirichletFVIConfig(), CPU)
    with pytest.raises(BayescliError, match="give labelled validation data"):
        scratch.train("builtin:mlp", train, None, DirichletFVIConfig(select=True), CPU)
    with pytest.raises(BayescliError):
        scratch.parse_model_kwargs("hidden")


def test_predict_defaults_to_the_dirichlet_mean_and_labels_links_through_its_gaussian_image(
    mlp_ckpt, cli, tmp_path
):
    """Issue 23 part 3: a Dirichlet fVI posterior is its own predictive. ``predict`` without
    ``--link`` returns ``α/α₀`` exactly; any other link reads the Gaussian image of that
    Dirichlet and is labelled an approximation (method name, JSON field) and ``--link mc`` warns."""
    path = tmp_path / "d.safetensors"
    fit_cmd = ("fit-vi", "--method", "dirichlet-fvi", "--model", "builtin:mlp", "--checkpoint", mlp_ckpt)
    # On the CPU (the reference below runs there), fit and predict; the reference takes the
    # features in predict's own batches, so α is the same computation and equal to the last bit.
    cpu = ("--device", "cpu")
    fit_cmd = (*fit_cmd, "--data", "digits:train", "--set", "members=3", "--set", "epochs=2", *cpu)
    assert cli(*fit_cmd, "--out", path).code == 0
    model, post = load_classifier("builtin:mlp", mlp_ckpt), load_posterior(path)
    native = post.alpha_features(extract_features(model, load_data("digits:test")).phi)
    common = ("predict", "--posterior", path, "--data", "digits:test", *cpu)

    res = cli(*common, "--out", tmp_path / "p.safetensors")
    assert res.code == 0 and "glm-bridge" in res.out and "gaussian image" not in res.out
    from safetensors.torch import load_file

    arrays = load_file(tmp_path / "p.safetensors")
    probs, alpha = arrays["probs"], arrays["alpha"]
    assert torch.equal(alpha, native.to(alpha.dtype))  # the posterior's own α, not a bridge of a Gaussian
    # α/α₀: the bridge's mean is softmax(log α) (finite at α = ∞), which rounds differently from the
    # division: a few float32 ulps (2⁻²⁴ ≈ 6e-8 each) through exp, sum and divide; 1e-6 is ≥ 10× that
    ratio = alpha.double() / alpha.double().sum(-1, keepdim=True)
    assert_close(probs.double(), ratio, rtol=1e-6, atol=1e-12, what="probs = α/α₀")
    res = cli(*common, "--json")
    report = json.loads(res.out)
    assert report["link"] == "bridge" and report["approximation"] is None

    res = cli(*common, "--link", "mc", "--samples", "200", "--json")
    report = json.loads(res.out)
    assert res.code == 0 and report["link"] == "mc"
    assert report["approximation"] == "gaussian image of the Dirichlet (inverse Laplace bridge)"
    assert set(report["results"]) == {"map", "glm-mc (gaussian image)"}
    assert "--link mc on a dirichlet-fvi posterior samples the gaussian image" in res.err
    report = json.loads(cli(*common, "--link", "probit", "--json").out)
    assert "glm-probit (gaussian image)" in report["results"] and report["approximation"]
