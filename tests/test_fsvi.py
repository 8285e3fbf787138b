"""FSVI (VI-SPEC part B): the closed-form function-space KL, its gradient, the linearised KL of
whole networks, predictives, fitting and files."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from oracles import autograd_jacobian
from tolerance import assert_below, assert_close
from torch.distributions import MultivariateNormal, kl_divergence
from torch.func import functional_call, jacrev

from bayescli.data import ArrayData, load_data
from bayescli.errors import BayescliError
from bayescli.fitting.fit_source import FitSource
from bayescli.models.specs import Classifier, load_classifier, mlp
from bayescli.options import Subset
from bayescli.posterior.base import load_posterior
from bayescli.posterior.gaussian import augment
from bayescli.posterior.vi.fsvi import FSVIConfig, FSVIPosterior, fit, fit_last_layer
from bayescli.posterior.vi.fsvi_context import augment_images, monochrome
from bayescli.posterior.vi.fsvi_objective import JITTER, expected_nll, function_kl
from bayescli.training import fsvi as scratch_fsvi
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier
from bayescli.training.fsvi import WholeNetQ

F64 = torch.float64


def weight_kl(mean: torch.Tensor, var: torch.Tensor, prior_var: float) -> torch.Tensor:
    """KL(N(mean, diag var) ‖ N(0, prior_var I)) over all entries (the weight-space KL)."""
    r = var / prior_var
    return 0.5 * (r + mean.square() / prior_var - 1 - r.log()).sum()


def dense_kl(feat_q, mean_q, var_q, prior_var, feat_p, mean_p, jitter):
    """Σ_k KL of the per-class C-dimensional Gaussians, built densely (torch.distributions)."""
    c = feat_q.shape[0]
    eye = torch.eye(c, dtype=F64)
    cov_p = prior_var * feat_p @ feat_p.T + jitter * eye
    total = 0.0
    for k in range(var_q.shape[0]):
        cov_q = feat_q @ torch.diag(var_q[k]) @ feat_q.T + jitter * eye
        total = total + kl_divergence(
            MultivariateNormal(mean_q[:, k], cov_q), MultivariateNormal(mean_p[:, k], cov_p)
        )
    return total


@pytest.fixture
def head6():
    """D = 6, K = 3 mean-field head (bias column last) and σ_p², float64."""
    gen = torch.Generator().manual_seed(0)
    mean = 0.5 * torch.randn(3, 7, generator=gen, dtype=F64)
    var = 0.05 + 0.5 * torch.rand(3, 7, generator=gen, dtype=F64)
    return mean, var, 0.7, gen


# ---------------------------------------------------------------------------------------------
# B-1: last layer
# ---------------------------------------------------------------------------------------------


def test_b1_function_kl_is_below_weight_kl_until_the_context_spans_the_features(head6):
    mean, var, prior_var, gen = head6
    wkl = weight_kl(mean, var, prior_var)
    for c in (3, 6):
        feat = augment(torch.randn(c, 6, generator=gen, dtype=F64))
        fkl = function_kl(feat, feat @ mean.T, var, prior_var)
        # C ≤ D: the KL sees a C-dimensional projection of the (D+1)-dim weights, strictly less
        # (measured 2.55 and 6.28 vs 7.73; float64 error ~1e-14, so any positive gap is real).
        assert_below(fkl / wkl, 0.9, what=f"fKL/wKL at C={c}")
    for c in (7, 20):
        feat = augment(torch.randn(c, 6, generator=gen, dtype=F64))
        # C ≥ D+1 and [Φ, 1] of full rank: equal. The jitter j adds O(j/λ_min(K_p)) (measured
        # 7e-10 at j = 1e-12·mean diag); at the default 1e-6 the shift is 7e-4 (C=7), 3e-5 (C=20).
        tiny = function_kl(feat, feat @ mean.T, var, prior_var, jitter=1e-12)
        assert_close(tiny, wkl, atol=1e-8, what=f"fKL = wKL at C={c}")
        default = function_kl(feat, feat @ mean.T, var, prior_var)
        assert_close(default, wkl, rtol=1e-3, what=f"fKL ≈ wKL at C={c}, default jitter {JITTER:g}")


def test_b1_closed_form_equals_dense_gaussian_kl(head6):
    mean, var, prior_var, gen = head6
    feat = augment(torch.randn(5, 6, generator=gen, dtype=F64))
    kl = function_kl(feat, feat @ mean.T, var, prior_var)
    jitter = JITTER * (prior_var * feat @ feat.T).diagonal().mean()
    oracle = dense_kl(feat, feat @ mean.T, var, prior_var, feat, torch.zeros(5, 3, dtype=F64), jitter)
    # float64 with κ(K_p) ≈ 1e3: agreement to 1e-12 relative (measured 2e-15).
    assert_close(kl, oracle, rtol=1e-11, what="closed-form vs dense KL")


def test_b1_logit_moments_match_head_weight_samples(head6):
    mean, var, prior_var, gen = head6
    post = FSVIPosterior(mean, var, Subset.LAST_LAYER, True, prior_var, 1.0)
    phi = torch.randn(4, 6, generator=gen, dtype=F64)
    lg = post.logit_gaussian(phi)
    assert lg.exact and lg.cov is None
    n = 100_000
    draws = post.sample_logits(n, None, None, phi, gen)  # [n, 4, 3]: logits at weight draws
    emp_mean, centred = draws.mean(0), draws - draws.mean(0)
    emp_var = centred.square().mean(0)
    # In standard errors (mean: √(var/n); variance: var·√(2/n) for Gaussian draws), below 5.
    assert_below(((emp_mean - lg.mean) / (lg.var / n).sqrt()).abs(), 5, what="logit means vs samples (SE)")
    assert_below(((emp_var - lg.var) / (lg.var * math.sqrt(2 / n))).abs(), 5, what="logit variances (SE)")
    cross = torch.einsum("mnk,mnl->nkl", centred, centred) / n
    sd = lg.var.sqrt()
    for k, l in ((0, 1), (0, 2), (1, 2)):
        # Independent classes: the sample covariance has SE √(var_k var_l / n).
        se = sd[:, k] * sd[:, l] / math.sqrt(n)
        assert_below((cross[:, k, l] / se).abs(), 5, what=f"cov of classes {k},{l} (SE)")


def test_kl_gradient_matches_autograd_through_dense_gaussians(head6):
    mean, var, prior_var, gen = head6
    c = 5
    feat = augment(torch.randn(c, 6, generator=gen, dtype=F64))
    feat_p = feat + 0.1 * torch.randn(c, 7, generator=gen, dtype=F64)
    mean_p = torch.randn(c, 3, generator=gen, dtype=F64)
    for prior_feats in (False, True):
        ours = [t.clone().requires_grad_(True) for t in (mean, var, feat)]
        theirs = [t.clone().requires_grad_(True) for t in (mean, var, feat)]
        fp = feat_p if prior_feats else None
        kl = function_kl(
            ours[2], ours[2] @ ours[0].T, ours[1], prior_var, fp, mean_p if prior_feats else None
        )
        kl.backward()
        fp_dense = feat_p if prior_feats else theirs[2]
        jitter = (JITTER * (prior_var * fp_dense @ fp_dense.T).diagonal().mean()).detach()
        mp = mean_p if prior_feats else torch.zeros(c, 3, dtype=F64)
        oracle = dense_kl(theirs[2], theirs[2] @ theirs[0].T, theirs[1], prior_var, fp_dense, mp, jitter)
        oracle.backward()
        assert_close(kl, oracle.detach(), rtol=1e-11, what="KL value")
        for name, a, b in zip(("mean", "var", "features"), ours, theirs, strict=True):
            # float64, κ(K) ≤ 1e4: gradients agree to ~1e-14 (measured); 1e-9 relative to the largest.
            assert_close(a.grad, b.grad, atol=1e-9 * b.grad.abs().max().item(), what=f"∂KL/∂{name}")


def test_class_subsampling_is_unbiased(head6):
    mean, var, prior_var, gen = head6
    feat = augment(torch.randn(4, 6, generator=gen, dtype=F64))
    full = function_kl(feat, feat @ mean.T, var, prior_var)
    # Uniform subsets of one class: the average over all three equals the full KL exactly.
    parts = [function_kl(feat, feat @ mean.T, var, prior_var, classes=torch.tensor([k])) for k in range(3)]
    assert_close(sum(parts) / 3, full, rtol=1e-12, what="mean over class subsets")


# ---------------------------------------------------------------------------------------------
# B-2: whole networks
# ---------------------------------------------------------------------------------------------


def _mlp_pair(seed: int = 0):
    """A 2-16-16-3 ReLU MLP at means μ = θ0 + 0.3·δ and its prior copy at θ0 (float64)."""
    torch.manual_seed(seed)
    net = mlp(3, (2,), hidden=16, depth=2).double()
    clf = Classifier(net, "5").double()
    prior = copy.deepcopy(clf).requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clf.net.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=F64))
    x = 2 * torch.randn(8, 2, generator=gen, dtype=F64)
    return clf, prior, x, gen


HEAD_VAR, PRIOR_HEAD_VAR = 0.05, 1.0


def _variances(clf: Classifier, feature_var: float, head_var: float) -> dict[str, torch.Tensor]:
    return {
        n: torch.full_like(p, head_var if n.startswith("5.") else feature_var)
        for n, p in clf.net.named_parameters()
    }


def _flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in d.values()])


def _logits(clf: Classifier, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``f(x; θ)`` flattened ``[C·K]`` for a flat parameter vector (vmappable)."""
    params, offset = {}, 0
    for name, p in clf.net.named_parameters():
        params[name] = theta[offset : offset + p.numel()].reshape(p.shape)
        offset += p.numel()
    return functional_call(clf.net, params, (x,)).reshape(-1)


