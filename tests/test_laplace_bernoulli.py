"""Last-layer Laplace for multi-label (bernoulli) classifiers: the posterior against dense
autograd oracles, the marginal likelihood, the per-label predictive and selection, the guards,
and ``fit-laplace`` / ``predict`` end to end on composed digits (generated, no download)."""

import json
import math

import pytest
import torch
from conftest import random_head
from oracles import explicit_jacobian_head
from test_cli import one_error_line
from tolerance import assert_below, assert_close

from bayescli import api
from bayescli.errors import BayescliError
from bayescli.fitting.pipeline import ModelOptions
from bayescli.io import load_tensors, save_tensors
from bayescli.metrics.multilabel import per_label_nll
from bayescli.models.features import Features, extract_features
from bayescli.posterior import LaplacePosterior
from bayescli.posterior.gaussian import augment
from bayescli.posterior.selection import scores
from bayescli.predictive.glm import predict
from bayescli.predictive.sigmoid_links import apply_sigmoid_link, probit
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier

N, D, K = 200, 5, 4
DELTA = 0.7


@pytest.fixture
def fitted():
    """Features ``phi [N, D]``, a head ``D → K`` and labels ``[N, K]`` drawn from its sigmoids."""
    gen = torch.Generator().manual_seed(2)
    phi = torch.randn(N, D, generator=gen, dtype=torch.float64)
    head = random_head(D, K, seed=2)
    labels = torch.bernoulli(torch.sigmoid(head(phi)).detach(), generator=gen).long()
    return phi, head, labels


def theta(head: torch.nn.Linear) -> torch.Tensor:
    """``W̃ = [W, b]`` flattened row-major ``[K(D+1)]``."""
    return torch.cat([head.weight, head.bias[:, None]], 1).detach().reshape(-1)


