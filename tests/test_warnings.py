"""No silent wrong results: a model fed the wrong labels, or images resized far from their size,
warns once (a Python warning in the library, one `warning:` line on stderr in the CLI)."""

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from bayescli.data import load_data
from bayescli.data.shifts import rotate
from bayescli.errors import LowAccuracyWarning, ResizeWarning
from bayescli.features import extract_features
from bayescli.models import load_classifier


@pytest.fixture(scope="module")
def permuted_npz(tmp_path_factory) -> Path:
    """digits:test with every label moved to the next class: a good model scores ~0% on it."""
    test = load_data("digits:test")
    path = tmp_path_factory.mktemp("perm") / "permuted.npz"
    np.savez(path, x=test.x.numpy(), y=((test.y + 1) % 10).numpy())
    return path


class _no_warning:  # noqa: N801 - used like pytest.warns(...)
    def __init__(self, category: type[Warning]) -> None:
        self.category = category

    def __enter__(self) -> None:
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error", self.category)

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def accuracy_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:") and "MAP accuracy" in line]


# ---------------------------------------------------------------------------------------------
# low MAP accuracy
# ---------------------------------------------------------------------------------------------


def test_extract_features_warns_on_low_accuracy(digits_ckpt, permuted_npz):
    model = load_classifier("builtin:small-cnn", digits_ckpt)
    data = load_data(f"npz:{permuted_npz}")
    with pytest.warns(LowAccuracyWarning, match="MAP accuracy on npz:") as record:
        extract_features(model, data)
    (w,) = [r.message for r in record if isinstance(r.message, LowAccuracyWarning)]
    assert w.accuracy < 0.2 and w.spec == data.spec and "--preprocess" in str(w)
    with _no_warning(LowAccuracyWarning):
        extract_features(model, load_data("digits:test"))  # the right labels: no warning
        extract_features(model, data.drop_labels())  # unlabelled: nothing to judge
        # a deliberate shift (rotation, corruption, attack) may score low: not the model's fault
        extract_features(model, data.map_inputs(partial(rotate, angle=90.0)))


@pytest.mark.parametrize("subset", ["last-layer", "all"])
def test_fit_vi_warns_once_on_low_accuracy(cli, digits_ckpt, permuted_npz, tmp_path, subset):
    res = cli(
        "fit-vi", "--method", "mnvi", "--subset", subset, "--model", "builtin:small-cnn",
        "--checkpoint", digits_ckpt, "--data", f"npz:{permuted_npz}", "--epochs", "1",
        "--out", tmp_path / "m.safetensors", "--quiet",
    )  # fmt: skip
    assert res.code == 0, res.err
    lines = accuracy_lines(res.err)
    assert len(lines) == 1 and "the fitting data npz:" in lines[0], res.err


def test_fit_vi_is_quiet_on_good_data(cli, digits_ckpt, tmp_path):
    res = cli(
        "fit-vi", "--method", "mnvi", "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt,
        "--data", "digits:train", "--epochs", "1", "--out", tmp_path / "m.safetensors", "--quiet",
    )  # fmt: skip
    assert res.code == 0, res.err
    assert not accuracy_lines(res.err), res.err


@pytest.mark.parametrize(
    "command",
    [
        ["predict"],
        ["topk"],
        ["conformal", "--calibration-data", "digits:val", "--method", "map"],
    ],
)
def test_prediction_commands_warn_once_on_low_accuracy(cli, digits_posterior, permuted_npz, command):
    res = cli(*command, "--posterior", digits_posterior, "--data", f"npz:{permuted_npz}", "--quiet")
    assert res.code == 0, res.err
    lines = accuracy_lines(res.err)
    assert len(lines) == 1 and f"the data npz:{permuted_npz}" in lines[0], res.err
    good = cli(*command, "--posterior", digits_posterior, "--data", "digits:test", "--quiet")
    assert good.code == 0, good.err
    assert not accuracy_lines(good.err), good.err


