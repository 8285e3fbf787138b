"""Checkpoints as other people publish them, through the CLI end to end: each format fits, predicts
and reports the same MAP accuracy as the network in memory."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from bayescli.data import load_data
from bayescli.posterior.base import load_posterior

# Accuracies on digits:test (359 inputs) agree when the same inputs are classified correctly.
SAME_COUNT = 0.5 / 359

MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn


    class CNN(nn.Module):
        def __init__(self, hidden: int = 16, num_classes: int = 10, log_softmax: bool = False,
                     tuple_output: bool = False):
            super().__init__()
            self.conv = nn.Conv2d(1, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.fc1 = nn.Linear(8 * 16, hidden)
            self.fc2 = nn.Linear(hidden, num_classes)
            self.out = nn.LogSoftmax(dim=1) if log_softmax else nn.Identity()
            self.tuple_output = tuple_output

        def forward(self, x):
            h = torch.relu(self.bn(self.conv(x)))
            h = nn.functional.adaptive_avg_pool2d(h, 4).flatten(1)
            h = torch.relu(self.fc1(h))
            z = self.out(self.fc2(h))
            return (z, h) if self.tuple_output else z


    class Lit(nn.Module):  # a LightningModule keeps its network under an attribute of its own
        def __init__(self, hidden: int = 16, lr: float = 0.1):
            super().__init__()
            self.network = CNN(hidden, log_softmax=True)

        def forward(self, x):
            return self.network(x)


    def lit_network(hidden: int = 16):
        return CNN(hidden, log_softmax=True)


    def tuple_cnn(hidden: int = 16):
        return CNN(hidden, tuple_output=True)


    def conv_head():
        return nn.Sequential(nn.Conv2d(1, 12, 3, padding=1), nn.ReLU(), nn.Dropout(0.1), nn.Conv2d(12, 10, 1),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten())


    def relu_conv_head():
        return nn.Sequential(nn.Conv2d(1, 12, 3, padding=1), nn.ReLU(), nn.Conv2d(12, 10, 1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten())
    """
)


