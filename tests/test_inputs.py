"""Inputs as users hold them (issue 37, part 5) and stage progress lines (part 2).

Each message is checked against the mistake that triggers it, in the file formats people hold
(float npz of 0–255 pixels, channels-last npz, truncated .safetensors/.pt), and its opposite
passes silently.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bayescli import progress
from bayescli.cli.common import floats
from bayescli.data import load_data
from bayescli.errors import BayescliError
from bayescli.fitting.registry import parse_setting
from bayescli.models.preprocess import Preprocess, PreprocessOverrides
from bayescli.numbers import parse_number, parse_numbers

# ---------------------------------------------------------------- numbers and fractions


def test_parse_number_fractions_and_errors():
    assert parse_number("1/255") == 1 / 255
    assert parse_number(" 2/255 ") == 2 / 255
    assert parse_number("1e-3") == 1e-3
    assert parse_number(0.25) == 0.25
    assert parse_numbers("0.5,1/4") == (0.5, 0.25)
    for bad in ("x", "1/0", "nan", "1/2/3", ""):
        with pytest.raises(BayescliError, match="--std"):
            parse_number(bad, "--std")


def test_every_number_reader_takes_fractions():
    """--std/--mean, --set values, --fgsm and --rotation read numbers with the one parser."""
    assert floats("1/255,1/255,1/255", "--std") == (1 / 255,) * 3
    assert parse_setting("mnvi", "kl_weight", "1/1000") == 1 / 1000
    from bayescli.data.shifts import parse_angles
    from bayescli.evaluation.attacks import parse_epsilons

    assert parse_epsilons("0,2/255") == [("0", 0.0), ("2/255", 2 / 255)]
    assert parse_angles("0,90/2") == [0.0, 45.0]


def test_cli_float_options_take_fractions_and_keep_their_bounds(cli, digits_posterior):
    res = cli("topk", "--posterior", digits_posterior, "--data", "digits:test", "--limit", "40",
              "--threshold", "1/20", "--json")  # fmt: skip
    assert res.code == 0, res.err
    assert json.loads(res.out)["threshold"] == 1 / 20
    res = cli("conformal", "--posterior", digits_posterior, "--data", "digits:test", "--alpha", "2", "-q")
    assert res.code == 2 and "--alpha must be within" in res.err
    res = cli("conformal", "--posterior", digits_posterior, "--data", "digits:test", "--alpha", "a/b", "-q")
    assert res.code == 2 and "fraction like" in res.err


# ---------------------------------------------------------------- npz as users save them


@pytest.fixture(scope="module")
def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_data("digits:test").take(slice(0, 60))
    return x.numpy(), y.numpy()


def test_float_npz_in_0_255_is_refused_naming_the_range(cli, digits_posterior, digits_arrays, tmp_path):
    x, y = digits_arrays
    path = tmp_path / "f255.npz"
    np.savez(path, x=x * 255, y=y)
    out = tmp_path / "pred.json"
    res = cli("predict", "--posterior", digits_posterior, "--data", f"npz:{path}", "--out", out, "-q")
    assert res.code == 2
    assert "hold values in [0, 255]" in res.err and "x / 255" in res.err
    assert len(res.err.strip().splitlines()) == 1 and not out.exists()


def test_float_npz_in_0_1_passes_silently(cli, digits_posterior, digits_arrays, tmp_path):
    x, y = digits_arrays
    path = tmp_path / "f01.npz"
    np.savez(path, x=x, y=y)
    res = cli("predict", "--posterior", digits_posterior, "--data", f"npz:{path}", "-q")
    assert res.code == 0 and res.err == ""
    data = load_data(f"npz:{path}")  # tabular floats of any scale pass: no pixel scale to check
    torch.testing.assert_close(data.x, torch.from_numpy(x))
    tabular = tmp_path / "tab.npz"
    np.savez(tabular, x=np.full((5, 3), 300.0, dtype=np.float32), y=np.arange(5) % 2)
    assert load_data(f"npz:{tabular}").x.max() == 300.0


def test_channels_last_npz_is_refused(cli, digits_posterior, digits_arrays, tmp_path):
    x, y = digits_arrays
    path = tmp_path / "last.npz"
    np.savez(path, x=(x.transpose(0, 2, 3, 1) * 255).astype(np.uint8), y=y)
    res = cli("predict", "--posterior", digits_posterior, "--data", f"npz:{path}", "-q")
    assert res.code == 2
    assert "channels-last [N, H, W, C] = [60, 8, 8, 1]" in res.err and "transpose(0, 3, 1, 2)" in res.err


def test_rgb_data_into_a_grey_net_names_the_channels(cli, digits_posterior, digits_arrays, tmp_path):
    x, y = digits_arrays
    path = tmp_path / "rgb.npz"
    np.savez(path, x=np.repeat(x, 3, 1), y=y)
    res = cli("predict", "--posterior", digits_posterior, "--data", f"npz:{path}", "-q")
    assert res.code == 2
    assert "3-channel inputs [3, 8, 8]" in res.err and "takes 1-channel inputs" in res.err


@pytest.mark.parametrize("preset", ["imagenet", "cifar"])
def test_a_3_channel_preset_on_a_grey_net_is_refused(cli, digits_ckpt, tmp_path, preset):
    out = tmp_path / "p.safetensors"
    res = cli("fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt, "--data",
              "digits:train", "--preprocess", preset, "--out", out, "-q")  # fmt: skip
    assert res.code == 2 and not out.exists()
    assert f"the '{preset}' preprocessing normalises 3 channels" in res.err
    assert "takes 1-channel inputs" in res.err and "Given groups" not in res.err


def test_truncated_checkpoints_and_posteriors_are_named(cli, digits_ckpt, digits_posterior, tmp_path):
    from bayescli.models.checkpoints import read_checkpoint
    from bayescli.models.specs import load_classifier

    net = load_classifier("builtin:small-cnn", digits_ckpt).classifier.network
    full_pt = tmp_path / "full.pt"
    torch.save(net.state_dict(), full_pt)
    assert read_checkpoint(full_pt).format == "torch-zip"  # the uncut file reads
    cut = {}
    for name, source in (
        ("cut.pt", full_pt),
        ("cut.safetensors", digits_ckpt),
        ("head.safetensors", digits_ckpt),
    ):
        data = source.read_bytes()
        cut[name] = tmp_path / name
        cut[name].write_bytes(data[:100] if name.startswith("head") else data[: len(data) // 2])
    for name, path in cut.items():
        out = tmp_path / f"{name}.post.safetensors"
        res = cli("fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", path, "--data",
                  "digits:train", "--out", out, "-q")  # fmt: skip
        assert res.code == 2 and not out.exists(), name
        assert "truncated or corrupt" in res.err and "unsupported" not in res.err, res.err
    post = tmp_path / "cut-post.safetensors"
    post.write_bytes(digits_posterior.read_bytes()[:5000])
    res = cli("predict", "--posterior", post, "--data", "digits:test", "-q")
    assert res.code == 2 and "truncated or corrupt" in res.err


# ---------------------------------------------------------------- multi-label labels


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint8, np.bool_])
def test_multilabel_zero_one_in_any_numeric_dtype(tmp_path, dtype):
    y = (np.arange(24).reshape(8, 3) % 2).astype(dtype)
    path = tmp_path / "ml.npz"
    np.savez(path, x=np.zeros((8, 4), np.float32), y=y)
    data = load_data(f"npz:{path}")
    assert data.multilabel and data.y.dtype == torch.int64
    torch.testing.assert_close(data.y, torch.from_numpy(y.astype(np.int64)))


def test_multilabel_soft_targets_are_refused_naming_them(tmp_path):
    y = np.zeros((6, 3), np.float32)
    y[0, 1], y[2, 2] = 0.9, 0.1  # label smoothing is not a label
    path = tmp_path / "soft.npz"
    np.savez(path, x=np.zeros((6, 4), np.float32), y=y)
    with pytest.raises(BayescliError, match=r"only 0 and 1; found 0\.1, 0\.9 in 2 cells"):
        load_data(f"npz:{path}")


# ---------------------------------------------------------------- prediction-time preprocessing


def test_overrides_keep_the_recorded_recipe_unless_replaced():
    base = Preprocess("checkpoint", (0.3,), (0.4,))
    assert PreprocessOverrides().apply(base, "builtin:small-cnn") is base
    resized = PreprocessOverrides(resize=28).apply(base, "builtin:small-cnn")
    assert (resized.mean, resized.std, resized.resize) == ((0.3,), (0.4,), 28)
    assert resized.source == "checkpoint+overrides"
    preset = PreprocessOverrides(preset="cifar").apply(base, "builtin:small-cnn")
    assert preset.mean == (0.4914, 0.4822, 0.4465) and preset.resize is None
    assert PreprocessOverrides(resize=28, std=(1 / 255,)).to_meta() == {"std": [1 / 255], "resize": 28}
    with pytest.raises(BayescliError, match="--mean and --std together"):
        PreprocessOverrides(mean=(0.5,)).apply(Preprocess(), "builtin:mlp")


def test_predict_and_evaluate_resize_another_datasets_images(cli, digits_posterior, digits_arrays, tmp_path):
    """A net fitted on 8-px digits predicts 16-px images with --resize 8: the numbers equal those
    of the same images resized by hand (the oracle), and the report records the override."""
    from torchvision.transforms.v2 import functional as tvf

    x, y = digits_arrays
    big = torch.nn.functional.interpolate(torch.from_numpy(x), size=16, mode="bilinear").clamp(0, 1)
    np.savez(tmp_path / "x16.npz", x=big.numpy(), y=y)
    by_hand = tvf.resize(big, [8], antialias=True).clamp(0, 1)
    np.savez(tmp_path / "x8.npz", x=by_hand.numpy(), y=y)
    res = cli("predict", "--posterior", digits_posterior, "--data", f"npz:{tmp_path / 'x16.npz'}", "-q")
    assert res.code == 2 and "expects [1, 8, 8]" in res.err  # without the override
    resized = cli("predict", "--posterior", digits_posterior, "--data", f"npz:{tmp_path / 'x16.npz'}",
                  "--resize", "8", "--json")  # fmt: skip
    oracle = cli("predict", "--posterior", digits_posterior, "--data", f"npz:{tmp_path / 'x8.npz'}", "--json")
    assert resized.code == 0 and oracle.code == 0, resized.err
    got, want = json.loads(resized.out), json.loads(oracle.out)
    assert got["preprocess_overrides"] == {"resize": 8} and got["preprocess"]["resize"] == 8
    assert got["preprocess"]["mean"] == want["preprocess"]["mean"]  # the fit's normalisation kept
    for method, row in want["results"].items():
        for metric, value in row.items():
            assert got["results"][method][metric] == pytest.approx(value, rel=1e-5, abs=1e-6), metric

    out = tmp_path / "ev.json"
    res = cli("evaluate", "--posterior", digits_posterior, "--data", f"npz:{tmp_path / 'x16.npz'}",
              "--resize", "8", "--out", out)  # fmt: skip
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    assert report["protocol"]["preprocess_overrides"] == {"resize": 8}
    assert report["model"]["preprocess"]["resize"] == 8
    fidelity = report["protocol"]["link_fidelity"]
    assert (fidelity["inputs"], fidelity["of"], fidelity["samples"]) == (32, 60, 2000)
    # not a terminal: one line per stage on stderr, in order
    stages = [line for line in res.err.splitlines() if line.startswith("evaluate: [")]
    assert [s.split("] ", 1)[1].split(" ")[0] for s in stages] == ["prepare", "in-distribution:", "link"]
    quiet = cli("evaluate", "--posterior", digits_posterior, "--data", f"npz:{tmp_path / 'x16.npz'}",
                "--resize", "8", "--fidelity-inputs", "0", "--json")  # fmt: skip
    assert quiet.code == 0 and "evaluate: [" not in quiet.err


# ---------------------------------------------------------------- stage progress


def test_stage_lines_only_inside_an_enabled_session(capsys):
    progress.set_enabled(True)
    try:
        progress.stage("outside")  # library use: no session, nothing printed
        with progress.session("select"):
            progress.stage("fit and score laplace (1/2)")
            assert list(progress.track([1, 2], 2, "batches")) == [1, 2]
            progress.stage("fit and score mnvi (2/2)")
        progress.set_enabled(False)
        with progress.session("select"):
            progress.stage("silent")
    finally:
        progress.set_enabled(False)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert err[0].startswith("select: [") and err[0].endswith("] fit and score laplace (1/2)")
    assert err[1].endswith("] fit and score mnvi (2/2)")


def test_select_reports_each_stage_on_one_line(cli, digits_ckpt, tmp_path):
    args = ("select", "--model", "builtin:small-cnn", "--data", "digits:train", "--checkpoint", digits_ckpt,
            "--val-data", "digits:val", "--ood", "patches", "--methods", "temperature,laplace-diag",
            "--out-dir", tmp_path / "sel")  # fmt: skip
    res = cli(*args)
    assert res.code == 0, res.err
    stages = [line.split("] ", 1)[1] for line in res.err.splitlines() if line.startswith("select: [")]
    assert stages == [
        "backbone pass: validation data",
        "backbone pass: fitting data",
        "backbone pass: 1 OOD set",
        "fit and score temperature (1/2)",
        "fit and score laplace-diag (2/2)",
    ]
    assert "select: [" not in cli(*args, "--quiet").err
