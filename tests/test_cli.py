"""End-to-end CLI flows and the bad-input contract: exit 2, one line, no output file."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.special import digamma
from tolerance import assert_close

from bayescli.io import load_tensors, save_tensors
from bayescli.posterior import LaplacePosterior


def one_error_line(res) -> str:
    assert res.code == 2, (res.code, res.out, res.err)
    lines = [ln for ln in res.err.strip().splitlines() if ln.strip()]
    assert "Traceback" not in res.err
    return lines[-1]


def test_version_and_help(cli):
    assert cli("--version").out.strip().startswith("bayescli ")
    res = cli("--help")
    for cmd in ("train", "fit-laplace", "predict", "topk", "evaluate", "report", "demo"):
        assert cmd in res.out
    assert "Example:" in cli("predict", "--help").out


def test_train_writes_checkpoint_with_metadata(cli, tmp_path):
    out = tmp_path / "m.safetensors"
    res = cli(
        "train", "--model", "builtin:mlp", "--data", "digits:train", "--epochs", "3", "--out", out, "--json"
    )
    assert res.code == 0
    summary = json.loads(res.out)
    assert summary["val_accuracy"] > 0.8
    _, meta = load_tensors(out)
    assert meta["model"] == "builtin:mlp" and meta["num_classes"] == 10 and meta["input_shape"] == [1, 8, 8]
    assert meta["data"]["spec"] == "digits:train" and len(meta["normalisation"]["mean"]) == 1


def test_small_cnn_reaches_95_percent_on_digits(digits_ckpt):
    from bayescli.data import load_data
    from bayescli.models.specs import load_classifier
    from bayescli.training.classifier import accuracy

    loaded = load_classifier("builtin:small-cnn", digits_ckpt)
    assert accuracy(loaded.classifier, load_data("digits:test"), "cpu") >= 0.95


def test_fit_predict_flow(cli, digits_posterior, tmp_path):
    post = LaplacePosterior.load(digits_posterior)
    assert post.structure == "kron" and post.metadata()["prior"]["method"] == "marglik"
    for key in ("checkpoint_sha256", "model", "data", "class_names", "num_classes", "bayescli_version"):
        assert key in post.metadata()
    out = tmp_path / "pred.json"
    res = cli(
        "predict", "--posterior", digits_posterior, "--data", "digits:test", "--link", "probit", "--out", out
    )
    assert res.code == 0 and "glm-probit" in res.out
    report = json.loads(out.read_text())
    assert report["results"]["map"]["accuracy"] > 0.9
    assert set(report["results"]["glm-probit"]) >= {"accuracy", "nll", "ece", "brier", "mmc"}
    row = report["rows"][0]
    assert len(row["top5"]) == 5 and {"predicted", "entropy", "max_prob", "label"} <= set(row)
    assert set(report["timings"]) == {"forward", "predictive", "link"}


def test_predict_mc_save_logits_on_unlabelled_npz(cli, digits_posterior, tmp_path):
    from bayescli.data import load_data

    x = load_data("digits:test", limit=20).x.numpy()
    np.savez(tmp_path / "batch.npz", x=x)
    out = tmp_path / "pred.safetensors"
    res = cli(
        "predict",
        "--posterior",
        digits_posterior,
        "--data",
        f"npz:{tmp_path / 'batch.npz'}",
        "--link",
        "mc",
        "--samples",
        "500",
        "--save-logits",
        "--out",
        out,
        "--quiet",
    )
    assert res.code == 0, res.err
    tensors = load_file(str(out))
    assert tensors["probs"].shape == (20, 10) and tensors["logit_cov"].shape == (20, 10, 10)
    assert "labels" not in tensors
    # a float32 sum of 10 probabilities is within 10·6e-8 of 1; 1e-5 leaves a margin above 10×
    assert_close(tensors["probs"].sum(-1), 1.0, atol=1e-5, what="probabilities sum to one")


def test_predict_bridge_and_topk(cli, digits_posterior, tmp_path):
    out = tmp_path / "d.safetensors"
    assert (
        cli(
            "predict",
            "--posterior",
            digits_posterior,
            "--data",
            "digits:test",
            "--bridge",
            "--out",
            out,
            "-q",
        ).code
        == 0
    )
    t = load_file(str(out))
    assert t["alpha"].shape == (359, 10)
    assert t["alpha"].dtype == torch.float64  # the bridge works and stores in float64
    # a sum of 10 terms and a division in float64 (≤ 1e-15 relative); 1e-12 leaves 1000×
    mean = t["alpha"] / t["alpha"].sum(-1, keepdim=True)
    assert_close(t["dirichlet_mean"], mean, rtol=1e-12, atol=1e-15, what="dirichlet mean = α/α₀")
    # every Dirichlet field written equals its definition, recomputed from the stored α in
    # NumPy/scipy (not through bayescli.predictive.dirichlet)
    a = t["alpha"].double().numpy()
    a0 = a.sum(1)
    p = a / a0[:, None]
    h_mean = -(p * np.log(p)).sum(1)
    h_expected = digamma(a0 + 1) - (p * digamma(a + 1)).sum(1)
    oracle = {
        "alpha0": a0,
        "dirichlet_variance": a * (a0[:, None] - a) / (a0[:, None] ** 2 * (a0[:, None] + 1)),
        "entropy_of_mean": h_mean,
        "expected_entropy": h_expected,
        "mutual_information": np.clip(h_mean - h_expected, 0, None),
    }
    for key, expected in oracle.items():
        # float64 on both sides: a few roundings of values whose digamma terms are ≤ ψ(α₀ + 1) ≈ 10,
        # plus scipy's and torch's digamma differing by a few ulps: ≲ 1e-14 absolute; 1e-10
        # leaves a margin above 1000×
        assert_close(t[key], expected, rtol=1e-10, atol=1e-10, what=f"predict --bridge field {key}")
    _, meta = load_tensors(out)
    assert meta["bridge_correction"] == "zero-sum"
    topk = tmp_path / "topk.json"
    res = cli(
        "topk",
        "--posterior",
        digits_posterior,
        "--data",
        "digits:test",
        "--threshold",
        "0.05",
        "--max-k",
        "10",
        "--out",
        topk,
        "--json",
    )
    assert res.code == 0
    report = json.loads(topk.read_text())
    direct = np.mean([s["label"] in s["classes"] for s in report["sets"]])
    assert report["summary"]["set_accuracy"] == direct  # the same mean of 0/1 values
    assert sum(report["summary"]["k_histogram"].values()) == 359
    assert report["sets"][0]["names"] and report["sets"][0]["k"] == len(report["sets"][0]["classes"])


def test_all_layer_and_val_nll(cli, tmp_path):
    ckpt = tmp_path / "mlp.safetensors"
    assert cli("train", "--model", "builtin:mlp", "--epochs", "3", "--out", ckpt, "-q").code == 0
    post = tmp_path / "all.safetensors"
    res = cli(
        "fit-laplace",
        "--model",
        "builtin:mlp",
        "--checkpoint",
        ckpt,
        "--data",
        "digits:train",
        "--subset",
        "all",
        "--hessian",
        "diag",
        "--prior-precision",
        "val-nll",
        "--out",
        post,
        "--json",
    )
    assert res.code == 0, res.err
    loaded = LaplacePosterior.load(post)
    assert loaded.subset.value == "all" and loaded.metadata()["prior"]["method"] == "val-nll"
    res = cli("predict", "--posterior", post, "--data", "digits:test", "--limit", "40", "--json")
    assert res.code == 0 and json.loads(res.out)["results"]["glm-probit"]["accuracy"] > 0.7
    res = cli(
        "predict",
        "--posterior",
        post,
        "--data",
        "digits:test",
        "--limit",
        "40",
        "--predictive",
        "bnn",
        "--link",
        "mc",
        "--samples",
        "50",
        "--json",
    )
    assert res.code == 0


def test_tampered_checkpoint_is_refused(cli, digits_ckpt, digits_posterior, tmp_path):
    tensors, meta = load_tensors(digits_ckpt)
    tensors = {k: v.clone() for k, v in tensors.items()}
    tensors["0.bias"] += 0.01
    bad = tmp_path / "tampered.safetensors"
    save_tensors(bad, tensors, meta)
    out = tmp_path / "p.json"
    line = one_error_line(
        cli(
            "predict",
            "--posterior",
            digits_posterior,
            "--checkpoint",
            bad,
            "--data",
            "digits:test",
            "--out",
            out,
        )
    )
    assert "sha256" in line and not out.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--hessian", "banana"], "banana"),
        (["--model", "keras:x"], "unknown model spec"),
        (["--data", "imagenet:test"], "unknown dataset"),
        (["--prior-precision", "-3"], "positive"),
        (["--checkpoint", "missing.safetensors"], "not found"),
    ],
)
def test_fit_bad_usage(cli, digits_ckpt, tmp_path, args, needle):
    out = tmp_path / "post.safetensors"
    base = {
        "--model": "builtin:small-cnn",
        "--checkpoint": str(digits_ckpt),
        "--data": "digits:train",
        "--out": str(out),
    }
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    flat = [x for kv in base.items() for x in kv]
    line = one_error_line(cli("fit-laplace", *flat))
    assert needle in line
    assert list(tmp_path.iterdir()) == []


def test_full_hessian_on_big_head_is_refused(cli, tmp_path):
    from helpers_models import wide_head

    ckpt = tmp_path / "wide.safetensors"
    save_file({k: v.contiguous() for k, v in wide_head(10).state_dict().items()}, str(ckpt))
    out = tmp_path / "post.safetensors"
    line = one_error_line(
        cli(
            "fit-laplace",
            "--model",
            "py:helpers_models:wide_head",
            "--checkpoint",
            ckpt,
            "--data",
            "digits:train",
            "--limit",
            "50",
            "--hessian",
            "full",
            "--out",
            out,
        )
    )
    assert "kron" in line and not out.exists()


def test_corrupt_and_pickled_checkpoints(cli, tmp_path):
    corrupt = tmp_path / "c.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert "corrupt" in one_error_line(
        cli(
            "fit-laplace",
            "--data",
            "digits:train",
            "--model",
            "builtin:small-cnn",
            "--checkpoint",
            corrupt,
            "--out",
            tmp_path / "p.safetensors",
        )
    )
    import argparse

    pickled = tmp_path / "p.pt"
    torch.save({"obj": argparse.Namespace(a=1)}, pickled)
    assert "weights-only" in one_error_line(
        cli(
            "fit-laplace",
            "--data",
            "digits:train",
            "--model",
            "timm:resnet18",
            "--checkpoint",
            pickled,
            "--out",
            tmp_path / "p.safetensors",
        )
    )


def test_wrong_input_shape_and_class_mismatch(cli, digits_ckpt, digits_posterior, tmp_path):
    np.savez(tmp_path / "wide.npz", x=np.zeros((4, 1, 28, 28), np.float32))
    line = one_error_line(
        cli("predict", "--posterior", digits_posterior, "--data", f"npz:{tmp_path / 'wide.npz'}")
    )
    assert "shape" in line
    np.savez(tmp_path / "labels.npz", x=np.zeros((4, 1, 8, 8), np.float32), y=np.array([0, 1, 2, 12]))
    line = one_error_line(
        cli("predict", "--posterior", digits_posterior, "--data", f"npz:{tmp_path / 'labels.npz'}")
    )
    assert "labels up to 12" in line
    tensors, meta = load_tensors(digits_posterior)
    meta["num_classes"] = 7
    bad = tmp_path / "k7.safetensors"
    save_tensors(bad, tensors, meta)
    line = one_error_line(cli("predict", "--posterior", bad, "--data", "digits:test"))
    assert "7 classes" in line


def test_nan_inputs_and_nan_features(cli, digits_ckpt, digits_posterior, tmp_path):
    x = np.zeros((4, 1, 8, 8), np.float32)
    x[2, 0, 3, 3] = np.nan
    np.savez(tmp_path / "nan.npz", x=x)
    out = tmp_path / "p.json"
    line = one_error_line(
        cli("predict", "--posterior", digits_posterior, "--data", f"npz:{tmp_path / 'nan.npz'}", "--out", out)
    )
    assert "NaN" in line and not out.exists()
    tensors, meta = load_tensors(digits_ckpt)
    tensors = {k: v.clone() for k, v in tensors.items()}
    tensors["7.weight"][0, 0] = float("nan")
    bad = tmp_path / "nanw.safetensors"
    save_tensors(bad, tensors, meta)
    line = one_error_line(
        cli(
            "fit-laplace",
            "--model",
            "builtin:small-cnn",
            "--checkpoint",
            bad,
            "--data",
            "digits:train",
            "--out",
            tmp_path / "post.safetensors",
        )
    )
    assert "non-finite" in line


def test_missing_dataset_is_a_usage_error(cli, digits_posterior, tmp_path):
    line = one_error_line(
        cli("predict", "--posterior", digits_posterior, "--data", "cifar10:test", "--data-root", tmp_path)
    )
    assert "--download" in line


def test_demo_runs_end_to_end(cli, tmp_path):
    res = cli("demo", "--out-dir", tmp_path, "--json")
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert report["results"]["map"]["accuracy"] >= 0.95
    assert {"glm-probit", "glm-bridge"} <= set(report["results"])
    assert report["topk"]["mean_k"] >= 1
    assert {p.name for p in tmp_path.iterdir()} == {
        "model.safetensors",
        "posterior.safetensors",
        "demo.json",
        "report.json",
        "report.html",
    }


@pytest.mark.parametrize("command", ["fit-laplace", "fit-vi"])
def test_fitting_commands_require_data(cli, digits_ckpt, tmp_path, command):
    """No silent digits:train default: omitting --data is a usage error naming it."""
    out = tmp_path / "p.safetensors"
    res = cli(command, "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt, "--out", out)
    assert res.code == 2 and "--data" in res.err and not out.exists()
