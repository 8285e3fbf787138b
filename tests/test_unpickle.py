"""Whole pickled modules (``torch.save(model, path)``) read without running any code of the file."""

import argparse
import builtins
import os
import subprocess
import sys
import zipfile
from collections import OrderedDict

import pytest
import torch
from torch import nn

from bayescli.errors import BayescliError
from bayescli.models.checkpoints import read_checkpoint
from bayescli.models.specs import load_classifier
from bayescli.models.unpickle import Inert, module_state_dict, read_torch_pickle


class CNN(nn.Module):
    """Nested modules: a Sequential inside a custom module, BatchNorm, a bias-free conv (a None
    parameter) and a non-persistent buffer (not in the state dict)."""

    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(3)
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Sequential(nn.BatchNorm2d(4)))
        self.fc = nn.Linear(4 * 6 * 6, num_classes)
        self.register_buffer("scratch", torch.ones(5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(torch.relu(self.bn1(self.conv1(x)))).flatten(1))


def _trained(seed: int = 0) -> CNN:
    """A CNN with non-default BatchNorm statistics, so a lost buffer would change its outputs."""
    torch.manual_seed(seed)
    net = CNN()
    net.train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(16, 1, 8, 8))
    return net.eval()


class _MainAlias:
    """Save ``cls`` as ``__main__.<name>`` (the usual script checkpoint); gone again afterwards."""

    def __init__(self, cls: type) -> None:
        self.cls, self.module = cls, cls.__module__

    def __enter__(self) -> None:
        self.cls.__module__ = "__main__"
        setattr(sys.modules["__main__"], self.cls.__qualname__, self.cls)

    def __exit__(self, *exc: object) -> None:
        self.cls.__module__ = self.module
        delattr(sys.modules["__main__"], self.cls.__qualname__)


def _save(obj: object, path, legacy: bool = False, protocol: int = 2) -> None:
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy, pickle_protocol=protocol)


@pytest.mark.parametrize(("legacy", "protocol"), [(False, 2), (True, 2), (False, 1)])
def test_module_tree_becomes_its_state_dict(tmp_path, legacy, protocol):
    net = _trained()
    path = tmp_path / "whole.pt"
    _save(net, path, legacy, protocol)
    read = read_torch_pickle(path)
    assert read.layout == ("legacy" if legacy else "zip")
    assert isinstance(read.content, Inert) and read.content.origin == f"{__name__}.CNN"
    state = module_state_dict(read.content)
    expected = net.state_dict()
    assert list(state) == list(expected)  # same names, same order; no 'conv1.bias', no 'scratch'
    assert all(torch.equal(state[k], v) and state[k].dtype == v.dtype for k, v in expected.items())


@pytest.mark.filterwarnings("ignore:Couldn't retrieve source code")  # torch.save, legacy, of __main__.CNN
@pytest.mark.parametrize("legacy", [False, True])
def test_main_class_loads_into_the_named_architecture(tmp_path, legacy):
    """``__main__.CNN`` cannot be imported when loading; its weights load into ``--model``."""
    net = _trained(seed=1)
    path = tmp_path / "script_model.pth"
    with _MainAlias(CNN):
        _save(net, path, legacy)
    assert not hasattr(sys.modules["__main__"], "CNN")
    ckpt = read_checkpoint(path)
    assert ckpt.format == f"module-pickle-{'legacy' if legacy else 'zip'}"
    assert ckpt.modules == {"": "__main__.CNN"}
    assert "whole pickled module __main__.CNN" in ckpt.notes
    loaded = load_classifier(f"py:{__name__}:CNN", path)
    x = torch.rand(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded.classifier(x), net(x))
    assert loaded.describe()["checkpoint_format"] == ckpt.format


def test_module_inside_a_training_dict_is_found(tmp_path):
    net = _trained(seed=2)
    path = tmp_path / "train_state.pt"
    _save({"epoch": 7, "model": net, "opt": argparse.Namespace(lr=0.1)}, path)
    ckpt = read_checkpoint(path)
    assert ckpt.modules == {"model": f"{__name__}.CNN"} and ckpt.content["epoch"] == 7
    assert ckpt.content["opt"] == {"lr": 0.1}  # a Namespace record becomes its data
    loaded = load_classifier(f"py:{__name__}:CNN", path)
    assert loaded.describe()["checkpoint_key"] == "model"
    x = torch.rand(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded.classifier(x), net(x))


class _Payload:
    """What an attacker pickles: ``__reduce__`` names a callable and its arguments."""

    def __init__(self, call: tuple) -> None:
        self.call = call

    def __reduce__(self) -> tuple:
        return self.call


