"""MNVI, FSVI and Dirichlet fVI with ``--device cuda``: checked on an emulated GPU.

As ``test_device_resident.py`` does for Laplace (see its docstring and ``device_harness.py``):
the emulated device computes with the CPU's kernels and seeded draws, so a run there must give
the CPU run's numbers to ``SAME``; a stray host tensor raises as CUDA does; and a run over more
batches must make exactly as many host reads (the objectives' loss curves are summed on the
device and read once per epoch, never per step). Each method is checked for

* ``fit-vi``: the file equals the CPU one and the VI loop's reads do not grow with its batches;
  through the Python API every tensor of the returned posterior is on the device;
* ``predict``, ``evaluate``, ``topk``, ``conformal`` with the CPU-fitted file: the CPU's outputs;
* ``train --method``: the checkpoint and the posterior file equal the CPU run's;
* multi-label (bernoulli) classifiers, for MNVI (the one of the three that fits them).

and :meth:`Posterior.to` moves a posterior there and back without changing its predictive.
Settings are small (300 fitting inputs, 1–2 epochs) so that each check takes seconds.
"""

from __future__ import annotations

import pytest
import torch
from device_harness import SAME, results, run_cli, same, same_tensors
from emulated_cuda import emulated_cuda
from tolerance import assert_close

import bayescli
from bayescli.data import load_data
from bayescli.fitting.pipeline import ModelOptions
from bayescli.models.features import extract_features
from bayescli.posterior.base import load_posterior
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier

# Per method: fit-vi options of a short fit. MNVI and FSVI choose their hyperparameter on the
# validation split the checkpoint records (digits:val), so their selection runs on the device too;
# Dirichlet fVI's τ selection refits over a 13-point grid, so its τ is given.
FITS = {
    "mnvi": ("--set", "epochs=2"),
    "mnvi-all": ("--subset", "all", "--set", "epochs=1", "--no-select"),
    "fsvi": ("--set", "epochs=2", "--set", "context_points=8"),
    "dirichlet-fvi": ("--set", "epochs=2", "--set", "members=3", "--set", "tau=0.5"),
}
VI_BATCHES = (32, 128)  # 300 fitting inputs: 10 vs 3 steps of the VI objective per epoch


def _method(name: str) -> str:
    return name.removesuffix("-all")


def _fit_args(ckpt, name: str) -> tuple:
    return ("fit-vi", "--method", _method(name), "--model", "builtin:small-cnn", "--checkpoint", ckpt,
            "--data", "digits:train", "--limit", 300, "--quiet", *FITS[name])  # fmt: skip


@pytest.fixture(scope="module")
def cpu_posteriors(digits_ckpt, tmp_path_factory) -> dict:
    """Each method's posterior, fitted on the CPU by ``fit-vi``."""
    from bayescli.cli.app import main

    out = tmp_path_factory.mktemp("vi-cpu")
    paths = {}
    for name in FITS:
        paths[name] = out / f"{name}.safetensors"
        args = [*_fit_args(digits_ckpt, name), "--out", paths[name], "--device", "cpu"]
        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in args])
        assert exc.value.code == 0
    return paths


@pytest.mark.parametrize("name", list(FITS))
def test_fit_vi_on_the_device_equals_cpu_and_reads_nothing_per_step(
    cli, digits_ckpt, cpu_posteriors, tmp_path, name
):
    reads, events = {}, {}
    for bs in VI_BATCHES:
        out = tmp_path / f"gpu{bs}.safetensors"
        args = (*_fit_args(digits_ckpt, name), "--train-batch-size", bs, "--out", out)
        res, reads[bs], events[bs] = run_cli(cli, *args, device="cuda")
        assert res.code == 0, res.err
    cpu = cli(*_fit_args(digits_ckpt, name), "--train-batch-size", VI_BATCHES[0],
              "--out", tmp_path / "cpu.safetensors", "--device", "cpu")  # fmt: skip
    assert cpu.code == 0, cpu.err
    meta_gpu, meta_cpu = same_tensors(
        tmp_path / f"gpu{VI_BATCHES[0]}.safetensors", tmp_path / "cpu.safetensors"
    )
    for key in ("selection", "curve", "history", "kl_weight", "prior_var", "prior_scale", "tau"):
        if key in meta_cpu:
            same(_untimed(meta_gpu[key]), _untimed(meta_cpu[key]), key)
    assert reads[VI_BATCHES[0]] == reads[VI_BATCHES[1]], (
        f"host reads {reads}: 10 vs 3 steps per epoch\n{events[32]}"
    )


