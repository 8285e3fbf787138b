"""``--precision`` / ``precision=``: the backbone's feature pass under bf16 autocast (on the CPU here).

The tolerance of the main test is derived, not chosen: a bf16 fit's GLM-probit predictive may move
from the fp32 one only as far as a first-order bound computed from the measured feature
perturbation ``Δφ``, the head's row norms and the two fits' curvatures allows.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from bayescli.data import load_data
from bayescli.fitting.laplace import LaplaceSettings
from bayescli.fitting.pipeline import ModelOptions, fit_from_specs
from bayescli.io import load_tensors
from bayescli.models.features import FeatureStream, extract_features
from bayescli.options import Link, Predictive
from bayescli.predictive.glm import predict

LAMBDA = math.pi / 8  # the probit link: softmax(μ / sqrt(1 + λ σ²))
U_BF16 = 2.0**-8  # bfloat16's unit roundoff (8 significant bits)
ROUNDED_LAYERS = 3  # small-cnn's conv, conv and linear layers before φ, each rounding its operands


def _fit(ckpt, precision: str):
    settings = LaplaceSettings(hessian="full", prior_precision=1.0)  # one δ: only the features differ
    run = fit_from_specs(
        "laplace",
        ModelOptions("builtin:small-cnn", ckpt, precision=precision),
        "digits:train",
        settings=settings,
    )
    test = load_data("digits:test", preprocess=run.model.preprocess)
    return run, extract_features(run.model, test)


def test_bf16_fit_predictive_is_within_the_bound_derived_from_its_feature_error(digits_ckpt):
    run32, f32 = _fit(digits_ckpt, "fp32")
    run16, f16 = _fit(digits_ckpt, "bf16")
    assert run16.posterior.meta["precision"] == "bf16" and run32.posterior.meta["precision"] == "fp32"
    g32, g16 = run32.posterior.gaussian, run16.posterior.gaussian

    # the feature pass really ran in bf16, and its error is bf16 rounding, not a broken pass:
    # normwise, each of the 3 layers rounds its two operands to 8 bits (relative ≤ u each)
    eps = (f16.phi.double() - f32.phi.double()).norm(dim=1)  # ‖Δφ̃_i‖ (the bias entry is exact)
    rel = eps / f32.phi.double().norm(dim=1)
    assert rel.max() <= ROUNDED_LAYERS * 2 * U_BF16
    # φ is small-cnn's last ReLU(Linear) output: computed in bf16, every value lies on bf16's grid
    # (a float32 pass, in any memory layout, leaves it there only by chance)
    assert torch.equal(f16.phi, f16.phi.bfloat16().float()), "φ not from a bf16 pass: precision ignored"
    assert not torch.equal(f32.phi, f32.phi.bfloat16().float())
    # the MAP logits are the float32 head applied to the float32 φ (what every predictive uses)
    head = run16.model.classifier.head
    with torch.no_grad():
        torch.testing.assert_close(f16.logits, head(f16.phi), rtol=1e-6, atol=1e-5)

    p32 = predict(run32.posterior, f32, Predictive.GLM, Link.PROBIT).probs.double()
    p16 = predict(run16.posterior, f16, Predictive.GLM, Link.PROBIT).probs.double()
    moved = (p16 - p32).abs().max(1).values

    # Bound. z_k = μ_k g(v_k), g(v) = (1 + λv)^(-1/2), |g| ≤ 1, |g'(v)| = (λ/2)(1 + λv)^(-3/2).
    # Δz_k = Δμ_k g(v'_k) + μ_k (g(v'_k) − g(v_k)) exactly, with Δμ_k = w_k·Δφ (one head), so
    # |Δz_k| ≤ ‖w_k‖ε + |μ_k| |g'(v_lo)| |Δv_k|. The variance moves through the features and the
    # curvature: with Σ = (H + δ)⁻¹ and η = ‖Σ^½ (H' − H) Σ^½‖, Σ' lies within (1 ± η)⁻¹ Σ, so
    # |J'ᵀΣ'J' − JᵀΣJ| ≤ η/(1−η) v + ‖Σ'‖^½ ε (2σ'(φ) + ‖Σ'‖^½ ε), σ'(φ) ≤ σ(φ)/√(1−η).
    # Softmax: |Δp_k| ≤ p_k(1 − p_k) range(Δz) ≤ ½ max|Δz| along the segment.
    delta = g32.delta
    root = g32.Q * (g32.eig + delta).rsqrt()  # Σ^½ = Q diag((λ+δ)^-½) Qᵀ, as Q D Qᵀ below
    sigma_half = root @ g32.Q.T
    eta = torch.linalg.matrix_norm(sigma_half @ (g16.H.double() - g32.H.double()) @ sigma_half, 2).item()
    assert eta < 0.5
    norm_sigma16 = 1.0 / (g16.eig.min().item() + g16.delta)
    logits = g32.push_last_layer(f32.phi, True)
    mu, v = logits.mean.double(), logits.var.double().clamp_min(0)
    e = eps[:, None]
    dv = eta / (1 - eta) * v + math.sqrt(norm_sigma16) * e * (
        2 * v.sqrt() / math.sqrt(1 - eta) + math.sqrt(norm_sigma16) * e
    )
    v_lo = (v - dv).clamp_min(0)
    w_norm = head.weight.detach().double().norm(dim=1)
    dz = w_norm * e + mu.abs() * (LAMBDA / 2) * (1 + LAMBDA * v_lo).pow(-1.5) * dv
    bound = 0.5 * dz.max(1).values
    assert bound.max() < 0.1  # the bound says something
    assert (moved <= bound).all(), f"moved {moved.max():.3g}, bound there {bound[moved.argmax()]:.3g}"


def test_cli_records_the_precision_and_predict_reuses_it(cli, digits_ckpt, tmp_path):
    post = tmp_path / "bf16.safetensors"
    fit = ["--model", "builtin:small-cnn", "--checkpoint", digits_ckpt, "--data", "digits:train"]
    r = cli("fit-laplace", *fit, "--out", post, "--precision", "bf16", "--device", "cpu", "--json")
    assert r.code == 0, r.err
    summary = json.loads(r.out)
    _, meta = load_tensors(post)
    assert meta["precision"] == "bf16" and summary["precision"] == "bf16"

    # the MAP accuracy printed is the bf16 pass's
    options = ModelOptions("builtin:small-cnn", digits_ckpt, precision="bf16")
    model = options.load()
    stream = FeatureStream(model, load_data("digits:train", preprocess=model.preprocess))
    for _ in stream:
        pass
    assert summary["map_accuracy"] == pytest.approx(stream.accuracy, abs=1e-12)

    test = ["--posterior", post, "--data", "digits:test", "--device", "cpu", "--json"]
    default = json.loads(cli("predict", *test).out)  # no --precision: the recorded one
    assert default["precision"] == "bf16"
    fp32 = json.loads(cli("predict", *test, "--precision", "fp32").out)
    assert fp32["precision"] == "fp32"
    # the bf16 feature pass moves the MAP probabilities; the fp32 one is the fp32 pass
    maps = {r["precision"]: r["results"]["map"]["nll"] for r in (default, fp32)}
    assert maps["bf16"] != maps["fp32"]


def test_evaluate_and_select_reports_record_the_precision(cli, digits_ckpt, tmp_path):
    post = tmp_path / "p.safetensors"
    fit = ["--model", "builtin:small-cnn", "--checkpoint", digits_ckpt, "--data", "digits:train"]
    assert cli("fit-laplace", *fit, "--out", post, "--precision", "bf16", "--device", "cpu").code == 0
    ev = ["--posterior", post, "--data", "digits:test", "--methods", "map,glm-probit", "--device", "cpu"]
    r = cli("evaluate", *ev, "--ood-scores", "msp", "--fidelity-inputs", "0", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["precision"] == "bf16"
    r = cli(
        "select", *fit, "--val-data", "digits:val", "--methods", "laplace-diag", "--out-dir", tmp_path / "s",
        "--precision", "bf16", "--device", "cpu", "--json",
    )  # fmt: skip
    assert r.code == 0, r.err
    assert json.loads(r.out)["precision"] == "bf16"
    assert json.loads((tmp_path / "s" / "leaderboard.json").read_text())["precision"] == "bf16"


def test_the_feature_cache_is_keyed_by_the_precision(digits_ckpt, tmp_path):
    cache = tmp_path / "cache"
    passes = {}
    for precision in ("fp32", "bf16", "bf16"):
        model = ModelOptions("builtin:small-cnn", digits_ckpt, precision=precision).load()
        data = load_data("digits:val", preprocess=model.preprocess)
        stream = FeatureStream(model, data, cache=cache)
        phi = torch.cat([b.phi for b in stream])
        passes.setdefault(precision, []).append((phi, stream.seconds))
    ((phi32, _),) = passes["fp32"]
    (phi16, computed), (phi16_cached, read) = passes["bf16"]
    assert computed > 0 and read == 0  # bf16 did not read the fp32 cache; then read its own
    assert not torch.equal(phi16, phi32)
    assert torch.equal(phi16, phi16.bfloat16().float())  # computed in bf16 (see the first test)
    assert torch.equal(phi16_cached, phi16)  # the very tensors written


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--precision", "fp8"], "'--precision'"),
        (["--precision", "fp16"], "precision fp16 runs on CUDA devices only"),
        (["--precision", "bf16", "--subset", "all"], "runs the whole network itself in float32"),
    ],
)
def test_bad_precision_is_one_line_and_exit_2(cli, digits_ckpt, tmp_path, args, needle):
    r = cli(
        "fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt, "--data", "digits:train",
        "--out", tmp_path / "p.safetensors", "--device", "cpu", *args,
    )  # fmt: skip
    assert r.code == 2
    lines = [line for line in r.err.splitlines() if line.startswith(("error:", "Error:"))]
    assert len(lines) == 1 and needle in lines[0], r.err
    assert not (tmp_path / "p.safetensors").exists()
