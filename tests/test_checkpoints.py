"""Checkpoints as people save them: formats by content, wrappers, prefixes, Lightning, mismatches."""

import json
import sys
import types

import pytest
import torch
from helpers_models import tiny_mlp

from bayescli.errors import BayescliError
from bayescli.io import sha256_file
from bayescli.models.checkpoints import load_weights, read_checkpoint, resolve_weights, tensor_dicts
from bayescli.models.specs import load_classifier

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


def test_prefix_the_architecture_has_is_kept(tmp_path):
    """A model whose own names start with ``model.`` must not lose that prefix."""
    inner = _net()
    outer = torch.nn.Module()
    outer.model = inner
    expected = {k: v.shape for k, v in outer.state_dict().items()}
    torch.save({"state_dict": outer.state_dict()}, tmp_path / "outer.pt")
    resolved = resolve_weights(outer, tmp_path / "outer.pt")
    assert resolved.stripped == "" and resolved.added == "" and set(resolved.state) == set(expected)
    torch.save(_prefixed(outer.state_dict(), "module."), tmp_path / "dp.pt")
    dp = resolve_weights(outer, tmp_path / "dp.pt")
    assert dp.stripped == "module." and dp.added == "" and set(dp.state) == set(expected)


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


def test_unknown_format_and_non_tensor_pickles_are_refused(tmp_path):
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
    res = cli("predict", "--posterior", out, "--model", SPEC, "--data", f"npz:{tmp_path / 'd.npz'}", "--json")
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


# ---------------------------------------------------------------------------------------------
# formats by content, Lightning, prefix mappings, torch's loading rules, causes of a misfit
# ---------------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class TinyResNet(torch.nn.Module):
    """conv1/bn1, layer1 of residual blocks, global pooling, fc: the names of torchvision's resnets."""

    def __init__(self, num_classes: int = 5, width: int = 4, blocks: int = 1) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.layer1 = torch.nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.fc = torch.nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(x.mean(dim=(2, 3)))


def wide_resnet(num_classes: int = 5) -> torch.nn.Module:
    return TinyResNet(num_classes, width=6)


def deep_resnet(num_classes: int = 5) -> torch.nn.Module:
    return TinyResNet(num_classes, blocks=2)


def ten_class_mlp() -> torch.nn.Module:
    """A factory without ``num_classes``: the class count cannot follow the checkpoint."""
    return tiny_mlp(10)


RESNET = f"py:{__name__}:TinyResNet"


def _resnet(seed: int = 0, **kwargs) -> TinyResNet:
    """A TinyResNet with BatchNorm statistics away from their defaults."""
    torch.manual_seed(seed)
    net = TinyResNet(**kwargs).train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(8, 1, 8, 8))
    return net.eval()


def _same_resnet_outputs(loaded, net) -> None:
    x = torch.rand(4, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded.classifier(x), net(x))


@pytest.mark.parametrize("suffix", [".pt", ".ckpt", ".bin", ".weights"])
def test_safetensors_content_loads_whatever_the_extension(tmp_path, suffix):
    from safetensors.torch import save_file

    net = _net()
    path = tmp_path / f"model{suffix}"
    save_file(net.state_dict(), str(path))
    loaded = load_classifier(SPEC, path)
    assert loaded.describe()["checkpoint_format"] == "safetensors"
    _same_outputs(loaded, net)


@pytest.mark.parametrize("legacy", [False, True])
def test_torch_content_loads_whatever_the_extension(tmp_path, legacy):
    net = _net()
    path = tmp_path / "weights.safetensors"  # a torch file under the wrong name
    torch.save(net.state_dict(), path, _use_new_zipfile_serialization=not legacy)
    loaded = load_classifier(SPEC, path)
    assert loaded.describe()["checkpoint_format"] == ("torch-legacy" if legacy else "torch-zip")
    _same_outputs(loaded, net)


def test_other_formats_are_named_with_the_accepted_ones(tmp_path):
    import numpy as np

    for name, write in [
        ("arrays.pt", lambda p: np.savez(p.open("wb"), w=np.zeros(3))),  # a zip, but not torch's
        ("plain.pt", lambda p: p.write_bytes(__import__("pickle").dumps({"w": [1.0]}, protocol=2))),
        ("model.onnx", lambda p: p.write_bytes(b"\x08\x07\x12\x04onnx")),
    ]:
        path = tmp_path / name
        write(path)
        with pytest.raises(BayescliError) as err:
            read_checkpoint(path)
        msg = str(err.value)
        assert msg.startswith(f"unsupported checkpoint format: {path} is not safetensors")
        assert "torch.save file (zip or legacy)" in msg and "\n" not in msg


def test_torchscript_is_refused_unrun(tmp_path):
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(_net()), str(path))
    with pytest.raises(
        BayescliError, match="is a TorchScript archive, which is code that bayescli does not run"
    ):
        read_checkpoint(path)