@pytest.fixture
def zoo(tmp_path, monkeypatch):
    """The model module in the current directory (found there by py: specs), and digits rows."""
    (tmp_path / "zoo_models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # for building the nets here; the CLI finds it via cwd
    sys.modules.pop("zoo_models", None)
    import zoo_models

    yield zoo_models
    sys.modules.pop("zoo_models", None)


def _train(net: torch.nn.Module, steps: int = 60) -> torch.nn.Module:
    data = load_data("digits:train", limit=400)
    x, y = data.x, data.y
    torch.manual_seed(0)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    net.train()
    for i in range(steps):
        sl = slice((i * 64) % 400, (i * 64) % 400 + 64)
        out = net(x[sl])
        out = out[0] if isinstance(out, tuple) else out
        torch.nn.functional.cross_entropy(out, y[sl]).backward()
        opt.step()
        opt.zero_grad()
    return net.eval()


def _accuracy(net: torch.nn.Module) -> float:
    data = load_data("digits:test")
    with torch.no_grad():
        out = net(data.x)
    out = out[0] if isinstance(out, tuple) else out
    return (out.argmax(1) == data.y).float().mean().item()


def _fit_and_predict(cli, tmp_path, spec: str, ckpt, *extra: str) -> dict:
    """Fit and evaluate on the CPU: the MAP accuracy is compared with the net's, run in-process there."""
    extra = (*extra, "--device", "cpu")
    post = tmp_path / "post.safetensors"
    r = cli("fit-laplace", "--model", spec, "--checkpoint", ckpt, "--data", "digits:train", "--limit", "300",
            "--prior-precision", "1", "--out", post, "--json", *extra)  # fmt: skip
    assert r.code == 0, r.err
    fit = json.loads(r.out)
    r = cli("evaluate", "--posterior", post, "--model", spec, "--data", "digits:test", "--methods",
            "map,glm-probit", "--ood-scores", "msp", "--out", tmp_path / "r.json", "--quiet")  # fmt: skip
    assert r.code == 0, r.err
    report = json.loads((tmp_path / "r.json").read_text())
    return {"fit": fit, "meta": load_posterior(post).meta, "report": report}


def _map_accuracy(res: dict) -> float:
    return res["report"]["results"]["in_distribution"]["map"]["accuracy"]


def test_old_torch_batchnorm_state_dict(cli, tmp_path, zoo):
    net = _train(zoo.CNN())
    state = {"module." + k: v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    ckpt = tmp_path / "resnet.th"
    torch.save({"state_dict": state, "best_prec1": 0.9}, ckpt, _use_new_zipfile_serialization=False)
    res = _fit_and_predict(cli, tmp_path, "py:zoo_models:CNN", ckpt)
    assert res["meta"]["checkpoint_format"] == "torch-legacy"
    assert _map_accuracy(res) == pytest.approx(_accuracy(net), abs=SAME_COUNT)


def test_lightning_checkpoint_with_hyper_parameters_and_log_softmax(cli, tmp_path, zoo):
    lit = zoo.Lit(hidden=24)
    _train(lit)
    ckpt = tmp_path / "epoch=3.ckpt"
    torch.save(
        {"state_dict": lit.state_dict(), "pytorch-lightning_version": "2.4.0", "epoch": 3,
         "hyper_parameters": {"hidden": 24, "lr": 0.1}, "optimizer_states": [{"state": {}}]},
        ckpt,
    )  # fmt: skip
    # the bare network's factory takes `hidden` from hyper_parameters; `network.` is mapped away
    res = _fit_and_predict(cli, tmp_path, "py:zoo_models:lit_network", ckpt)
    meta = res["meta"]
    assert meta["model_args"] == {"hidden": 24}
    assert meta["model_args_sources"] == {"hidden": "hyper_parameters"}
    assert meta["stripped_prefixes"] == ["network."] and meta["lightning_version"] == "2.4.0"
    assert meta["output_kind"] == "log-probabilities"
    assert _map_accuracy(res) == pytest.approx(_accuracy(lit), abs=SAME_COUNT)
    # the MAP NLL is the network's own: softmax of log-probabilities is its distribution
    data = load_data("digits:test")
    with torch.no_grad():
        nll = torch.nn.functional.nll_loss(lit(data.x), data.y).item()
    assert res["report"]["results"]["in_distribution"]["map"]["nll"] == pytest.approx(nll, rel=1e-4)
    # the LightningModule itself as the factory works too (its state dict matches as saved)
    res = _fit_and_predict(cli, tmp_path, "py:zoo_models:Lit", ckpt)
    assert res["meta"]["model_args"] == {"hidden": 24, "lr": 0.1}


@pytest.mark.parametrize("legacy", [False, True])
def test_whole_pickled_module(cli, tmp_path, zoo, legacy):
    net = _train(zoo.CNN())
    ckpt = tmp_path / "model.pt"
    torch.save(net, ckpt, _use_new_zipfile_serialization=not legacy)
    res = _fit_and_predict(cli, tmp_path, "py:zoo_models:CNN", ckpt)
    assert res["meta"]["checkpoint_format"] == f"module-pickle-{'legacy' if legacy else 'zip'}"
    assert any("zoo_models.CNN" in n for n in res["meta"]["checkpoint_notes"])
    assert _map_accuracy(res) == pytest.approx(_accuracy(net), abs=SAME_COUNT)


def test_tuple_output(cli, tmp_path, zoo):
    net = _train(zoo.tuple_cnn())
    ckpt = tmp_path / "tuple.pt"
    torch.save(net.state_dict(), ckpt)
    res = _fit_and_predict(cli, tmp_path, "py:zoo_models:tuple_cnn", ckpt)
    assert res["meta"]["output"] == 0
    assert _map_accuracy(res) == pytest.approx(_accuracy(net), abs=SAME_COUNT)
    # naming the element explicitly gives the same, a wrong one is refused in one line
    again = _fit_and_predict(cli, tmp_path, "py:zoo_models:tuple_cnn", ckpt, "--output", "0")
    assert again["meta"]["output"] == 0
    r = cli("fit-laplace", "--model", "py:zoo_models:tuple_cnn", "--checkpoint", ckpt,
            "--data", "digits:train", "--output", "1", "--out", tmp_path / "x.safetensors")  # fmt: skip
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1 and not (tmp_path / "x.safetensors").exists()


def test_conv1x1_head(cli, tmp_path, zoo):
    net = _train(zoo.conv_head())
    ckpt = tmp_path / "squeeze.pt"
    torch.save(net.state_dict(), ckpt)
    res = _fit_and_predict(cli, tmp_path, "py:zoo_models:conv_head", ckpt)
    assert res["meta"]["head_kind"] == "conv1x1-pool" and res["meta"]["feature_dim"] == 12
    assert _map_accuracy(res) == pytest.approx(_accuracy(net), abs=SAME_COUNT)


def test_nonlinear_conv_head_refuses_last_layer_and_fits_all_layers(cli, tmp_path, zoo):
    net = _train(zoo.relu_conv_head())
    ckpt = tmp_path / "squeeze.pt"
    torch.save(net.state_dict(), ckpt)
    out = tmp_path / "p.safetensors"
    fit = ["fit-laplace", "--model", "py:zoo_models:relu_conv_head", "--checkpoint", ckpt,
           "--data", "digits:train", "--limit", "200", "--out", out]  # fmt: skip
    r = cli(*fit)
    assert r.code == 2 and "--subset all" in r.err and len(r.err.strip().splitlines()) == 1
    assert not out.exists()
    r = cli(*fit, "--subset", "all", "--hessian", "diag", "--prior-precision", "1", "--quiet")
    assert r.code == 0, r.err
    r = cli("predict", "--posterior", out, "--model", "py:zoo_models:relu_conv_head", "--data",
            "digits:test", "--link", "probit", "--out", tmp_path / "pred.json", "--quiet")  # fmt: skip
    assert r.code == 0, r.err
    pred = json.loads((tmp_path / "pred.json").read_text())
    assert pred["results"]["glm-probit"]["accuracy"] == pytest.approx(_accuracy(net), abs=0.02)


def test_hugging_face_folder(cli, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=10,
        id2label={i: f"digit-{i}" for i in range(10)},
    )  # fmt: skip
    torch.manual_seed(0)
    net = transformers.ViTForImageClassification(config).eval()
    folder = tmp_path / "vit"
    net.save_pretrained(folder)
    post = tmp_path / "post.safetensors"
    r = cli("fit-laplace", "--model", f"hf:{folder}", "--data", "digits:train", "--limit", "200",
            "--prior-precision", "1", "--out", post, "--json")  # fmt: skip
    assert r.code == 0, r.err
    meta = load_posterior(post).meta
    assert meta["head"] == "classifier" and meta["output"] == "logits"
    assert meta["feature_dim"] == 16
    assert meta["class_names"][3] == "digit-3" and meta["checkpoint"] == str(folder / "model.safetensors")
    # an hf spec read from a file names installed library code: predict needs no --model
    r = cli("predict", "--posterior", post, "--data", "digits:test", "--link", "none",
            "--save-logits", "--out", tmp_path / "pred.safetensors", "--quiet")  # fmt: skip
    assert r.code == 0, r.err
    from bayescli.io import load_tensors

    saved, _ = load_tensors(tmp_path / "pred.safetensors")
    with torch.no_grad():
        logits = net(load_data("digits:test").x).logits
    assert torch.allclose(saved["logit_mean"], logits, atol=1e-5)