def _untimed(value):
    """A record without its wall-clock entries (they differ between any two runs)."""
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k != "seconds"}
    return value


# Without validation data (fit-vi above runs MNVI's and FSVI's selections on the device; FSVI's
# falls back to the MAP head on this calibrated net, so here its fitted head is checked).
@pytest.mark.parametrize(
    ("method", "settings"),
    [
        ("mnvi", {"epochs": 1, "subset": "all", "variant": "mean-and-noise"}),
        ("fsvi", {"epochs": 1, "context_points": 8}),
        ("dirichlet-fvi", {"epochs": 1, "family": "mfvi"}),
    ],
)
def test_api_fit_on_the_device_returns_device_tensors(digits_ckpt, method, settings):
    loaded = ModelOptions("builtin:small-cnn", digits_ckpt).load()
    fit = load_data("digits:train", limit=64, seed=0)
    with emulated_cuda():
        post = bayescli.fit(loaded, fit, method, device="cuda", **settings)
        devices = {name: t.device for name, t in post.tensors().items()}
    ref = bayescli.fit(loaded, fit, method, device="cpu", **settings)
    assert devices and all(d.type == "cuda" for d in devices.values()), devices
    for name, t in ref.tensors().items():
        got = post.tensors()[name]
        scale = float(t.double().abs().max()) if t.numel() else 0.0
        assert_close(got.elem, t, rtol=SAME, atol=SAME * scale + 1e-300, what=name)


# -- the commands that read a posterior --------------------------------------------------------

COMMANDS = {
    "predict": ("predict", "--link", "mc", "--samples", 64),
    "evaluate": (
        "evaluate",
        "--ood",
        "noise:uniform",
        "--samples",
        8,
        "--methods",
        "map,glm-probit,glm-bridge,bnn-mc",
        # link fidelity's 2,000-draw MC reference is chunked by the device's budget: other draws
        "--fidelity-inputs",
        0,
    ),
    "topk": ("topk",),
    "conformal": ("conformal", "--method", "glm-probit", "--score", "raps"),
}
# every command for each last-layer posterior; the all-layer MNVI one (moment propagation through
# the network on the device) in the two that run its predictives. FSVI's near-zero head variances
# give huge bridge α: conformal's top-k comparison takes their large-α limits (O(NK), issue 37)
READS = [(n, c) for n in ("mnvi", "fsvi", "dirichlet-fvi") for c in COMMANDS]
READS += [("mnvi-all", "predict"), ("mnvi-all", "evaluate")]


@pytest.mark.parametrize(("name", "command"), READS)
def test_commands_with_a_vi_posterior_on_the_device_equal_cpu(cli, cpu_posteriors, tmp_path, name, command):
    head, *options = COMMANDS[command]
    args = (
        head,
        "--posterior",
        cpu_posteriors[name],
        "--data",
        "digits:test",
        "--limit",
        60,
        "--quiet",
        *options,
    )
    res, _, _ = run_cli(cli, *args, "--out", tmp_path / "gpu.json", device="cuda")
    assert res.code == 0, res.err
    cpu = cli(*args, "--out", tmp_path / "cpu.json", "--device", "cpu")
    assert cpu.code == 0, cpu.err
    same(
        _without_device(results(tmp_path / "gpu.json")),
        _without_device(results(tmp_path / "cpu.json")),
        command,
    )