def test_lightning_checkpoint_loads_into_the_bare_network(tmp_path):
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    net(torch.rand(2, 1, 8, 8)).sum().backward()
    opt.step()
    path = tmp_path / "epoch=3.ckpt"
    torch.save(
        {
            "state_dict": _prefixed(net.state_dict(), "network."),
            "pytorch-lightning_version": "2.1.0",
            "hyper_parameters": {"hidden": 64},
            "epoch": 3,
            "optimizer_states": [opt.state_dict()],
        },
        path,
    )
    ckpt = read_checkpoint(path)
    assert ckpt.format == "torch-zip" and ckpt.lightning_version == "2.1.0"
    assert ckpt.hyper_parameters == {"hidden": 64}
    loaded = load_classifier(SPEC, path)
    info = loaded.describe()
    assert info["checkpoint_key"] == "state_dict" and info["stripped_prefixes"] == ["network."]
    assert (
        info["lightning_version"] == "2.1.0"
        and "Lightning checkpoint (version 2.1.0)" in info["checkpoint_notes"]
    )
    _same_outputs(loaded, net)


class AttributeDict(dict):
    """Stands in for Lightning's hyper-parameter dict: a class, defined in a module gone at loading."""


AttributeDict.__module__ = "fake_lightning"


def test_lightning_hyper_parameters_of_a_dict_subclass_become_a_plain_dict(tmp_path, monkeypatch):
    """Lightning's ``AttributeDict`` is a class: weights-only refuses it, the records keep its items."""
    fake = types.ModuleType("fake_lightning")
    fake.AttributeDict = AttributeDict
    monkeypatch.setitem(sys.modules, "fake_lightning", fake)
    net = _net()
    path = tmp_path / "last.ckpt"
    content = {
        "state_dict": _prefixed(net.state_dict(), "model."),
        "pytorch-lightning_version": "1.9.5",
        "hyper_parameters": AttributeDict(hidden=16, lr=0.1),
    }
    torch.save(content, path)
    monkeypatch.delitem(sys.modules, "fake_lightning")
    ckpt = read_checkpoint(path)
    assert ckpt.format == "object-pickle-zip" and ckpt.lightning_version == "1.9.5"
    assert ckpt.hyper_parameters == {"hidden": 16, "lr": 0.1} and type(ckpt.hyper_parameters) is dict
    _same_outputs(load_classifier(SPEC, ckpt.path), net)


@pytest.mark.parametrize("prefix", ["network.", "net.", "backbone.body.", "teacher.encoder._orig_mod."])
def test_any_prefix_shared_by_the_keys_is_stripped(tmp_path, prefix):
    net = _resnet()
    path = tmp_path / "p.pt"
    torch.save({"state_dict": _prefixed(net.state_dict(), prefix)}, path)
    loaded = load_classifier(RESNET, path)
    assert loaded.describe()["stripped_prefixes"] == [prefix]
    _same_resnet_outputs(loaded, net)


def test_a_prefix_the_architecture_has_is_added_and_sibling_keys_ignored(tmp_path):
    inner = _net()
    outer = torch.nn.Module()
    outer.model = tiny_mlp(5)
    path = tmp_path / "bare.pt"
    torch.save(inner.state_dict(), path)
    resolved = load_weights(outer, path)
    assert (
        resolved.added == "model."
        and resolved.stripped == ""
        and resolved.describe()["added_prefixes"] == ["model."]
    )
    x = torch.rand(3, 1, 8, 8)
    assert torch.equal(outer.model(x), inner(x))
    # a Lightning module's loss weights sit beside the network under another prefix
    torch.save(
        {"state_dict": {**_prefixed(inner.state_dict(), "net."), "criterion.weight": torch.ones(5)}}, path
    )
    resolved = load_weights(tiny_mlp(5), path)
    assert resolved.stripped == "net." and resolved.ignored == ["criterion.weight"]
    assert resolved.describe()["ignored_keys"] == 1


def test_checkpoint_key_with_a_prefix_picks_one_network_of_a_dict(tmp_path):
    student, teacher = _net(seed=0), _net(seed=1)
    path = tmp_path / "distill.ckpt"
    torch.save(
        {
            "state_dict": {
                **_prefixed(student.state_dict(), "student."),
                **_prefixed(teacher.state_dict(), "teacher."),
            }
        },
        path,
    )
    first = load_classifier(SPEC, path)
    assert first.describe()["stripped_prefixes"] == ["student."]
    _same_outputs(first, student)
    chosen = load_classifier(SPEC, path, checkpoint_key="state_dict.teacher")
    assert chosen.describe()["checkpoint_key"] == "state_dict.teacher"
    _same_outputs(chosen, teacher)