def _linearised_kl(clf, prior, x, feature_var, jitter=0.0):
    """(i): KL of the linearised nets' logit Gaussians (dense CK × CK, autograd Jacobians)."""
    parts = []
    for net, head_var in ((clf, HEAD_VAR), (prior, PRIOR_HEAD_VAR)):
        theta = _flat(dict(net.net.named_parameters())).detach()
        jac = jacrev(lambda t, n=net: _logits(n, t, x))(theta)
        var = _flat(_variances(net, feature_var, head_var))
        cov = jac @ torch.diag(var) @ jac.T
        parts.append((_logits(net, theta, x).detach(), cov))
    # Per-class KL as implemented adds j·I to each class block; the dense oracle can match it.
    eye = jitter * torch.eye(parts[0][1].shape[0], dtype=F64)
    return kl_divergence(
        MultivariateNormal(parts[0][0], parts[0][1] + eye), MultivariateNormal(parts[1][0], parts[1][1] + eye)
    )


def _brute_force_kl(clf, prior, x, feature_var, gen, n=50_000, chunk=10_000):
    """(iii): Gaussian KL between the empirical moments of f(X_C) under n parameter draws."""
    fitted = []
    for net, head_var in ((clf, HEAD_VAR), (prior, PRIOR_HEAD_VAR)):
        theta = _flat(dict(net.net.named_parameters())).detach()
        std = _flat(_variances(net, feature_var, head_var)).sqrt()
        s1, s2 = 0.0, 0.0
        for _ in range(n // chunk):
            draws = theta + std * torch.randn(chunk, len(theta), generator=gen, dtype=F64)
            f = torch.vmap(lambda t, n_=net: _logits(n_, t, x))(draws)
            s1, s2 = s1 + f.sum(0), s2 + f.T @ f
        mu = s1 / n
        fitted.append(MultivariateNormal(mu, (s2 / n - torch.outer(mu, mu)) * n / (n - 1)))
    return kl_divergence(*fitted)


def _implementation_kl(clf, prior, x, feature_var, gen, draws):
    """(ii): the training step's KL (one feature sample, per-class head blocks), averaged."""
    logvar = {n: v.log() for n, v in _variances(clf, feature_var, HEAD_VAR).items()}
    q = WholeNetQ(clf, prior, logvar, PRIOR_HEAD_VAR)
    with torch.no_grad():
        return sum(q.kl(q.features(x, gen), x) for _ in range(draws)) / draws


def test_b2_linearised_kl_approaches_brute_force_as_the_variance_shrinks():
    clf, prior, x, gen = _mlp_pair()
    errors = {}
    for fv in (1e-2, 1e-4, 1e-6):
        brute = _brute_force_kl(clf, prior, x, fv, gen)
        lin = _linearised_kl(clf, prior, x, fv)
        impl = _implementation_kl(clf, prior, x, fv, gen, draws=100)
        errors[fv] = (abs(lin - brute) / brute).item(), (abs(impl - brute) / brute).item()
    # Measured (feature variance fv on all 320 feature weights, head var 0.05, prior head var 1,
    # C = 8, K = 3, ReLU): brute force 10.7 / 38.5 / 48.1; relative error of the linearised KL
    # 2.4 / 0.24 / 0.003, of the implementation 6.5 / 0.26 / 0.002. The brute-force KL of 24-dim
    # empirical moments from 5·10^4 draws scatters by ≈1% (seeds 0–2), which bounds the last column.
    for which, name in enumerate(("linearised", "implementation")):
        big, mid, small = (errors[fv][which] for fv in (1e-2, 1e-4, 1e-6))
        assert big > mid > small, f"{name}: errors {big:.3g}, {mid:.3g}, {small:.3g} do not shrink"
        assert_below(small, 0.1, what=f"{name} KL vs brute force at fv = 1e-6")
        assert_below(0.05, mid, what=f"{name} error at fv = 1e-4 stands out of the MC noise")


def test_b2_implementation_equals_linearised_kl_as_feature_variance_vanishes():
    clf, prior, x, gen = _mlp_pair(1)
    # The per-class jitter j = 1e-6·mean diag(K_p) of the implementation, added to the oracle.
    with torch.no_grad():
        f_p = augment(prior.features(x))
    jitter = (JITTER * PRIOR_HEAD_VAR * (f_p @ f_p.T).diagonal().mean()).item()
    # fv = 0: the same Gaussians, float64 algebra on κ ≈ 1e6 kernels (measured 2e-13 relative).
    # fv = e^-20 (FSVI's initial feature log-variance): one feature draw shifts the mean by
    # O(√fv·‖J_feat‖) and the feature covariance is dropped (measured 1.2e-5 over 200 draws).
    for fv, rtol in ((0.0, 1e-10), (math.exp(-20), 2e-4)):
        impl = _implementation_kl(clf, prior, x, fv, gen, draws=200)
        lin = _linearised_kl(clf, prior, x, fv, jitter)
        assert_close(impl, lin, rtol=rtol, what=f"implementation vs linearised KL at fv = {fv:.3g}")


# ---------------------------------------------------------------------------------------------
# objective, fitting, files
# ---------------------------------------------------------------------------------------------


def _synthetic(n=600, d=5, k=3, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w = 2 * torch.randn(k, d, generator=gen)
    phi = torch.randn(n, d, generator=gen).relu().to(dtype)
    labels = (phi.float() @ w.T + torch.randn(n, k, generator=gen)).argmax(1)
    head = torch.nn.Linear(d, k).to(dtype)
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.zero_()
    context = torch.rand(200, d, generator=gen).to(dtype)
    return phi, labels, head, context


def _objective(post_mean, post_var, phi, labels, context, prior_var):
    """Full-data objective: MC expected NLL (fixed draws) + KL on the whole context / N, float64."""
    mu, v = (augment(phi.double()) @ t.double().T for t in (post_mean, post_var))
    nll = expected_nll(mu, v, labels, 256, torch.Generator().manual_seed(5))
    f = augment(context.double())
    return nll + function_kl(f[:64], f[:64] @ post_mean.double().T, post_var.double(), prior_var) / len(phi)


def test_expected_nll_matches_gauss_hermite_quadrature():
    # Two classes: −log softmax(z)_1 = softplus(z_0 − z_1) with z_0 − z_1 ~ N(μ_0 − μ_1, v_0 + v_1).
    mean = torch.tensor([[0.3, 1.2], [2.0, -1.0], [0.0, 0.0]], dtype=F64)
    var = torch.tensor([[0.5, 0.2], [1.5, 0.7], [3.0, 1.0]], dtype=F64)
    labels = torch.tensor([1, 0, 1])
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    expected = []
    for m, v, y in zip(mean, var, labels, strict=True):
        d = (m[1 - y] - m[y]).item()
        z = d + math.sqrt(v.sum().item()) * nodes
        expected.append((weights * np.logaddexp(0, z)).sum() / math.sqrt(2 * math.pi))
    n = 200_000
    ours = expected_nll(mean, var, labels, n, torch.Generator().manual_seed(0))
    # MC over n draws: the per-draw batch mean has sd 0.38 (measured), SE = 0.38/√n = 8.5e-4; 5 SE.
    assert_close(ours, float(np.mean(expected)), atol=4.3e-3, what="expected NLL vs quadrature")


def test_fit_lowers_the_objective():
    phi, labels, head, context = _synthetic()
    cfg = FSVIConfig(epochs=30, batch_size=100, lr=3e-2, head_var_init=1e-3)
    post = fit_last_layer(phi, labels, head, context, cfg)
    w0 = torch.cat([head.weight, head.bias[:, None]], 1).detach()
    init_var = torch.full_like(w0, cfg.head_var_init * post.prior_var)
    before = _objective(w0, init_var, phi, labels, context, post.prior_var)
    after = _objective(post.mean, post.var, phi, labels, context, post.prior_var)
    # Measured 0.738 → 0.621. Common random numbers for both: the MC error of the difference is
    # ~1e-3 (256 draws × 600 inputs), so a drop of 0.02 is 20 standard errors.
    assert_below(after, before - 0.02, what="objective after fitting vs before − 0.02")
    # The variances matter too: with the fitted means but the initial variances it is 0.659.
    means_only = _objective(post.mean, init_var, phi, labels, context, post.prior_var)
    assert_below(after, means_only - 0.01, what="objective with fitted vs initial variances")
    curve = post.meta["training_curve"]
    assert curve[-1]["objective"] < curve[0]["objective"] and curve[-1]["kl"] < curve[0]["kl"]


def test_last_layer_save_load_round_trip(tmp_path):
    phi, labels, head, context = _synthetic()
    post = fit_last_layer(phi, labels, head, context, FSVIConfig(epochs=1, batch_size=200))
    post.meta["model"] = "builtin:small-cnn"
    path = tmp_path / "fsvi.safetensors"
    post.save(path)
    back = load_posterior(path)
    assert isinstance(back, FSVIPosterior) and back.subset is Subset.LAST_LAYER
    assert (back.mean == post.mean).all() and (back.var == post.var).all()
    assert back.prior_var == post.prior_var and back.hyperparameters == post.hyperparameters
    assert back.meta["training_curve"] == post.meta["training_curve"]
    assert back.own_metadata()["predictive"] == "exact-last-layer" and back.own_metadata()["exact"]
    a, b = post.logit_gaussian(phi), back.logit_gaussian(phi)
    assert (a.mean == b.mean).all() and (a.var == b.var).all()


def test_monochrome_images_draw_each_channel_from_its_pixel_distribution():
    # Channel 0: a quarter of all pixels are 255, the rest 0; channel 1: all 128.
    x = torch.zeros(40, 2, 4, 4, dtype=torch.uint8)
    x[:, 0, :2, :2] = 255
    x[:, 1] = 128
    data = ArrayData(x, None, ["a"])
    draws = monochrome(data, 20_000, torch.Generator().manual_seed(0))
    assert draws.shape == (20_000, 2, 4, 4)
    assert (draws == draws[:, :, :1, :1]).all(), "each channel is one value"
    assert (draws[:, 1] == 128 / 255).all()
    frac = (draws[:, 0, 0, 0] == 1.0).double().mean()
    # Binomial(20000, 1/4): SE = √(p(1−p)/n) = 0.0031; 5 SE.
    assert_close(
        frac, 0.25, atol=5 * math.sqrt(0.25 * 0.75 / 20_000), what="fraction of white channel-0 images"
    )
    flat = ArrayData(torch.tensor([[0.0, -1.0], [2.0, 1.0]]), None, ["a"])
    box = monochrome(flat, 1000, torch.Generator().manual_seed(0))
    assert (
        (box[:, 0] >= 0).all()
        and (box[:, 0] <= 2).all()
        and (box[:, 1] >= -1).all()
        and (box[:, 1] <= 1).all()
    )


def test_augment_moves_images_but_keeps_shape_and_range():
    x = torch.rand(16, 1, 12, 12, generator=torch.Generator().manual_seed(0))
    a = augment_images(x, torch.Generator().manual_seed(1))
    b = augment_images(x, torch.Generator().manual_seed(1))
    assert a.shape == x.shape and (a == b).all()
    assert a.min() >= 0 and a.max() <= 1 + 1e-6
    assert (a - x).abs().flatten(1).max(1).values.min() > 0.05, "every image is transformed"


# ---------------------------------------------------------------------------------------------
# pretrained checkpoints and from scratch
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_mlp(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsvi") / "mlp.safetensors"
    train = load_data("digits:train")
    clf, meta = train_classifier("builtin:mlp", train, None, TrainConfig(epochs=3))
    save_checkpoint(path, clf, meta)
    return load_classifier("builtin:mlp", path), train, load_data("digits:val")


@pytest.mark.parametrize("context", ["monochrome", "augment", "digits:test"])
def test_fit_on_a_checkpoint_with_each_context(digits_mlp, context):
    model, train, _ = digits_mlp
    cfg = FSVIConfig(context=context, epochs=1, context_pool=256)
    # A data spec is the caller's to load (here the whole split: the fit keeps 256 seeded rows).
    cfg = replace(cfg, **{name: load_data(spec) for name, spec in cfg.data_specs().items()})
    post = fit(FitSource(model, train), cfg)
    k, d = model.classifier.num_classes, model.classifier.feature_dim
    assert post.mean.shape == (k, d + 1) and (post.var > 0).all()
    assert post.meta["context_pool"] == 256 and post.hyperparameters["context"] == context
    # Zeros in the config resolve to the post-hoc defaults, and the file records the values used.
    used = post.hyperparameters
    assert (used["batch_size"], used["lr"], used["prior_scale"], post.prior_scale) == (512, 1e-2, 1.0, 1.0)
    assert post.meta["fit_seconds"] > 0
    assert post.selection.how == "default" and not post.metadata()["selection"]["validated"]


def test_data_specs_lists_only_specs_to_load():
    assert FSVIConfig().data_specs() == {} and FSVIConfig(context="augment").data_specs() == {}
    assert FSVIConfig(context="kmnist:train").data_specs() == {"context": "kmnist:train"}
    assert FSVIConfig(context=load_data("digits:test")).data_specs() == {}


def test_explicit_prior_scale_is_used_as_given(digits_mlp):
    model, train, val = digits_mlp
    post = fit(FitSource(model, train, val), FSVIConfig(epochs=1, prior_scale=4.0))
    sel = post.metadata()["selection"]
    assert post.prior_scale == 4.0 and (sel["method"], sel["validated"], sel["chosen"]) == (
        "fixed",
        False,
        4.0,
    )


def test_bad_settings_raise(digits_mlp):
    model, train, _ = digits_mlp
    source = FitSource(model, train)
    with pytest.raises(BayescliError, match="prior_scale must be > 0"):
        FSVIConfig(prior_scale=-1.0)
    with pytest.raises(BayescliError, match="leave prior_scale unset"):
        FSVIConfig(prior_scale=1.0, select=True)
    with pytest.raises(BayescliError, match=r"select=True chooses prior_scale on validation data: give"):
        fit(source, FSVIConfig(select=True))
    with pytest.raises(BayescliError, match="train all layers from scratch"):
        fit(source, FSVIConfig(subset="all"))
    with pytest.raises(BayescliError, match="'nonsense' is a data spec"):
        fit(source, FSVIConfig(context="nonsense"))
    with pytest.raises(BayescliError, match="augment needs image"):
        augment_images(torch.zeros(2, 5), torch.Generator())
    with pytest.raises(BayescliError, match="select_by must be nll, ece or brier"):
        FSVIConfig(select_by="nll2")


@pytest.fixture(scope="module")
def scratch():
    train = load_data("digits:train[:300]")
    cfg = FSVIConfig(subset="all", epochs=1, batch_size=64)
    clf, meta, post = scratch_fsvi.train("builtin:mlp", train, None, cfg, torch.device("cpu"))
    return clf, meta, post, train


def test_train_fsvi_returns_a_checkpoint_and_an_all_layer_posterior(scratch, tmp_path):
    clf, meta, post, train = scratch
    for key in ("model", "input_shape", "num_classes", "normalisation", "training", "train_loss"):
        assert key in meta
    assert meta["training"]["method"] == "fsvi"
    used = post.hyperparameters
    assert (used["subset"], used["batch_size"], used["lr"], used["head_var_init"]) == ("all", 64, 3e-3, 1e-3)
    assert used["prior_scale"] == post.prior_scale == 300.0
    assert post.subset is Subset.ALL and post.needs_inputs
    assert (post.mean == torch.cat([p.detach().reshape(-1) for p in clf.net.parameters()])).all()
    ckpt = tmp_path / "m.safetensors"
    save_checkpoint(ckpt, clf, meta)
    post.meta |= {"model": "builtin:mlp", "checkpoint": str(ckpt)}
    path = tmp_path / "p.safetensors"
    post.save(path)
    back = load_posterior(path)
    assert back.parameters == post.parameters and (back.var == post.var).all()
    assert back.own_metadata()["predictive"] == "glm" and not back.own_metadata()["exact"]
    loaded = load_classifier("builtin:mlp", ckpt)
    x = train.inputs(slice(0, 4))
    a, b = post.logit_gaussian_inputs(clf, x), back.logit_gaussian_inputs(loaded.classifier, x)
    assert_close(b.cov, a.cov, atol=1e-12, what="GLM covariance after a round trip")


def test_glm_predictive_equals_explicit_jacobian_push(scratch):
    clf, _, post, train = scratch
    x = train.inputs(slice(0, 3))
    lg = post.logit_gaussian_inputs(clf, x)
    assert not lg.exact
    jac = autograd_jacobian(clf.net, clf.normalise(x)).double()
    oracle = torch.einsum("nkp,p,nlp->nkl", jac, post.var.double(), jac)
    # float32 Jacobians: relative error ~1e-6 of the largest entry.
    assert_close(lg.cov, oracle, atol=1e-5 * oracle.abs().max().item(), what="J diag(σ²) Jᵀ")
    with torch.no_grad():
        assert_close(lg.mean, clf(x), atol=1e-5, what="GLM mean = f(x; μ)")


def test_bnn_samples_match_the_glm_moments_when_feature_variances_are_tiny(scratch):
    clf, _, post, train = scratch
    x = train.inputs(slice(0, 3))
    lg = post.logit_gaussian_inputs(clf, x)
    n = 2000
    draws = post.sample_logits(n, clf, x, None, torch.Generator().manual_seed(0)).double()
    # Feature variances ~e^-20: the logits are the head's exact Gaussian up to ~1e-4 relative;
    # the sample moments' standard errors dominate (5 SE).
    assert_below(((draws.mean(0) - lg.mean) / (lg.var / n).sqrt()).abs(), 5, what="BNN logit means (SE)")
    assert_below(((draws.var(0) - lg.var) / (lg.var * math.sqrt(2 / n))).abs(), 5, what="BNN logit var. (SE)")
    head = post.head_marginal(clf)
    with torch.no_grad():
        lg_head = head.logit_gaussian(clf.features(x))
    assert_close(lg_head.var, lg.var, rtol=1e-3, what="head marginal vs GLM variance")


def test_train_fsvi_rejects_other_architectures():
    train = load_data("digits:train[:50]")
    with pytest.raises(BayescliError, match="builtin"):
        scratch_fsvi.train("timm:resnet18", train, None, FSVIConfig(subset="all"), torch.device("cpu"))
