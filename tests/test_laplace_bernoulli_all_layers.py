"""All-layer Laplace for multi-label (bernoulli) classifiers: the diagonal and full curvature
(BackPACK and the per-input-Jacobian fallback; ggn, ef, ggn-mc) against autograd oracles on a
tiny conv + linear net, the per-label GLM predictive and the marginal likelihood against dense
linear algebra, and ``fit-laplace --subset all`` / ``predict`` end to end on composed digits,
where the validated δ must not be worse than MAP."""

import copy
import json
import math

import pytest
import torch
from oracles import autograd_jacobian
from tolerance import assert_below, assert_close

from bayescli import api
from bayescli.data.base import ArrayData
from bayescli.fitting.pipeline import ModelOptions
from bayescli.io import load_tensors
from bayescli.models.classifier import Classifier
from bayescli.models.features import Features
from bayescli.posterior import LaplacePosterior
from bayescli.posterior import network_curvature as nc
from bayescli.posterior.network_curvature import all_layer_curvature
from bayescli.predictive.glm import predict
from bayescli.predictive.sigmoid_links import apply_sigmoid_link, probit
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier

N, K = 30, 3


def tiny_conv() -> torch.nn.Sequential:
    """Conv 1→2 (3×3) on 6×6 images, tanh, linear 32 → 3: 119 parameters (float64)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 2, 3), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(32, K)
    )
    return net.double().eval()


@pytest.fixture(scope="module")
def problem():
    """The net, images ``x [N, 1, 6, 6]`` and labels ``[N, K]`` drawn from its sigmoids."""
    net = tiny_conv()
    gen = torch.Generator().manual_seed(1)
    x = 2 * torch.randn(N, 1, 6, 6, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        y = torch.bernoulli(net(x).sigmoid(), generator=gen).long()
    return net, x, y


def summed_bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, y.double(), reduction="sum")


def oracle_ggn(net, x, y) -> torch.Tensor:
    """``Σ_n J_nᵀ B_n J_n`` ``[P, P]``: ``J_n`` by autograd loops, ``B_n`` the autograd Hessian of
    the summed BCE w.r.t. the logits (``[N, K, N, K]``, zero across inputs)."""
    jac = autograd_jacobian(net, x)
    with torch.no_grad():
        logits = net(x)
    hess = torch.autograd.functional.hessian(lambda f: summed_bce(f, y), logits)
    blocks = torch.stack([hess[n, :, n, :] for n in range(len(x))])
    return torch.einsum("nkp,nkl,nlq->pq", jac, blocks, jac)


def per_input_gradients(net, x, y) -> torch.Tensor:
    """``∂ℓ_n/∂θ`` ``[N, P]`` of each input's BCE by autograd."""
    params = list(net.parameters())
    rows = []
    for xi, yi in zip(x, y, strict=True):
        grads = torch.autograd.grad(summed_bce(net(xi[None]), yi[None]), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def batches(x, y):
    return [(x[:17], None if y is None else y[:17]), (x[17:], None if y is None else y[17:])]


# float64 sums over N = 30 inputs of 119-parameter products: rounding ≲ 1e-14 relative
# (observed ≤ 3e-16); BackPACK and autograd order the sums differently. 1e-10 leaves 1000×.
F64_SUM = 1e-10


_FALLBACK = nc._all_layer_diag_jacobian


@pytest.fixture
def small_chunks(monkeypatch):
    """The fallback's Jacobian chunks hold 4 inputs: sums run over several chunks per batch; and
    ``all_layer_curvature``'s diagonal must come from BackPACK (a silent fallback would hide a
    broken BackPACK loss extension)."""
    monkeypatch.setattr(nc, "_JACOBIAN_FLOATS", 4 * K * sum(p.numel() for p in tiny_conv().parameters()))

    def refuse(*args, **kwargs):
        raise AssertionError("BackPACK fell back to per-input Jacobians")

    monkeypatch.setattr(nc, "_all_layer_diag_jacobian", refuse)


def fallback_diag(net, stream, curvature: str, seed: int = 0) -> torch.Tensor:
    """The per-input-Jacobian diagonal (what networks BackPACK cannot convert get)."""
    gen = torch.Generator().manual_seed(seed)
    return _FALLBACK(net, iter(stream), nc.CurvatureType(curvature), gen, "bernoulli").diag


@pytest.mark.parametrize("labelled", [True, False])
def test_diag_and_full_bernoulli_ggn_equal_autograd_oracle(problem, small_chunks, labelled):
    net, x, y = problem
    oracle = oracle_ggn(net, x, y)
    labels = y if labelled else None  # the exact GGN does not depend on the labels
    diag = all_layer_curvature(net, iter(batches(x, labels)), "diag", "ggn", likelihood="bernoulli")
    assert diag.n_data == N and diag.diag.shape == (oracle.shape[0],)
    assert_below(rel(diag.diag, oracle.diagonal()), F64_SUM, what="BackPACK diag Bernoulli GGN")
    fallback = fallback_diag(net, batches(x, labels), "ggn")
    assert_below(rel(fallback, oracle.diagonal()), F64_SUM, what="Jacobian-fallback diag Bernoulli GGN")
    full = all_layer_curvature(net, iter(batches(x, labels)), "full", "ggn", likelihood="bernoulli").full
    assert_below(rel(full, oracle), F64_SUM, what="full Bernoulli GGN")
    softmax = all_layer_curvature(net, iter(batches(x, None)), "diag", "ggn").diag
    assert rel(softmax, oracle.diagonal()) > 0.1  # the softmax GGN is another matrix


def test_empirical_fisher_equals_summed_squared_bce_gradients(problem, small_chunks):
    net, x, y = problem
    grads = per_input_gradients(net, x, y)
    ef = all_layer_curvature(net, iter(batches(x, y)), "diag", "ef", likelihood="bernoulli").diag
    assert_below(rel(ef, grads.square().sum(0)), F64_SUM, what="BackPACK diag Bernoulli EF")
    assert_below(
        rel(fallback_diag(net, batches(x, y), "ef"), grads.square().sum(0)), F64_SUM, what="fallback EF"
    )
    full = all_layer_curvature(net, iter(batches(x, y)), "full", "ef", likelihood="bernoulli").full
    assert_below(rel(full, grads.T @ grads), F64_SUM, what="full Bernoulli EF")


def test_mc_ggn_matches_the_expectation_over_every_label_vector(problem, monkeypatch):
    """One label vector ŷ ~ Bern(p) per input, squared into ``(J_nᵀ(p_n − ŷ))²``. Its mean and
    variance per input come from enumerating all 2^K label vectors; over R copies of the data the
    sum lies within 5 standard deviations of R × the mean (a 6e-7 chance per parameter)."""
    net, x, y = problem
    copies = 100
    jac = autograd_jacobian(net, x)
    with torch.no_grad():
        probs = net(x).sigmoid()
    mean = torch.zeros(jac.shape[0], jac.shape[2], dtype=torch.float64)  # per input [N, P]
    second = torch.zeros_like(mean)
    for bits in range(2**K):
        y_hat = torch.tensor([(bits >> k) & 1 for k in range(K)], dtype=torch.float64)
        weight = torch.where(y_hat == 1, probs, 1 - probs).prod(1)  # P(ŷ) per input [N]
        term = torch.einsum("nk,nkp->np", probs - y_hat, jac).square()
        mean += weight[:, None] * term
        second += weight[:, None] * term.square()
    # its expectation is the exact GGN; the copies' draws are independent
    sd = (copies * (second - mean.square()).sum(0)).sqrt()
    mean = mean.sum(0)
    assert_below(rel(mean, oracle_ggn(net, x, y).diagonal()), F64_SUM, what="E[MC-GGN] = GGN")
    x_rep, y_rep = x.repeat(copies, 1, 1, 1), y.repeat(copies, 1)
    monkeypatch.setattr(nc, "_all_layer_diag_jacobian", None)  # the first engine must be BackPACK
    for engine in ("backpack", "fallback"):
        stream = [(x_rep[i : i + 600], y_rep[i : i + 600]) for i in range(0, len(x_rep), 600)]
        if engine == "backpack":
            got = all_layer_curvature(net, iter(stream), "diag", "ggn-mc", 3, "bernoulli").diag
        else:
            got = fallback_diag(net, stream, "ggn-mc", seed=3)
        z = (got - copies * mean).abs() / sd
        assert_below(z.max().item(), 5.0, what=f"{engine} MC-GGN in standard deviations")


def fitted_posterior(net, x, y, structure: str) -> tuple[LaplacePosterior, Classifier]:
    clf = Classifier(net, "3")
    post = LaplacePosterior.fit_all_layers(clf, batches(x, y), structure, likelihood="bernoulli")
    return post, clf


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_per_label_logit_variances_equal_dense_j_inverse_precision_jt(problem, structure):
    net, x, y = problem
    post, clf = fitted_posterior(net, x, y, structure)
    assert post.likelihood == "bernoulli" and post.subset.value == "all"
    oracle = oracle_ggn(net, x, y)
    hessian = torch.diag(oracle.diagonal()) if structure == "diag" else oracle
    x_new = torch.randn(12, 1, 6, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    jac = autograd_jacobian(net, x_new)
    for delta in (0.05, 2.0):
        post.gaussian.with_delta(delta)
        lg = post.logit_gaussian_inputs(clf, x_new)
        cov = torch.linalg.inv(hessian + delta * torch.eye(len(hessian), dtype=torch.float64))
        expected = torch.einsum("nkp,pq,nkq->nk", jac, cov, jac)
        # float64 inverse of κ(H + δI) ≲ 1e4 here: ≲ κ·eps ≈ 1e-12 relative; 1e-8 leaves 1e4×
        assert_below(rel(lg.var, expected), 1e-8, what=f"per-label logit variances ({structure}, δ={delta})")
        with torch.no_grad():
            assert torch.equal(lg.mean, net(x_new))


def test_predict_maps_each_label_through_a_sigmoid_link(problem):
    net, x, y = problem
    net, x = copy.deepcopy(net).float(), x.float()  # data sets hold float32 inputs
    post, clf = fitted_posterior(net, x, y, "diag")
    post.set_prior_precision(0.5)
    data = ArrayData(x, y, [str(k) for k in range(K)])
    with torch.no_grad():
        feats = Features(torch.zeros(N, 1), net(x), y)
    lg = post.logit_gaussian_inputs(clf, x)  # one batch of 30; predict below runs batches of 8
    d_mean, d_var = reordering_bounds(net, x, lg.var)
    pred = predict(post, feats, classifier=clf, data=data, batch_size=8)
    expected = probit(lg.mean, lg.var)  # a sigmoid per label, not a softmax
    tol = propagated(probit, lg.mean, lg.var, d_mean, d_var)
    assert_below(((pred.probs - expected).abs() / tol).max(), 1.0, what="batched probit, in bounds")
    beta = predict(post, feats, link="beta", classifier=clf, data=data, batch_size=8)

    def beta_mi(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return apply_sigmoid_link(m, v, "beta").mutual_information

    tol = propagated(beta_mi, lg.mean, lg.var, d_mean, d_var)
    mi = beta.per_label.mutual_information
    assert_below(((mi - beta_mi(lg.mean, lg.var)).abs() / tol).max(), 1.0, what="batched beta MI, in bounds")


# Unit roundoff of float32 and Higham's γ_n = n·u / (1 − n·u): a float32 sum of n products
# computed in any order lies within γ_n·Σ|aᵢbᵢ| of the exact sum (Accuracy and Stability of
# Numerical Algorithms, §3.1), so two orders (a GEMM blocked for 8 rows vs 30, another thread
# count, another BLAS) differ by at most 2·γ_n·Σ|aᵢbᵢ|.
U32 = 2.0**-24
P_TINY = 119  # the longest float32 reduction here: the logit variance's sum over every parameter


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def reordering_bounds(net, x: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How far another summation order may move the float32 logit means and variances ``[N, K]``.

    Means: ``f = W·tanh(conv(x)) + b``; each of its sums has at most ``P_TINY`` terms, and the
    conv's rounding reaches ``f`` through tanh (1-Lipschitz) and ``|W|``, so ``Δf ≤ 2γ·S`` with
    ``S = |W|·(|h| + |Wc|∗|x| + |bc|) + |b|`` in float64. Variances: ``σ² = Σ_p J²_kp·s_p`` is a
    sum of non-negative terms (its absolute sum is σ² itself), each with a squared Jacobian entry
    that is itself a float32 sum, hence ``Δσ² ≤ 4γ·σ²``."""
    conv, _, _, lin = net
    xd = x.double()
    with torch.no_grad():
        h = torch.tanh(torch.nn.functional.conv2d(xd, conv.weight.double(), conv.bias.double()))
        conv_abs = torch.nn.functional.conv2d(xd.abs(), conv.weight.double().abs(), conv.bias.double().abs())
        reach = h.abs().flatten(1) + conv_abs.flatten(1)
        scale = reach @ lin.weight.double().abs().T + lin.bias.double().abs()
    g = gamma(P_TINY)
    return 2 * g * scale, 4 * g * var.double()


def propagated(fn, mean, var, d_mean, d_var) -> torch.Tensor:
    """First-order bound ``[N, K]`` ``|∂fn/∂μ|·Δμ + |∂fn/∂σ²|·Δσ² + 8u`` on an elementwise link
    ``fn(μ, σ²)``, derivatives by autograd in float64; ``8u`` covers the link's own float32
    evaluation (a few roundings of numbers ≤ 1)."""
    m = mean.detach().double().requires_grad_()
    v = var.detach().double().requires_grad_()
    dm, dv = torch.autograd.grad(fn(m, v).sum(), (m, v))
    return (dm.abs() * d_mean + dv.abs() * d_var + 8 * U32).detach()


def dense_log_marglik(net, x, y, hessian: torch.Tensor, delta: float) -> float:
    """``log p(D|θ*) − ½δ‖θ*‖² + (P/2) log δ − ½ log det(H + δI)`` with the Bernoulli likelihood
    (autograd's BCE) and a dense log-determinant."""
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    with torch.no_grad():
        log_lik = -summed_bce(net(x), y).item()
    p = theta.numel()
    _, logdet = torch.linalg.slogdet(hessian + delta * torch.eye(p, dtype=hessian.dtype))
    return log_lik - 0.5 * delta * theta.dot(theta).item() + 0.5 * p * math.log(delta) - 0.5 * logdet.item()


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_log_marglik_equals_dense_bernoulli_formula(problem, structure):
    net, x, y = problem
    post, _ = fitted_posterior(net, x, y, structure)
    oracle = oracle_ggn(net, x, y)
    hessian = torch.diag(oracle.diagonal()) if structure == "diag" else oracle
    norm = torch.linalg.matrix_norm(hessian, 2).item()
    p = hessian.shape[0]
    for delta in (1e-2, 0.3, 5.0, 200.0):
        expected = dense_log_marglik(net, x, y, hessian, delta)
        # log det error ≲ P·eps·κ, the log-likelihood a sum of N·K terms ≲ N·K·eps·|value|; 100×
        atol = 100 * p * 2.2e-16 * (norm / delta + 1) + 100 * N * K * 2.2e-16 * abs(expected)
        assert_close(post.log_marglik(delta), expected, atol=atol, what=f"marglik {structure} δ={delta:g}")


# -- composed digits, a bernoulli MLP, through the CLI ---------------------------------------------


@pytest.fixture(scope="module")
def multi_ckpt(tmp_path_factory):
    """An MLP with a sigmoid per digit trained on composed digits without weight decay long enough
    to be overconfident (validation per-label NLL 0.21)."""
    from bayescli.data import load_data

    path = tmp_path_factory.mktemp("multi_all") / "multi.safetensors"
    train, val = load_data("composed-digits:train"), load_data("composed-digits:val")
    clf, meta = train_classifier(
        "builtin:mlp", train, val, TrainConfig(epochs=40, seed=0, weight_decay=0.0), likelihood="bernoulli"
    )
    save_checkpoint(path, clf, meta)
    return path


def test_cli_all_layer_diag_fit_selects_delta_no_worse_than_map_and_predicts(cli, multi_ckpt, tmp_path):
    post_path = tmp_path / "all.safetensors"
    args = ["--model", "builtin:mlp", "--checkpoint", multi_ckpt, "--data", "composed-digits:train"]
    # no --val-data: the checkpoint records its validation set, which the default δ is chosen on
    res = cli("fit-laplace", *args, "--subset", "all", "--hessian", "diag", "--out", post_path, "--json")
    assert res.code == 0, res.err
    tensors, meta = load_tensors(post_path)
    assert meta["likelihood"] == "bernoulli" and meta["subset"] == "all" and meta["hessian"] == "diag"
    assert tensors["mean"].numel() == tensors["curvature_diag"].numel() == 42_506
    sel = meta["selection"]
    assert (
        sel["validated"]
        and sel["criterion"] == "nll"
        and meta["validation_data"]["spec"] == "composed-digits:val"
    )
    chosen = next(r for r in sel["curve"] if r["prior_precision"] == sel["chosen"])
    # the grid reaches the MAP limit, so the choice is never worse than MAP on validation; on this
    # overconfident net it is much better (0.150 against MAP's 0.214)
    assert (
        chosen["nll"] <= sel["map_validation"]["nll"] and chosen["nll"] < 0.8 * sel["map_validation"]["nll"]
    )
    assert min(r["nll"] for r in sel["curve"]) == chosen["nll"]
    out = tmp_path / "pred.json"
    res = cli(
        "predict", "--posterior", post_path, "--data", "composed-digits:test", "--limit", "60", "--out", out
    )
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    assert report["likelihood"] == "bernoulli"
    row = report["rows"][0]
    assert len(row["probs"]) == 10 and len(row["label"]) == 10
    assert all(0 < p < 1 for p in row["probs"])
    res = cli("predict", "--posterior", post_path, "--data", "composed-digits:test", "--link", "beta",
              "--limit", "20", "--json")  # fmt: skip
    assert res.code == 0, res.err


def test_library_fit_laplace_diag_all_layers_and_predict(multi_ckpt):
    loaded = ModelOptions("builtin:mlp", multi_ckpt).load()
    post = api.fit(loaded, "composed-digits:train", "laplace-diag", subset="all", prior_precision=30.0)
    assert (post.likelihood, post.subset.value, post.structure) == ("bernoulli", "all", "diag")
    assert post.n_data == len(post.fit_data) and post.log_likelihood < 0
    assert not post.metadata()["selection"]["validated"]
    pred = post.predict("composed-digits:test", link="mc", samples=200)
    assert pred.probs.shape == pred.per_label.mutual_information.shape == (len(pred.probs), 10)
    assert (pred.logit_var > 0).all()
    probit_pred = post.predict("composed-digits:test")
    assert torch.equal(probit_pred.probs, probit(probit_pred.logit_mean, probit_pred.logit_var))