def summed_bce(flat: torch.Tensor, phi: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``−log p(y | θ) = Σ_nk BCE(f_nk, y_nk)`` with ``f = φ̃ W̃ᵀ``, ``W̃ = flat.reshape(K, D+1)``."""
    logits = augment(phi) @ flat.reshape(K, D + 1).T
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.double(), reduction="sum")


def dense_curvature(
    phi: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, structure: str
) -> torch.Tensor:
    """``H [P, P]`` of each structure by its definition, from torch.autograd Hessians (float64).

    ``full``: the Hessian of the summed BCE w.r.t. ``W̃`` (for a linear head it is the GGN);
    ``diag``: its diagonal; ``kron``: ``G ⊗ A`` with ``G = Σ_n ∂²ℓ_n/∂f_n²`` (the summed per-input
    logit Hessians) and ``A = (1/N) Σ_n φ̃_nφ̃_nᵀ``."""
    hess = torch.autograd.functional.hessian(lambda t: summed_bce(t, phi, labels), theta(head))
    if structure == "full":
        return hess
    if structure == "diag":
        return torch.diag(hess.diagonal())
    logits = head(phi).detach()
    per_input = torch.autograd.functional.hessian(
        lambda f: torch.nn.functional.binary_cross_entropy_with_logits(f, labels.double(), reduction="sum"),
        logits,
    )  # [N, K, N, K]; zero across inputs
    g = torch.einsum("nknl->kl", per_input)
    phi_aug = augment(phi)
    return torch.kron(g, phi_aug.T @ phi_aug / len(phi))


# float64 on a 20-parameter head, κ(H + δI) ≲ 100 here: inverses lose ≲ κ·eps ≈ 2e-14 relative;
# 1e-8 leaves a margin above 10⁵
F64_SOLVE = 1e-8


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_logit_variances_equal_brute_force_j_inverse_precision_jt(fitted, structure):
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, structure, likelihood="bernoulli")
    post.set_prior_precision(DELTA)
    x = torch.randn(30, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    lg = post.logit_gaussian(x)
    hessian = dense_curvature(phi, head, labels, structure)
    cov = torch.linalg.inv(hessian + DELTA * torch.eye(K * (D + 1), dtype=torch.float64))
    jac = explicit_jacobian_head(augment(x), K)
    expected = (jac @ cov @ jac.transpose(1, 2)).diagonal(dim1=1, dim2=2)
    assert_below(((lg.var - expected).norm() / expected.norm()).item(), F64_SOLVE, what=f"var ({structure})")
    assert_close(lg.mean, head(x), atol=1e-10, what=f"logit mean ({structure})")


def test_exact_bernoulli_ggn_is_block_diagonal_over_labels(fitted):
    """The labels are independent, so the exact curvature has no cross-label blocks — unlike the
    softmax one, which a bernoulli fit must not use."""
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, "full", likelihood="bernoulli")
    blocks = post.gaussian.H.reshape(K, D + 1, K, D + 1)
    off = blocks.clone()
    for k in range(K):
        off[k, :, k] = 0
    assert off.abs().max().item() == 0.0
    softmax = LaplacePosterior.fit_last_layer(phi, labels.argmax(1), head, "full")
    assert softmax.gaussian.H.reshape(K, D + 1, K, D + 1)[0, :, 1].abs().max().item() > 1e-3


def dense_log_marglik(phi, labels, head, hessian: torch.Tensor, delta: float) -> float:
    """``log p(D|θ*) − ½δ‖θ*‖² + (P/2) log δ − ½ log det(H + δI)`` with the Bernoulli likelihood
    and dense linear algebra (the ``(P/2) log 2π`` of the prior normaliser cancels the Laplace
    integral's), as tests/test_posterior.py defines it for softmax."""
    t = theta(head)
    log_lik = -summed_bce(t, phi, labels).item()
    p = t.numel()
    _, logdet = torch.linalg.slogdet(hessian + delta * torch.eye(p, dtype=hessian.dtype))
    return log_lik - 0.5 * delta * t.dot(t).item() + 0.5 * p * math.log(delta) - 0.5 * logdet.item()


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_log_marglik_equals_dense_bernoulli_oracle(fitted, structure):
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, structure, likelihood="bernoulli")
    hessian = dense_curvature(phi, head, labels, structure)
    norm = torch.linalg.matrix_norm(hessian, 2).item()
    p = hessian.shape[0]
    for delta in (1e-3, 0.1, 3.0, 50.0, 1e3):
        expected = dense_log_marglik(phi, labels, head, hessian, delta)
        # as the softmax test: log det error ≲ P·eps·κ, sums over N·K terms ≲ N·K·eps·|value|; 100×
        atol = 100 * p * 2.2e-16 * (norm / delta + 1) + 100 * N * K * 2.2e-16 * abs(expected)
        assert_close(post.log_marglik(delta), expected, atol=atol, what=f"marglik {structure} δ={delta:g}")
    best = post.optimise_prior_marglik()
    at_best = dense_log_marglik(phi, labels, head, hessian, best)
    for factor in (0.9, 1.1):
        assert at_best >= dense_log_marglik(phi, labels, head, hessian, best * factor)


def test_file_records_the_likelihood_and_old_files_load_as_categorical(fitted, tmp_path):
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, "kron", likelihood="bernoulli")
    post.set_prior_precision(DELTA)
    post.save(tmp_path / "p.safetensors")
    again = LaplacePosterior.load(tmp_path / "p.safetensors")
    assert again.likelihood == "bernoulli" and again.summary()["likelihood"] == "bernoulli"
    assert torch.equal(again.logit_gaussian(phi).var, post.logit_gaussian(phi).var)
    tensors, meta = load_tensors(tmp_path / "p.safetensors")
    del meta["likelihood"]  # a file written before multi-label posteriors existed
    save_tensors(tmp_path / "old.safetensors", tensors, meta)
    assert LaplacePosterior.load(tmp_path / "old.safetensors").likelihood == "categorical"


