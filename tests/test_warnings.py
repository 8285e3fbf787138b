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
from bayescli.models.features import extract_features
from bayescli.models.specs import load_classifier
from bayescli.posterior.selection import Selection


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
        "--checkpoint", digits_ckpt, "--data", f"npz:{permuted_npz}", "--set", "epochs=1",
        "--out", tmp_path / "m.safetensors", "--quiet",
    )  # fmt: skip
    assert res.code == 0, res.err
    lines = accuracy_lines(res.err)
    assert len(lines) == 1 and "the fitting data npz:" in lines[0], res.err


def test_fit_vi_is_quiet_on_good_data(cli, digits_ckpt, tmp_path):
    res = cli(
        "fit-vi", "--method", "mnvi", "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt,
        "--data", "digits:train", "--set", "epochs=1", "--out", tmp_path / "m.safetensors", "--quiet",
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
    from bayescli.models.preprocess import resolve_preprocess

    pre = resolve_preprocess("imagenet", "builtin:x")
    with pytest.warns(ResizeWarning, match=r"downsamples them 4\.0×"):
        load_data(f"npz:{_images(tmp_path / 'big.npz', 1024)}", preprocess=pre)
    with pytest.warns(ResizeWarning, match=r"upsamples them 8\.0×"):
        load_data(f"npz:{_images(tmp_path / 'cifar.npz', 32)}", preprocess=pre)


def test_image_folders_warn_on_upsampling_only(tmp_path):
    from PIL import Image

    from bayescli.models.preprocess import resolve_preprocess

    pre = resolve_preprocess("imagenet", "builtin:x")
    for side in (16, 1024):
        (tmp_path / str(side) / "a").mkdir(parents=True)
        Image.new("RGB", (side, side)).save(tmp_path / str(side) / "a" / "x.png")
    with pytest.warns(ResizeWarning, match="16×16"):
        load_data(f"imagefolder:{tmp_path / '16'}", preprocess=pre)
    with _no_warning(ResizeWarning):  # photos larger than the model's input are the usual case
        load_data(f"imagefolder:{tmp_path / '1024'}", preprocess=pre)


# ---------------------------------------------------------------------------------------------
# issue 37 part 3: "already calibrated" / "underconfident" / "MAP point" only where the evidence is
# ---------------------------------------------------------------------------------------------


def _sampled(scale: float, n: int = 20000, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[n, k]`` and labels ``[n]`` drawn from ``softmax(logits)``, returned as the net's
    logits times ``scale``: calibrated at 1 (T = 1), underconfident below (T = scale), over above."""
    gen = torch.Generator().manual_seed(0)
    z = 2.0 * torch.randn(n, k, generator=gen, dtype=torch.float64)
    y = torch.multinomial(z.softmax(-1), 1, generator=gen).squeeze(1)
    return z * scale, y


def _numpy_temperature(z: torch.Tensor, y: torch.Tensor) -> float:
    """The NLL-minimising T by NumPy grids over log β = −log T (an oracle independent of scipy's
    bounded Brent): spacing 1e-2 over [−3, 3], then 1e-4 around the best point."""
    from scipy.special import logsumexp

    zz, yy = z.numpy(), y.numpy()
    picked = zz[np.arange(len(yy)), yy]

    def best(logb: np.ndarray) -> float:
        nll = [np.mean(logsumexp(zz * np.exp(v), axis=1) - picked * np.exp(v)) for v in logb]
        return float(logb[int(np.argmin(nll))])

    coarse = best(np.arange(-3.0, 3.0, 1e-2))
    return float(np.exp(-best(np.arange(coarse - 1e-2, coarse + 1e-2, 1e-4))))


def _flat_selection(z: torch.Tensor, y: torch.Tensor, with_logits: bool = True):
    """select_on_grid where every candidate's predictive is MAP's: the MAP end wins the tie."""
    from bayescli.posterior.selection import Scored, select_on_grid

    probs = z.softmax(-1)
    return select_on_grid(
        "prior_precision",
        [1.0, 10.0, 100.0],
        lambda v: (v, Scored(probs, z.double().log_softmax(-1))),
        y,
        map_probs=probs,
        map_logits=z if with_logits else None,
        map_side="high",
    )[1]


@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0])
def test_map_end_warning_names_the_calibration_evidence(scale):
    z, y = _sampled(scale)
    sel = _flat_selection(z, y)
    assert sel.map_point and "reaches the MAP limit" in sel.warning
    # the temperature the warning quotes is the NLL's minimiser (sampling noise ≈ 1% at n = 20000;
    # the NumPy grid's spacing 0.01%)
    expected = _numpy_temperature(z, y)
    assert abs(sel.map_temperature / expected - 1) < 2e-3, (sel.map_temperature, expected)
    assert abs(expected - scale) < 0.05 * scale
    assert sel.record()["map_temperature"] == sel.map_temperature
    if scale == 1.0:  # T ≈ 1 and a small ECE: calibrated, and only then
        assert sel.map_scores["ece"] <= 0.02
        assert "already calibrated" in sel.warning and "confident" not in sel.warning
    elif scale < 1:
        assert f"underconfident (temperature T = {sel.map_temperature:.3g} < 1" in sel.warning
        assert "calibrated" not in sel.warning
    else:
        assert "overconfident (temperature T" in sel.warning and "calibrated" not in sel.warning


def test_map_end_warning_without_map_logits_says_nothing_of_calibration():
    sel = _flat_selection(*_sampled(0.5), with_logits=False)
    assert sel.map_point and "reaches the MAP limit" in sel.warning and sel.map_temperature is None
    assert "calibrated" not in sel.warning and "confident" not in sel.warning
    # the calibration rule alone: T ≈ 1 with a large ECE is not evidence of calibration
    from bayescli.posterior.selection import calibration_verdict

    assert calibration_verdict(1.02, 0.15, "δ") is None
    assert "already calibrated" in calibration_verdict(1.02, 0.01, "δ")


@pytest.fixture(scope="module")
def underconfident_ckpt(digits_ckpt, tmp_path_factory) -> Path:
    """The digits CNN with its head (weight and bias) scaled by 0.2: label-smoothing-like
    underconfidence (a temperature < 1 fits its validation data)."""
    from bayescli.io import load_tensors, save_tensors

    tensors, meta = load_tensors(digits_ckpt)
    head = [k for k, v in tensors.items() if k.endswith(".weight") and v.dim() == 2 and v.shape[0] == 10][-1]
    for key in (head, head[: -len("weight")] + "bias"):
        tensors[key] = tensors[key] * 0.2
    path = tmp_path_factory.mktemp("under") / "cnn.safetensors"
    save_tensors(path, tensors, meta)
    return path


def _laplace_selection(ckpt: Path) -> dict:
    from bayescli.fitting.laplace import LaplaceSettings
    from bayescli.fitting.pipeline import ModelOptions, fit_from_specs

    model = ModelOptions("builtin:small-cnn", ckpt)
    run = fit_from_specs(
        "laplace", model, "digits:train", settings=LaplaceSettings(hessian="diag"), val="digits:val"
    )
    return run.posterior.metadata()["selection"]


def test_laplace_on_an_underconfident_net_says_underconfident(underconfident_ckpt, digits_ckpt):
    sel = _laplace_selection(underconfident_ckpt)
    assert sel["validated"] and sel["map_point"], sel
    assert sel["map_temperature"] < 0.9
    assert "underconfident (temperature T" in sel["warning"] and "calibrated" not in sel["warning"]
    # the net as trained: whatever selection chooses, it is not called underconfident
    sel = _laplace_selection(digits_ckpt)
    assert "underconfident" not in sel.get("warning", "")


def test_evaluate_calls_a_bridge_posterior_map_only_where_selection_chose_map():
    """Issue 37: a confident net's bridge α₀ explodes on its confident inputs although δ = 25.9 is
    an interior optimum; only a record at the MAP end (or the MAP fallback) says "MAP point"."""
    from types import SimpleNamespace

    from bayescli.evaluation.methods import MethodOutput, expand_methods, parse_methods
    from bayescli.evaluation.runner import degenerate_posteriors

    methods = expand_methods(parse_methods("map,glm-bridge"), ["post"], False)
    alpha0 = torch.tensor([float("inf")] * 7 + [30.0] * 3)  # 70% of inputs saturated
    outs = {
        "map": MethodOutput(torch.full((10, 2), 0.5), {}, {}),
        "glm-bridge": MethodOutput(torch.full((10, 2), 0.5), {"alpha0": alpha0}, {}),
    }

    def line(selection: dict) -> str:
        post = {
            "post": SimpleNamespace(
                summary=lambda: {"prior_precision": selection["chosen"]},
                meta={},
                selection=Selection.from_record(selection),
            )
        }
        (out,) = degenerate_posteriors(methods, outs, post)
        return out

    interior = line({"validated": True, "setting": "prior_precision", "chosen": 25.9, "map_point": False})
    assert "MAP point" not in interior and "prior_precision = 25.9" in interior
    assert "short of the MAP limit" in interior and "on 70.0% of the inputs" in interior
    for record in (
        {"validated": True, "setting": "prior_precision", "chosen": 1e9, "map_point": True},
        {"validated": True, "setting": "prior_precision", "chosen": 1e9, "map_fallback": True},
    ):
        assert "chose the MAP limit" in line(record) and "MAP point" in line(record)
    # not chosen on held-out data: no claim either way, the advice is to choose δ there
    fixed = line({"validated": False, "setting": "prior_precision", "chosen": 25.9})
    assert "MAP point" not in fixed and "choose it on validation data" in fixed
