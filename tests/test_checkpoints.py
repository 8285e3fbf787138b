"""Checkpoints as people save them: torch extensions, wrappers, wrapper prefixes, mismatches."""

import json

import pytest
import torch
from helpers_models import tiny_mlp

from bayescli.checkpoints import read_checkpoint, resolve_state_dict, tensor_dicts
from bayescli.errors import BayescliError
from bayescli.models import load_classifier

SPEC = "py:helpers_models:tiny_mlp"


def _net(k: int = 5, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tiny_mlp(k).eval()


def _prefixed(state: dict, prefix: str) -> dict:
    return {prefix + k: v for k, v in state.items()}


def _same_outputs(loaded, net) -> None:
    x = torch.rand(4, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded.classifier(x), net(x))


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".th", ".tar", ".bin", ".ckpt"])
def test_every_torch_extension_loads(tmp_path, suffix):
    net = _net()
    path = tmp_path / f"model{suffix}"
    torch.save(net.state_dict(), path)
    loaded = load_classifier(SPEC, path)
    assert loaded.classifier.num_classes == 5
    _same_outputs(loaded, net)


@pytest.mark.parametrize(
    ("wrap", "key"),
    [
        (lambda sd: {"state_dict": sd, "epoch": 3}, "state_dict"),
        (lambda sd: {"model": sd, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}}, "model"),
        (lambda sd: {"model_state_dict": sd, "best_acc": 0.9}, "model_state_dict"),
        (lambda sd: {"net": sd}, "net"),
        (lambda sd: {"checkpoint": {"module": sd}}, "checkpoint.module"),
    ],
)
def test_wrappers_are_unwrapped(tmp_path, wrap, key):
    net = _net()
    path = tmp_path / "wrapped.pth"
    torch.save(wrap(net.state_dict()), path)
    loaded = load_classifier(SPEC, path)
    assert loaded.describe()["checkpoint_key"] == key
    _same_outputs(loaded, net)


@pytest.mark.parametrize(
    "prefix", ["module.", "_orig_mod.", "model.", "module._orig_mod.", "model._orig_mod.module."]
)
def test_wrapper_prefixes_are_stripped(tmp_path, prefix):
    net = _net()
    path = tmp_path / "p.th"
    torch.save({"state_dict": _prefixed(net.state_dict(), prefix)}, path)
    loaded = load_classifier(SPEC, path)
    assert "".join(loaded.describe()["stripped_prefixes"]) == prefix
    _same_outputs(loaded, net)


def test_prefix_the_architecture_has_is_kept():
    """A model whose own names start with ``model.`` must not lose that prefix."""
    inner = _net()
    outer = torch.nn.Module()
    outer.model = inner
    expected = {k: v.shape for k, v in outer.state_dict().items()}
    resolved = resolve_state_dict({"state_dict": outer.state_dict()}, expected)
    assert resolved.stripped == [] and set(resolved.state) == set(expected)
    dp = resolve_state_dict(_prefixed(outer.state_dict(), "module."), expected)
    assert dp.stripped == ["module."] and set(dp.state) == set(expected)


def test_the_dict_that_fits_wins_and_checkpoint_key_chooses(tmp_path):
    net, ema = _net(seed=0), _net(seed=1)
    path = tmp_path / "ema.pt"
    content = {"hyper": {"w": torch.zeros(3)}, "model": net.state_dict(), "model_ema": ema.state_dict()}
    torch.save(content, path)
    first = load_classifier(SPEC, path)
    assert first.describe()["checkpoint_key"] == "model"
    _same_outputs(first, net)
    chosen = load_classifier(SPEC, path, checkpoint_key="model_ema")
    _same_outputs(chosen, ema)
    with pytest.raises(BayescliError, match="'model_ema'") as err:
        load_classifier(SPEC, path, checkpoint_key="nope")
    assert "choose one of" in str(err.value)