def test_glm_predictive_applies_the_sigmoid_links_to_per_label_variances(fitted):
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, "kron", likelihood="bernoulli")
    post.set_prior_precision(DELTA)
    feats = Features(phi, head(phi).detach(), labels)
    lg = post.logit_gaussian(phi)
    assert post.default_link.value == "probit"
    pred = predict(post, feats, link=post.default_link)
    assert torch.equal(pred.probs, probit(lg.mean, lg.var))  # a sigmoid per label, not a softmax
    beta = predict(post, feats, link="beta")
    expected = apply_sigmoid_link(lg.mean, lg.var, "beta")
    assert torch.equal(beta.probs, expected.probs)
    assert torch.equal(beta.per_label.mutual_information, expected.mutual_information)
    mc = predict(post, feats, link="mc", samples=64, seed=5)
    assert mc.per_label.mutual_information.shape == (N, K)
    for options, cause in (
        ({"link": "bridge"}, "link 'bridge' is a softmax link"),
        ({"link": "sodpp"}, "link 'sodpp' is a softmax link"),
        ({"predictive": "bnn"}, "predictive 'bnn' serves softmax posteriors only"),
        ({"link": "mc", "fit_dirichlet": True}, "a fitted Dirichlet is a softmax output"),
    ):
        with pytest.raises(BayescliError, match=cause):
            predict(post, feats, **options)


def test_selection_scores_multilabel_data_per_label():
    gen = torch.Generator().manual_seed(4)
    probs = torch.rand(50, 3, generator=gen, dtype=torch.float64)
    labels = torch.bernoulli(probs, generator=gen).long()
    got = scores(probs, labels)
    bce = torch.nn.functional.binary_cross_entropy(probs, labels.double())  # mean over N·K cells
    assert_close(got["nll"], bce.item(), rtol=1e-12, what="per-label NLL")
    assert_close(got["brier"], (probs - labels).pow(2).mean().item(), rtol=1e-12, what="per-label Brier")


def test_bernoulli_curvature_refuses_refinement_and_backpack(fitted):
    from bayescli.posterior.laplace import fit_laplace

    phi, head, labels = fitted
    with pytest.raises(BayescliError, match="backend='backpack' has no multi-label"):
        LaplacePosterior.fit_last_layer(phi, labels, head, "kron", backend="backpack", likelihood="bernoulli")
    with pytest.raises(BayescliError, match="refine_steps refines softmax posteriors only"):
        fit_laplace(None, phi, labels, refine_steps=3, likelihood="bernoulli")


# -- composed digits, a bernoulli MLP ------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_ckpt(tmp_path_factory):
    """An MLP with a sigmoid per digit, trained on composed digits without weight decay for long
    enough to be overconfident (validation per-label NLL 0.21, twice its 10-epoch value's 0.16)."""
    from bayescli.data import load_data

    path = tmp_path_factory.mktemp("multi") / "multi.safetensors"
    train, val = load_data("composed-digits:train"), load_data("composed-digits:val")
    config = TrainConfig(epochs=40, seed=0, weight_decay=0.0)
    clf, meta = train_classifier("builtin:mlp", train, val, config, likelihood="bernoulli")
    save_checkpoint(path, clf, meta)
    return path


def test_default_fit_with_validation_beats_map_per_label(multi_ckpt):
    loaded = ModelOptions("builtin:mlp", multi_ckpt).load()
    post = api.fit(loaded, "composed-digits:train", val="composed-digits:val")
    assert post.likelihood == "bernoulli" and post.metadata()["likelihood"] == "bernoulli"
    sel = post.metadata()["selection"]
    assert sel["validated"] and sel["setting"] == "prior_precision" and post.metadata()["validated"]
    val = post.val_data
    feats = extract_features(loaded, val, 256, "cpu")
    pred = predict(post, feats)  # the method's default: glm, probit
    nll_post = per_label_nll(pred.probs, val.y).mean().item()
    nll_map = per_label_nll(torch.sigmoid(feats.logits), val.y).mean().item()
    # the overconfident MAP scores 0.214; Laplace with the validated δ ≈ 3 scores 0.157
    assert nll_post < 0.8 * nll_map and not sel["map_point"]
    assert pred.probs.shape == (len(val), 10)
    assert sel["map_validation"]["nll"] == pytest.approx(nll_map, rel=1e-6)


def test_other_methods_still_refuse_bernoulli_models(multi_ckpt):
    loaded = ModelOptions("builtin:mlp", multi_ckpt).load()
    with pytest.raises(
        BayescliError, match=r"is a multi-label classifier \(likelihood 'bernoulli'.* fsvi supports"
    ):
        api.fit(loaded, "composed-digits:train", "fsvi")