def test_state_dicts_of_old_torch_lack_num_batches_tracked(tmp_path):
    """BatchNorm's own loading fills ``num_batches_tracked`` for state dicts without a version."""
    net = _resnet()
    old = {k: v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert len(old) == len(net.state_dict()) - 3
    path = tmp_path / "old.pth"
    torch.save(old, path)
    loaded = load_classifier(RESNET, path)
    _same_resnet_outputs(loaded, net)
    # a state dict of a torch that writes versions (2) lacking them really is missing them
    new = net.state_dict()
    for k in [k for k in new if k.endswith("num_batches_tracked")]:
        del new[k]
    assert new._metadata["bn1"]["version"] == 2
    torch.save(new, path)
    with pytest.raises(BayescliError, match=r"3 missing \(first 'bn1.num_batches_tracked'\)"):
        load_classifier(RESNET, path)


def test_version_metadata_follows_the_prefix_mapping(tmp_path):
    net = _resnet()
    state = net.state_dict()
    wrapped = type(state)(_prefixed(state, "module."))
    wrapped._metadata = type(state._metadata)(
        (f"module.{k}" if k else "module", v) for k, v in state._metadata.items()
    )
    for k in [k for k in wrapped if k.endswith("num_batches_tracked")]:
        del wrapped[k]
    path = tmp_path / "dp.pt"
    torch.save(wrapped, path)
    resolved = resolve_weights(_resnet(), path)
    assert resolved.state._metadata["layer1.0.bn2"] == {"version": 2}
    with pytest.raises(BayescliError, match="3 missing"):
        load_weights(_resnet(), path)


def test_wrong_architecture_says_check_model(tmp_path):
    path = tmp_path / "mlp.pt"
    torch.save(_net().state_dict(), path)
    with pytest.raises(BayescliError) as err:
        load_classifier(RESNET, path)
    msg = str(err.value)
    assert f"does not match {RESNET}" in msg and "\n" not in msg
    assert msg.endswith("belongs to another architecture: check --model")


def test_wrong_variant_says_check_the_variant(tmp_path):
    path = tmp_path / "narrow.pt"
    torch.save(_resnet().state_dict(), path)
    with pytest.raises(BayescliError) as err:
        load_classifier(f"py:{__name__}:wide_resnet", path)
    msg = str(err.value)
    assert "with other shapes (first 'conv1.weight': checkpoint (4, 1, 3, 3), model (6, 1, 3, 3))" in msg
    assert "same layer names, other sizes: check the model variant" in msg
    with pytest.raises(BayescliError, match="some layers differ: it is another version or variant"):
        load_classifier(f"py:{__name__}:deep_resnet", path)


def test_wrong_class_count_says_the_class_count(tmp_path):
    from bayescli.io import save_tensors
    from bayescli.models.specs import mlp

    path = tmp_path / "five.pt"
    torch.save(_net(k=5).state_dict(), path)
    with pytest.raises(BayescliError) as err:
        load_classifier(f"py:{__name__}:ten_class_mlp", path)
    msg = str(err.value)
    assert "the checkpoint's head '3' has 5 classes and the model's 10" in msg
    assert "build the model with the checkpoint's class count (5)" in msg
    # a builtin checkpoint whose metadata disagrees with its head
    builtin = tmp_path / "mlp.safetensors"
    save_tensors(
        builtin,
        mlp(3, (1, 8, 8)).state_dict(),
        {"model": "builtin:mlp", "num_classes": 10, "input_shape": [1, 8, 8]},
    )
    with pytest.raises(BayescliError, match="head '5' has 3 classes and the model's 10"):
        load_classifier("builtin:mlp", builtin)


def test_a_prefix_no_mapping_resolves_is_named(tmp_path):
    """Half the keys carry ``module.``: stripping it or not, some keys stay unmatched."""
    path = tmp_path / "half.pt"
    for k, missing in [(3, "2 missing (first '1.weight')"), (5, "2 missing (first '3.weight')")]:
        state = _net(k=k).state_dict()
        torch.save(
            {"state_dict": {("module." + n if n.startswith("1.") else n): v for n, v in state.items()}}, path
        )
        with pytest.raises(BayescliError) as err:
            load_classifier(SPEC, path)
        msg = str(err.value)
        assert "keys under 'module.' fit the model only without that prefix" in msg
        assert "--checkpoint-key DICT[.PREFIX]" in msg and missing in msg


def test_describe_records_the_provenance(tmp_path):
    net = _net()
    path = tmp_path / "wrapped.pt"
    torch.save({"state_dict": _prefixed(net.state_dict(), "module."), "epoch": 1}, path)
    info = load_classifier(SPEC, path).describe()
    provenance = {
        "checkpoint_key": "state_dict",
        "stripped_prefixes": ["module."],
        "added_prefixes": [],
        "ignored_keys": 0,
        "checkpoint_format": "torch-zip",
        "checkpoint_notes": ["torch zip file read weights-only"],
        "lightning_version": None,
    }
    assert {k: info.get(k, "absent") for k in provenance} == provenance
    assert info["checkpoint_sha256"] == sha256_file(path) and info["num_classes"] == 5


def test_equal_shapes_decide_between_dicts_of_the_same_names(tmp_path):
    """A fine-tuned state dict after the pretrained one it started from (another head size)."""
    pretrained, finetuned = _net(k=10, seed=0), _net(k=5, seed=1)
    path = tmp_path / "both.pt"
    torch.save({"pretrained": pretrained.state_dict(), "finetuned": finetuned.state_dict()}, path)
    net = tiny_mlp(5)
    assert load_weights(net, path).key == "finetuned"
    x = torch.rand(3, 1, 8, 8)
    assert torch.equal(net(x), finetuned(x))