def test_conformal_warns_on_wrong_calibration_labels(cli, digits_posterior, permuted_npz):
    res = cli(
        "conformal", "--posterior", digits_posterior, "--data", "digits:test", "--method", "map",
        "--calibration-data", f"npz:{permuted_npz}", "--quiet",
    )  # fmt: skip
    assert res.code == 0, res.err
    lines = accuracy_lines(res.err)
    assert len(lines) == 1 and "the calibration data npz:" in lines[0], res.err


# ---------------------------------------------------------------------------------------------
# a preset that resizes the images by more than 2×
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def conv_ckpt(tmp_path_factory) -> Path:
    from helpers_models import tiny_conv

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("conv") / "conv.pt"
    torch.save(tiny_conv(3).state_dict(), path)
    return path


def _images(path: Path, side: int) -> Path:
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(12, 3, side, side, generator=gen) * 255).to(torch.uint8)
    np.savez(path, x=x.numpy(), y=np.arange(12) % 3)
    return path


def resize_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("warning:") and "preprocessing resizes" in ln]


def test_imagenet_preset_on_small_images_warns_once(cli, conv_ckpt, tmp_path):
    data = f"npz:{_images(tmp_path / 'small.npz', 16)}"
    res = cli(
        "inspect", "--model", "py:helpers_models:tiny_conv", "--checkpoint", conv_ckpt,
        "--data", data, "--preprocess", "imagenet", "--quiet",
    )  # fmt: skip
    assert res.code == 0, res.err
    lines = resize_lines(res.err)
    assert len(lines) == 1, res.err
    for fact in ("16×16", "256 px", "16.0×", "224", "'imagenet'", "--resize/--crop", "--preprocess none"):
        assert fact in lines[0], (fact, lines[0])
    # fit-laplace loads the fitting data and the validation data: still one line
    res = cli(
        "fit-laplace", "--model", "py:helpers_models:tiny_conv", "--checkpoint", conv_ckpt,
        "--data", data, "--preprocess", "imagenet", "--prior-precision", "val-nll",
        "--val-data", data, "--out", tmp_path / "p.safetensors", "--quiet",
    )  # fmt: skip
    assert res.code == 0, res.err
    assert len(resize_lines(res.err)) == 1, res.err


@pytest.mark.parametrize(("side", "options"), [(8, ["--resize", "8", "--crop", "8"]), (16, ["--resize=32"])])
def test_recipes_within_2x_do_not_warn(cli, conv_ckpt, tmp_path, side, options):
    res = cli(
        "inspect", "--model", "py:helpers_models:tiny_conv", "--checkpoint", conv_ckpt,
        "--data", f"npz:{_images(tmp_path / 'd.npz', side)}", *options, "--quiet",
    )  # fmt: skip
    assert res.code == 0, res.err
    assert not resize_lines(res.err), res.err


def test_load_data_issues_resize_warning(tmp_path):
    from bayescli.preprocess import resolve_preprocess

    pre = resolve_preprocess("imagenet", "builtin:x")
    with pytest.warns(ResizeWarning, match=r"downsamples them 4\.0×"):
        load_data(f"npz:{_images(tmp_path / 'big.npz', 1024)}", preprocess=pre)
    with pytest.warns(ResizeWarning, match=r"upsamples them 8\.0×"):
        load_data(f"npz:{_images(tmp_path / 'cifar.npz', 32)}", preprocess=pre)


def test_image_folders_warn_on_upsampling_only(tmp_path):
    from PIL import Image

    from bayescli.preprocess import resolve_preprocess

    pre = resolve_preprocess("imagenet", "builtin:x")
    for side in (16, 1024):
        (tmp_path / str(side) / "a").mkdir(parents=True)
        Image.new("RGB", (side, side)).save(tmp_path / str(side) / "a" / "x.png")
    with pytest.warns(ResizeWarning, match="16×16"):
        load_data(f"imagefolder:{tmp_path / '16'}", preprocess=pre)
    with _no_warning(ResizeWarning):  # photos larger than the model's input are the usual case
        load_data(f"imagefolder:{tmp_path / '1024'}", preprocess=pre)