def test_cli_fit_laplace_and_predict_write_per_label_outputs(cli, multi_ckpt, tmp_path):
    post = tmp_path / "p.safetensors"
    args = ["--model", "builtin:mlp", "--checkpoint", multi_ckpt, "--data", "composed-digits:train"]
    res = cli("fit-laplace", *args, "--val-data", "composed-digits:val", "--out", post, "--json")
    assert res.code == 0, res.err
    _, meta = load_tensors(post)
    assert meta["likelihood"] == "bernoulli" and meta["selection"]["validated"]
    out = tmp_path / "pred.json"
    res = cli(
        "predict", "--posterior", post, "--data", "composed-digits:test", "--link", "beta", "--out", out
    )
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    assert report["likelihood"] == "bernoulli" and "map" in report["results"]["map"]
    row = report["rows"][0]
    assert len(row["probs"]) == 10 and len(row["mutual_information"]) == 10 and len(row["label"]) == 10
    assert set(row["predicted"]) <= set(meta["class_names"])
    arrays = tmp_path / "pred.safetensors"
    assert cli("predict", "--posterior", post, "--data", "composed-digits:test", "--out", arrays).code == 0
    tensors, _ = load_tensors(arrays)
    assert tensors["probs"].shape == tensors["labels"].shape == (len(report["rows"]), 10)
    line = one_error_line(
        cli("predict", "--posterior", post, "--data", "composed-digits:test", "--link", "bridge")
    )
    assert line == (
        "error: link 'bridge' is a softmax link; multi-label (bernoulli) posteriors take "
        "none, probit, mc, beta"
    )


def test_cli_refuses_likelihood_and_data_mismatches_naming_both(cli, multi_ckpt, digits_posterior, tmp_path):
    out = tmp_path / "p.safetensors"
    line = one_error_line(cli("fit-laplace", "--model", "builtin:mlp", "--checkpoint", multi_ckpt,
                              "--data", "digits:train", "--out", out))  # fmt: skip
    assert line == (
        "error: digits:train has one class per input (y [N]), but the model is multi-label (likelihood "
        "'bernoulli', a sigmoid per class); use multi-label data (y [N, 10] of 0/1)"
    )
    line = one_error_line(cli("predict", "--posterior", digits_posterior, "--data", "composed-digits:test"))
    assert line == (
        "error: composed-digits:test is multi-label (y [N, 10] of 0/1), but the model is a softmax "
        "classifier (likelihood 'categorical', one class per input); use single-label data"
    )
    assert not out.exists()