def test_tensor_dicts_lists_every_candidate():
    sd = {"a": torch.zeros(1)}
    found = tensor_dicts({"x": sd, "y": [sd, {"b": 1}], "z": {"w": {"c": torch.ones(1)}}, "n": 3})
    assert set(found) == {"x", "y.0", "z.w"}


def test_mismatch_names_missing_unexpected_and_shapes(tmp_path):
    path = tmp_path / "other.pt"
    state = _net().state_dict()
    state["extra.weight"] = torch.zeros(2)
    del state["1.bias"]
    torch.save(state, path)
    with pytest.raises(BayescliError) as err:
        load_classifier(SPEC, path)
    msg = str(err.value)
    assert "1 missing (first '1.bias')" in msg and "1 unexpected (first 'extra.weight')" in msg
    assert "\n" not in msg

    shapes = tiny_mlp(5).state_dict()
    shapes["1.weight"] = torch.zeros(16, 65)
    torch.save(shapes, path)
    with pytest.raises(BayescliError, match=r"other shapes \(first '1.weight': checkpoint \(16, 65\)"):
        load_classifier(SPEC, path)


def test_unknown_extension_and_non_tensor_pickles_are_refused(tmp_path):
    path = tmp_path / "model.h5"
    path.write_bytes(b"x")
    with pytest.raises(BayescliError, match="unsupported checkpoint format"):
        read_checkpoint(path)
    path = tmp_path / "hyper.pt"
    torch.save({"lr": 0.1, "epochs": [1, 2]}, path)
    with pytest.raises(BayescliError, match="no dict of tensors"):
        load_classifier(SPEC, path)


def test_fit_laplace_on_a_dataparallel_th_checkpoint(cli, tmp_path):
    """The path of the issue: a ``.th`` DataParallel checkpoint of someone else's model."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images[:300] / 16.0, dtype=torch.float32)[:, None]
    y = torch.tensor(digits.target[:300])
    torch.manual_seed(0)
    net = tiny_mlp(10)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    ckpt = tmp_path / "resnet20.th"
    torch.save({"state_dict": _prefixed(net.state_dict(), "module."), "best_prec1": 0.9}, ckpt)
    import numpy as np

    np.savez(tmp_path / "d.npz", x=x.numpy(), y=y.numpy())
    out = tmp_path / "post.safetensors"
    res = cli(
        "fit-laplace", "--model", SPEC, "--checkpoint", ckpt, "--data", f"npz:{tmp_path / 'd.npz'}",
        "--prior-precision", "1.0", "--out", out, "--json",
    )  # fmt: skip
    assert res.code == 0, res.err
    summary = json.loads(res.out)
    assert summary["checkpoint_key"] == "state_dict" and summary["stripped_prefixes"] == ["module."]
    assert summary["map_accuracy"] > 0.9 and "warning" not in res.err
    # later commands re-load the model through the recorded key and prefixes
    res = cli("predict", "--posterior", out, "--data", f"npz:{tmp_path / 'd.npz'}", "--json")
    assert res.code == 0, res.err


def test_low_accuracy_warns_with_the_usual_causes(cli, tmp_path):
    import numpy as np

    torch.manual_seed(0)
    x = torch.rand(200, 1, 8, 8)
    y = torch.randint(0, 10, (200,))
    np.savez(tmp_path / "d.npz", x=x.numpy(), y=y.numpy())
    ckpt = tmp_path / "random.pt"
    torch.save(tiny_mlp(10).state_dict(), ckpt)
    res = cli(
        "fit-laplace", "--model", SPEC, "--checkpoint", ckpt, "--data", f"npz:{tmp_path / 'd.npz'}",
        "--prior-precision", "1.0", "--out", tmp_path / "p.safetensors", "--json",
    )  # fmt: skip
    assert res.code == 0, res.err
    assert "warning: MAP accuracy on the fitting data" in res.err and "--preprocess" in res.err
    assert json.loads(res.out)["map_accuracy"] < 0.3
