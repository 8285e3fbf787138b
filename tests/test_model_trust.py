"""Files never choose code to run; factory arguments from the command line, files and the current
directory; ``bayescli inspect``."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from bayescli.io import load_tensors, save_tensors
from bayescli.posterior.base import load_posterior


def _rewrite(src, dst, **meta_changes) -> None:
    tensors, meta = load_tensors(src)
    save_tensors(dst, tensors, {**meta, **meta_changes})


def test_a_posterior_naming_code_runs_nothing(cli, digits_posterior, tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.safetensors"
    _rewrite(digits_posterior, evil, model="py:subprocess:run", model_args={"args": ["touch", str(marker)]})
    out = tmp_path / "pred.json"
    for command in (["predict", "--out", out], ["topk", "--out", out], ["evaluate", "--out", out]):
        r = cli(command[0], "--posterior", evil, "--data", "digits:test", *command[1:], "--quiet")
        assert r.code == 2, r.err
        assert not marker.exists() and not out.exists()
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and "will not import" in lines[0]
        assert "--model py:subprocess:run" in lines[0] and "--trust-model-code" in lines[0]
    assert "subprocess" not in {m.split(".")[0] for m in sys.modules} or not marker.exists()


def test_a_posterior_of_py_code_needs_the_user_to_name_it(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cwd_models.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def mlp_model(input_dim: int, output_dim: int, hidden: int = 16):
                return nn.Sequential(nn.Flatten(), nn.Linear(input_dim, hidden), nn.ReLU(),
                                     nn.Linear(hidden, output_dim))
            """
        )
    )
    monkeypatch.delitem(sys.modules, "cwd_models", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 24), torch.nn.ReLU(), torch.nn.Linear(24, 10)
    )
    ckpt = tmp_path / "mlp.pt"
    torch.save(net.state_dict(), ckpt)
    post = tmp_path / "post.safetensors"
    spec = "py:cwd_models:mlp_model"
    fit = ["fit-laplace", "--model", spec, "--checkpoint", ckpt, "--data", "digits:train", "--limit", "200"]
    # required factory arguments: a clear error without them, typed by the signature with them
    r = cli(*fit, "--out", post, "--quiet")
    assert r.code == 2 and "input_dim" in r.err and not post.exists()
    r = cli(*fit, "--model-arg", "input_dim=64", "--model-arg", "output_dim=10", "--model-arg", "hidden=24",
            "--out", post, "--quiet")  # fmt: skip
    assert r.code == 0, r.err
    meta = load_posterior(post).meta
    assert meta["model_args"] == {"input_dim": 64, "output_dim": 10, "hidden": 24}
    predict = ["predict", "--posterior", post, "--data", "digits:test", "--limit", "50", "--quiet"]
    r = cli(*predict)
    assert r.code == 2 and f"pass --model {spec}" in r.err
    r = cli(*predict, "--model", spec)
    assert r.code == 0, r.err
    r = cli(*predict, "--trust-model-code")
    assert r.code == 0, r.err
    r = cli("predict", "--posterior", post, "--data", "digits:test", "--model", "builtin:mlp", "--quiet")
    assert r.code == 2 and "fitted on the model py:cwd_models:mlp_model, not builtin:mlp" in r.err


def test_checkpoint_arguments_outside_the_signature_are_not_passed(cli, tmp_path):
    from bayescli.data import load_data
    from bayescli.models.specs import load_classifier
    from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier

    train = load_data("digits:train", limit=100)
    clf, meta = train_classifier("builtin:mlp", train, None, TrainConfig(epochs=1, seed=0))
    path = tmp_path / "mlp.safetensors"
    save_checkpoint(path, clf, meta)
    tensors, meta = load_tensors(path)
    evil = tmp_path / "evil.safetensors"
    kwargs = {**meta["model_kwargs"], "exec_me": "x", "num_classes": 3}
    save_tensors(evil, tensors, {**meta, "model_kwargs": kwargs})
    loaded = load_classifier("builtin:mlp", evil)
    info = loaded.describe()
    assert "exec_me" not in info["model_args"] and "exec_me" in info["model_args_ignored"]
    assert loaded.classifier.num_classes == 10


def test_inspect_reports_what_was_read(cli, digits_ckpt):
    spec = ["--model", "builtin:small-cnn", "--checkpoint", digits_ckpt]
    r = cli("inspect", *spec, "--data", "digits:test", "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    assert info["num_classes"] == 10 and info["feature_dim"] == 128 and info["head"] == "9"
    assert info["output_kind"] == "logits" and info["inputs"] == 359
    assert 0.9 < info["map_accuracy"] <= 1.0
    assert info["checkpoint_format"] == "safetensors"
    r = cli("inspect", *spec)
    assert r.code == 0 and "feature_dim" in r.out and "128" in r.out


def test_inspect_refuses_a_wrong_architecture_in_one_line(cli, digits_ckpt):
    r = cli("inspect", "--model", "builtin:lenet", "--checkpoint", digits_ckpt)
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1


@pytest.fixture(autouse=True)
def _no_leaked_modules():
    yield
    sys.modules.pop("cwd_models", None)