def _without_device(report: dict) -> dict:
    """A report without the device it names."""
    return {k: v for k, v in report.items() if k != "device"}


# -- train --method ------------------------------------------------------------------------------

TRAINS = {
    "mnvi": ("--set", "kl_weight=2e-7"),
    "fsvi": ("--set", "context_points=8"),
    "dirichlet-fvi": ("--set", "members=2", "--set", "family=ensemble"),
}


@pytest.mark.parametrize("method", list(TRAINS))
def test_train_method_on_the_device_equals_cpu(cli, tmp_path, method):
    common = ("train", "--method", method, "--data", "digits:train", "--limit", 100, "--epochs", 1,
              "--quiet", *TRAINS[method])  # fmt: skip
    for device in ("cuda", "cpu"):
        out = tmp_path / f"{device}.safetensors"
        args = (*common, "--out", out, "--posterior-out", tmp_path / f"{device}-post.safetensors")
        res, _, _ = run_cli(cli, *args, device=device)
        assert res.code == 0, res.err
    ckpt_gpu, ckpt_cpu = same_tensors(tmp_path / "cuda.safetensors", tmp_path / "cpu.safetensors")
    same(ckpt_gpu["train_loss"], ckpt_cpu["train_loss"], "training loss")
    same(ckpt_gpu["train_accuracy"], ckpt_cpu["train_accuracy"], "training accuracy")
    same_tensors(tmp_path / "cuda-post.safetensors", tmp_path / "cpu-post.safetensors")
    # the whole-network posterior's predictives (GLM and BNN) on the device: the CPU's
    evaluate = ("evaluate", "--posterior", tmp_path / "cpu-post.safetensors", "--data", "digits:test",
                "--limit", 30, "--samples", 4, "--methods", "map,glm-probit,bnn-mc", "--fidelity-inputs", 0,
                "--quiet")  # fmt: skip
    for device in ("cuda", "cpu"):
        res, _, _ = run_cli(cli, *evaluate, "--out", tmp_path / f"{device}.json", device=device)
        assert res.code == 0, res.err
    same(
        _without_device(results(tmp_path / "cuda.json")),
        _without_device(results(tmp_path / "cpu.json")),
        "evaluate",
    )


# -- multi-label (bernoulli) MNVI --------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_ckpt(tmp_path_factory):
    """A small sigmoid-per-digit MLP on composed digits (tests/test_vi_bernoulli.py's, shorter)."""
    path = tmp_path_factory.mktemp("multi") / "multi.safetensors"
    train, val = load_data("composed-digits:train", limit=400), load_data("composed-digits:val", limit=100)
    config = TrainConfig(epochs=3, seed=0)
    clf, meta = train_classifier("builtin:mlp", train, val, config, likelihood="bernoulli")
    save_checkpoint(path, clf, meta)
    return path


@pytest.mark.parametrize("subset", ["last-layer", "all"])
def test_bernoulli_mnvi_fit_and_predict_on_the_device_equal_cpu(cli, multi_ckpt, tmp_path, subset):
    fit = ("fit-vi", "--method", "mnvi", "--model", "builtin:mlp", "--checkpoint", multi_ckpt,
           "--data", "composed-digits:train", "--limit", 200, "--val-data", "composed-digits:val[:100]",
           "--subset", subset, "--set", "epochs=1", "--quiet")  # fmt: skip
    for device in ("cuda", "cpu"):
        res, _, _ = run_cli(cli, *fit, "--out", tmp_path / f"{device}.safetensors", device=device)
        assert res.code == 0, res.err
    _, meta = same_tensors(tmp_path / "cuda.safetensors", tmp_path / "cpu.safetensors")
    assert meta["likelihood"] == "bernoulli" and meta["selection"]["validated"]
    for device in ("cuda", "cpu"):
        out = tmp_path / f"{device}.json"
        predict = ("predict", "--posterior", tmp_path / "cpu.safetensors", "--data", "composed-digits:test",
                   "--limit", 60, "--link", "mc", "--quiet", "--out", out)  # fmt: skip
        res, _, _ = run_cli(cli, *predict, device=device)
        assert res.code == 0, res.err
    gpu, cpu = (results(tmp_path / f"{d}.json") for d in ("cuda", "cpu"))
    assert cpu["likelihood"] == "bernoulli"
    same(_without_device(gpu), _without_device(cpu), "per-label predict")