def _payloads(target) -> dict[str, tuple]:
    return {
        "os.system": (os.system, (f"touch {target}",)),
        "builtins.exec": (builtins.exec, (f"open({str(target)!r}, 'w').close()",)),
        "subprocess.run": (subprocess.run, (["touch", str(target)],)),
    }


@pytest.mark.parametrize("name", ["os.system", "builtins.exec", "subprocess.run"])
@pytest.mark.parametrize("legacy", [False, True])
def test_code_in_a_module_dict_never_runs(tmp_path, name, legacy):
    target = tmp_path / "pwned"
    net = _trained()
    net.payload = _Payload(_payloads(target)[name])  # lands in the module's __dict__
    path = tmp_path / "evil.pt"
    _save(net, path, legacy)
    read = read_torch_pickle(path)  # the mechanism alone: the payload is a record beside the tree
    assert list(module_state_dict(read.content)) == list(net.state_dict())
    payload = read.content.state["payload"]
    assert isinstance(payload, Inert) and payload.origin in read.calls
    assert str(target) in str(payload.args)
    with pytest.raises(BayescliError) as err:
        load_classifier(f"py:{__name__}:CNN", path)
    msg = str(err.value)
    assert "\n" not in msg and "bayescli ran nothing and refuses it" in msg and payload.origin in msg
    assert not target.exists()


def test_code_in_place_of_a_submodule_never_runs(tmp_path, cli):
    target = tmp_path / "pwned"
    net = _trained()
    net._modules["body"] = _Payload((os.system, (f"touch {target}",)))
    path = tmp_path / "evil.pt"
    _save(net, path)
    res = cli(
        "fit-laplace",
        "--data",
        "digits:train",
        "--model",
        f"py:{__name__}:CNN",
        "--checkpoint",
        path,
        "--out",
        tmp_path / "p.safetensors",
    )
    assert res.code == 2 and res.err.count("\n") == 1 and "ran nothing" in res.err
    assert not target.exists() and not (tmp_path / "p.safetensors").exists()


class _Trap:
    """Importable here, unlike ``__main__`` classes: a stock unpickler would call ``__setstate__``."""

    def __setstate__(self, state: dict) -> None:
        open(state["path"], "w").close()


def test_importable_classes_are_never_instantiated(tmp_path):
    target = tmp_path / "setstate-ran"
    trap = _Trap.__new__(_Trap)
    trap.__dict__["path"] = str(target)
    net = _trained()
    net.trap = trap
    path = tmp_path / "trap.pt"
    _save(net, path)
    read = read_torch_pickle(path)
    assert read.content.state["trap"].state == {"path": str(target)}  # BUILD stored, not applied
    assert f"{__name__}._Trap" in read.calls
    ckpt = read_checkpoint(path)
    assert ckpt.modules == {"": f"{__name__}.CNN"} and not target.exists()


@pytest.mark.parametrize(
    ("obj", "named"),
    [(argparse.Namespace(w=1), "argparse.Namespace"), (os.getcwd, "posix.getcwd"), (_Trap, "_Trap")],
)
def test_a_forbidden_global_at_the_top_is_one_line(tmp_path, obj, named):
    path = tmp_path / "top.pt"
    _save(obj, path)
    with pytest.raises(BayescliError) as err:
        read_checkpoint(path)
    msg = str(err.value)
    assert "\n" not in msg and "holds no torch module tree" in msg and named in msg


def test_a_parameter_that_is_not_a_tensor_is_named(tmp_path):
    net = _trained()
    net.fc._parameters["weight"] = _Payload((complex, (1.0, 2.0)))
    path = tmp_path / "odd.pt"
    _save(net, path)
    with pytest.raises(BayescliError, match=r"'fc.weight' is stored as a record of builtins.complex"):
        read_checkpoint(path)


def test_truncated_storage_is_refused(tmp_path):
    path = tmp_path / "whole.pt"
    _save(_trained(), path)
    broken = tmp_path / "broken.pt"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(broken, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, data[:-4] if info.filename.endswith("/data/0") else data)
    with pytest.raises(
        BayescliError, match=r"cannot read .*broken.pt \(storage '0' is missing or not \d+ bytes"
    ):
        read_checkpoint(broken)


class _View:
    """Pickles as a tensor reaching past the end of its storage (a corrupt or hostile file)."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage

    def __reduce__(self) -> tuple:
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, (100,), (1,), False, OrderedDict())


def test_a_tensor_reaching_past_its_storage_is_refused(tmp_path):
    path = tmp_path / "view.pt"
    # the Namespace first, so weights-only refuses the file before it reaches the tensor
    _save({"args": argparse.Namespace(lr=0.1), "w": _View(torch.ones(4).untyped_storage())}, path)
    with pytest.raises(
        BayescliError, match=r"\(a tensor reaches element 99 of a storage of 16: the file is corrupt"
    ):
        read_checkpoint(path)