def test_cli_likelihood_declares_a_multilabel_checkpoint_saved_elsewhere(cli, multi_ckpt, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    # the same weights with nothing recorded about the likelihood (as saved elsewhere)
    plain = tmp_path / "published.safetensors"
    with safe_open(str(multi_ckpt), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
        header = json.loads(f.metadata()["bayescli"])
    del header["likelihood"]
    save_file(tensors, str(plain), metadata={"bayescli": json.dumps(header)})
    args = ["--model", "builtin:mlp", "--checkpoint", plain, "--data", "composed-digits:train"]
    out = tmp_path / "p.safetensors"
    # without the declaration the model is softmax, and the labels say otherwise
    assert "but the model is a softmax classifier" in one_error_line(cli("fit-laplace", *args, "--out", out))
    res = cli("fit-laplace", *args, "--likelihood", "bernoulli", "--prior-precision", "1", "--out", out)
    assert res.code == 0, res.err
    _, meta = load_tensors(out)
    assert meta["likelihood"] == "bernoulli"
    # later commands reload the checkpoint as the posterior declared it
    pred = tmp_path / "pred.json"
    res = cli("predict", "--posterior", out, "--data", "composed-digits:test", "--out", pred)
    assert res.code == 0, res.err
    assert json.loads(pred.read_text())["likelihood"] == "bernoulli"
    rep = tmp_path / "report.json"
    res = cli("evaluate", "--posterior", out, "--data", "composed-digits:test", "--out", rep)
    assert res.code == 0, res.err
    assert json.loads(rep.read_text())["likelihood"] == "bernoulli"
    # a checkpoint that records its likelihood cannot be declared otherwise
    recorded = ["--model", "builtin:mlp", "--checkpoint", multi_ckpt, "--data", "composed-digits:train"]
    line = one_error_line(cli("fit-laplace", *recorded, "--likelihood", "categorical", "--out", out))
    assert line == (
        f"error: {multi_ckpt} records likelihood 'bernoulli', not 'categorical'; drop --likelihood or "
        "pass --likelihood bernoulli"
    )
    line = one_error_line(cli("fit-laplace", *args, "--likelihood", "poisson", "--out", out))
    assert line == "error: unknown likelihood 'poisson'; use one of categorical, bernoulli"


def test_per_label_nll_is_exact_through_predict_and_evaluate_on_a_confident_net(cli, multi_ckpt, tmp_path):
    """Issue 37: the multi-label MLP with its head scaled ×60 (labels at p < 1e-30, many sigmoids
    rounding to 0 or 1 in float32): ``predict`` and ``evaluate`` give MAP's and the none/probit
    links' per-label NLL as ``log(1 + e^{∓s})`` of their log-odds (NumPy oracle), not capped."""
    import numpy as np

    from bayescli.data import load_data
    from bayescli.posterior.base import load_posterior

    tensors, meta = load_tensors(multi_ckpt)
    head = [k for k, v in tensors.items() if k.endswith(".weight") and v.dim() == 2 and v.shape[0] == 10][-1]
    for key in (head, head[: -len("weight")] + "bias"):
        tensors[key] = tensors[key] * 60.0
    ckpt, post = tmp_path / "confident.safetensors", tmp_path / "post.safetensors"
    save_tensors(ckpt, tensors, meta)
    fit = [
        "--model",
        "builtin:mlp",
        "--checkpoint",
        ckpt,
        "--data",
        "composed-digits:train",
        "--device",
        "cpu",
    ]
    res = cli("fit-laplace", *fit, "--hessian", "diag", "--prior-precision", "1", "--out", post, "-q")
    assert res.code == 0, res.err

    loaded = load_posterior(post)
    test = load_data("composed-digits:test")
    feats = extract_features(loaded.load_model(), test, 256, "cpu")
    y = test.y.numpy()
    probit_pred = predict(loaded, feats, link="probit")
    own = {
        "map": feats.logits.double().numpy(),
        "glm-none": probit_pred.logit_mean.double().numpy(),
        "glm-probit": (
            probit_pred.logit_mean.double() * (1 + probit_pred.logit_var.double() * math.pi / 8).rsqrt()
        ).numpy(),
    }
    expected = {k: float(np.logaddexp(0, np.where(y == 1, -s, s)).mean()) for k, s in own.items()}
    wrong = np.where(y == 1, -own["map"], own["map"]) > 69  # p(label) < 1e-30
    assert wrong.any()
    # the 1e-12 cap (27.6 nats a cell) would fall far short of the truth
    assert (
        expected["map"]
        > 1.5 * np.minimum(np.logaddexp(0, np.where(y == 1, -own["map"], own["map"])), 27.6).mean()
    )
    # float32 logits in the hundreds, float64 log-sigmoid on both sides: relative 1e-6 is ≫ rounding
    tol = {k: 1e-6 * v for k, v in expected.items()}

    for link in ("none", "probit"):
        out = tmp_path / f"pred-{link}.json"
        res = cli("predict", "--posterior", post, "--data", "composed-digits:test", "--link", link,
                  "--device", "cpu", "--out", out, "-q")  # fmt: skip
        assert res.code == 0, res.err
        rows = json.loads(out.read_text())["results"]
        assert abs(rows["map"]["nll"] - expected["map"]) <= tol["map"], rows["map"]
        name = f"glm-{link}"
        assert abs(rows[name]["nll"] - expected[name]) <= tol[name], (name, rows[name])

    report = tmp_path / "eval.json"
    res = cli("evaluate", "--posterior", post, "--data", "composed-digits:test", "--methods",
              "map,glm-none,glm-probit", "--device", "cpu", "--out", report, "-q")  # fmt: skip
    assert res.code == 0, res.err
    in_dist = json.loads(report.read_text())["results"]["in_distribution"]
    for name, value in expected.items():
        assert abs(in_dist[name]["nll"] - value) <= tol[name], (name, in_dist[name]["nll"], value)