def test_bernoulli_train_mnvi_on_the_device_equals_cpu(cli, tmp_path):
    common = ("train", "--model", "builtin:mlp", "--method", "mnvi", "--likelihood", "bernoulli",
              "--data", "composed-digits:train[:200]", "--val", "composed-digits:val[:50]", "--epochs", 1,
              "--quiet")  # fmt: skip
    for device in ("cuda", "cpu"):
        args = (*common, "--out", tmp_path / f"{device}.safetensors",
                "--posterior-out", tmp_path / f"{device}-post.safetensors")  # fmt: skip
        res, _, _ = run_cli(cli, *args, device=device)
        assert res.code == 0, res.err
    same_tensors(tmp_path / "cuda.safetensors", tmp_path / "cpu.safetensors")
    _, meta = same_tensors(tmp_path / "cuda-post.safetensors", tmp_path / "cpu-post.safetensors")
    assert meta["likelihood"] == "bernoulli"


# -- Posterior.to --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["laplace", "mnvi", "fsvi", "dirichlet-fvi"])
def test_posterior_to_moves_every_tensor_and_keeps_the_predictive(digits_posterior, cpu_posteriors, name):
    post = load_posterior(digits_posterior if name == "laplace" else cpu_posteriors[name])
    post.meta["marker"] = {"kept": True}
    phi = extract_features(post.load_model(), load_data("digits:test", limit=40, seed=0)).phi
    ref = post.logit_gaussian(phi)
    with emulated_cuda():
        there = post.to("cuda")
        assert there is not post and all(t.device.type == "cuda" for t in there.tensors().values())
        assert there.to("cuda") is there  # already there: nothing moves
        on_device = there.logit_gaussian(phi.to("cuda"))
        mean, var = on_device.mean.elem, on_device.var.elem
        back = there.to("cpu")
    assert all(t.device.type == "cpu" for t in back.tensors().values())
    assert back.meta == post.meta and back.meta is not post.meta and back.path == post.path
    assert sorted(back.tensors()) == sorted(post.tensors())
    # Dirichlet fVI's predictive takes a GPU's few large chunks on the device, other vector/tail
    # paths of digamma in the last bits, where Minka's stopping step may move: its α, and the
    # bridge's Gaussian with it, agree to Minka's tolerance (test_device_resident.py's reasoning)
    tol = 1e-5 if name == "dirichlet-fvi" else SAME
    there_back = back.logit_gaussian(phi)
    for got, rtol in (((mean, var), tol), ((there_back.mean, there_back.var), SAME)):
        for part, want in zip(got, (ref.mean, ref.var), strict=True):
            scale = float(want.double().abs().max())
            assert_close(part, want, rtol=rtol, atol=rtol * scale + 1e-300, what=f"{name} logits")


def test_posterior_to_keeps_the_model_and_data_of_an_api_fit(digits_ckpt):
    loaded = ModelOptions("builtin:small-cnn", digits_ckpt).load()
    post = bayescli.fit(loaded, load_data("digits:train", limit=100, seed=0), "mnvi", epochs=1)
    with emulated_cuda():
        moved = post.to("cuda")
    assert moved.model is post.model and moved.fit_data is post.fit_data and moved.val_data is post.val_data
    assert isinstance(moved, type(post)) and moved.likelihood == post.likelihood
    assert torch.equal(moved.to("cpu").rho["head"], post.rho["head"])  # a copy there and back is exact
