"""Every method on the (emulated) GPU: GLM VI, GGP VI, BBB, temperature and multi-label Laplace
fit, predict, evaluate and select on CUDA with the CPU's numbers.

``tests/emulated_cuda.py`` runs the CPU's kernels behind tensors that say ``cuda:0`` and raises,
as CUDA does, when an op mixes them with host tensors; generators made by
``bayescli.devices.generator`` on "cuda" are CPU generators there. So a command run on the
emulated device must give the CPU run's numbers (to :data:`device_harness.SAME`): a stray host
tensor raises, a host detour or a draw from another stream changes the numbers.
"""

from __future__ import annotations

import json

import pytest
import torch
from device_harness import BATCHES, results, run_cli, same, same_tensors
from emulated_cuda import emulated_cuda

import bayescli
from bayescli.api import as_model
from bayescli.data import load_data
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier

# Default-set methods this branch moves onto the device, with laplace and temperature: the select
# that passes whether or not the other VI methods (mnvi, fsvi, dirichlet-fvi) are device-resident.
OWN_METHODS = "laplace-diag,laplace-kron,glm-vi,temperature"
# small fits: each method's cheapest settings that still run its whole loop (BBB at a given δ: its
# default δ is the all-layer diag Laplace marginal-likelihood optimum, whose curvature differs on the
# emulated device by ~1%, a finding of this branch's report, not BBB's)
FAST = {
    "glm-vi": ("--set", "epochs=20"),
    "ggp-vi": ("--set", "epochs=2", "--set", "inducing_points=20"),
    "bbb": ("--set", "epochs=1", "--subset", "all", "--set", "prior_precision=1.0", "--set", "samples=10"),
}


def _fit_args(ckpt, method: str) -> tuple:
    return ("fit-vi", "--method", method, "--model", "builtin:small-cnn", "--checkpoint", ckpt,
            "--data", "digits:train[:300]", "--val-data", "digits:val[:100]", *FAST[method],
            "--quiet")  # fmt: skip


def _select(cli, ckpt, out, methods: str | None, device: str):
    args = ("select", "--model", "builtin:small-cnn", "--checkpoint", ckpt, "--data", "digits:train[:300]",
            "--val-data", "digits:val[:100]", "--ood", "noise:uniform", "--out-dir", out, "--quiet",
            *(("--methods", methods) if methods else ()))  # fmt: skip
    return run_cli(cli, *args, device=device)


def _board(path) -> dict:
    board = json.loads(path.read_text())
    for row in board["methods"].values():
        row.pop("fit_seconds")
    return board


@pytest.mark.parametrize("methods", [None, OWN_METHODS], ids=["default-methods", "own-methods"])
def test_select_on_the_device_equals_cpu(cli, digits_ckpt, tmp_path, methods):
    res, _, _ = _select(cli, digits_ckpt, tmp_path / "gpu", methods, "cuda")
    assert res.code == 0, res.err
    cpu, _, _ = _select(cli, digits_ckpt, tmp_path / "cpu", methods, "cpu")
    assert cpu.code == 0, cpu.err
    gpu_board, cpu_board = (
        _board(tmp_path / "gpu/leaderboard.json"),
        _board(tmp_path / "cpu/leaderboard.json"),
    )
    same(gpu_board, cpu_board, "leaderboard")
    for name in cpu_board["methods"]:
        same_tensors(tmp_path / f"gpu/{name}.safetensors", tmp_path / f"cpu/{name}.safetensors")


@pytest.mark.parametrize("method", ["glm-vi", "ggp-vi", "bbb"])
def test_fit_vi_on_the_device_equals_cpu(cli, digits_ckpt, tmp_path, method):
    res, _, _ = run_cli(
        cli, *_fit_args(digits_ckpt, method), "--out", tmp_path / "gpu.safetensors", device="cuda"
    )
    assert res.code == 0, res.err
    cpu = cli(*_fit_args(digits_ckpt, method), "--out", tmp_path / "cpu.safetensors", "--device", "cpu")
    assert cpu.code == 0, cpu.err
    gpu_meta, cpu_meta = same_tensors(tmp_path / "gpu.safetensors", tmp_path / "cpu.safetensors")
    same(gpu_meta["prior_precision"], cpu_meta["prior_precision"], "prior precision")


@pytest.mark.parametrize("method", ["glm-vi", "ggp-vi", "bbb", "temperature", "laplace"])
def test_api_fit_returns_a_posterior_on_the_device(digits_ckpt, method):
    train, val = load_data("digits:train[:300]"), load_data("digits:val[:100]")
    values = {
        "glm-vi": {"epochs": 20},
        "ggp-vi": {"epochs": 2, "inducing_points": 20},
        "bbb": {"epochs": 1, "subset": "all", "prior_precision": 1.0, "samples": 10},
    }
    with emulated_cuda():
        post = bayescli.fit(
            "builtin:small-cnn", train, method, val=val, checkpoint=digits_ckpt, device="cuda",
            **values.get(method, {}),
        )  # fmt: skip
        tensors = post.tensors()
        assert tensors and all(t.device.type == "cuda" for t in tensors.values()), method
        pred = post.predict(load_data("digits:test[:50]"))
        assert pred.probs.device.type == "cuda"
    ref = bayescli.fit(
        "builtin:small-cnn",
        train,
        method,
        val=val,
        checkpoint=digits_ckpt,
        device="cpu",
        **values.get(method, {}),
    )
    for key, value in ref.tensors().items():
        torch.testing.assert_close(tensors[key].cpu(), value, rtol=1e-9, atol=1e-12)


def test_bbb_predict_and_evaluate_on_the_device_equal_cpu(cli, digits_ckpt, tmp_path):
    post = tmp_path / "bbb.safetensors"
    fit = cli(*_fit_args(digits_ckpt, "bbb"), "--out", post, "--device", "cpu")
    assert fit.code == 0, fit.err
    _predict_and_evaluate(cli, tmp_path, post, "digits:test", "map,glm-probit,bnn-mc")


@pytest.fixture(scope="module")
def multilabel_posterior(tmp_path_factory):
    """A sigmoid-per-digit MLP on composed digits (a few epochs) and its last-layer Laplace posterior."""
    from bayescli.cli.app import main

    tmp = tmp_path_factory.mktemp("multi")
    ckpt, post = tmp / "multi.safetensors", tmp / "post.safetensors"
    train = load_data("composed-digits:train[:400]")
    clf, meta = train_classifier(
        "builtin:mlp", train, None, TrainConfig(epochs=3, seed=0), likelihood="bernoulli"
    )
    save_checkpoint(ckpt, clf, meta)
    try:
        main(["fit-laplace", "--model", "builtin:mlp", "--checkpoint", str(ckpt), "--data",
              "composed-digits:train[:400]", "--val-data", "composed-digits:val[:100]", "--out", str(post),
              "--device", "cpu", "--quiet"])  # fmt: skip
    except SystemExit as exc:
        assert not exc.code
    return post


def test_multilabel_laplace_predict_and_evaluate_on_the_device_equal_cpu(cli, multilabel_posterior, tmp_path):
    _predict_and_evaluate(
        cli, tmp_path, multilabel_posterior, "composed-digits:test[:200]", "map,glm-probit,glm-mc"
    )


def _predict_and_evaluate(cli, tmp_path, post, data: str, methods: str) -> None:
    pred = ("predict", "--posterior", post, "--data", data, "--quiet")
    res, _, _ = run_cli(cli, *pred, "--out", tmp_path / "gpu.jsonl", device="cuda")
    assert res.code == 0, res.err
    cpu = cli(*pred, "--out", tmp_path / "cpu.jsonl", "--device", "cpu")
    assert cpu.code == 0, cpu.err
    rows = {
        d: [json.loads(r) for r in (tmp_path / f"{d}.jsonl").read_text().splitlines()[1:]]
        for d in ("gpu", "cpu")
    }
    same(rows["gpu"], rows["cpu"], "predict rows")
    # no link fidelity: its 2,000-draw MC reference is cut into chunks by the device's budget, so
    # the same seed gives other draws on the device than in the CPU's cache-sized chunks
    common = ("evaluate", "--posterior", post, "--data", data, "--ood", "noise:uniform", "--methods", methods,
              "--samples", 50, "--fidelity-inputs", 0, "--quiet")  # fmt: skip
    reads = {}
    for bs in BATCHES:
        res, reads[bs], events = run_cli(
            cli, *common, "--batch-size", bs, "--out", tmp_path / f"gpu{bs}.json", device="cuda"
        )
        assert res.code in (0, 1), res.err
    cpu = cli(*common, "--batch-size", BATCHES[0], "--out", tmp_path / "cpu.json", "--device", "cpu")
    assert cpu.code in (0, 1), cpu.err
    same(results(tmp_path / f"gpu{BATCHES[0]}.json"), results(tmp_path / "cpu.json"), "report")
    assert reads[BATCHES[0]] == reads[BATCHES[1]], f"host reads {reads}\n{events}"


def test_train_bbb_on_the_device_equals_cpu(cli, tmp_path):
    args = ("train", "--method", "bbb", "--model", "builtin:mlp", "--data", "digits:train[:200]",
            "--epochs", 1, "--quiet")  # fmt: skip
    res, _, _ = run_cli(cli, *args, "--out", tmp_path / "gpu.safetensors", device="cuda")
    assert res.code == 0, res.err
    cpu = cli(*args, "--out", tmp_path / "cpu.safetensors", "--device", "cpu")
    assert cpu.code == 0, cpu.err
    same_tensors(tmp_path / "gpu.safetensors", tmp_path / "cpu.safetensors")
    same_tensors(tmp_path / "gpu-bbb.safetensors", tmp_path / "cpu-bbb.safetensors")


def test_api_select_and_evaluate_on_the_device_equal_cpu(digits_ckpt):
    train, val, test = (
        load_data("digits:train[:300]"),
        load_data("digits:val[:100]"),
        load_data("digits:test[:100]"),
    )
    methods = OWN_METHODS.split(",")

    def run(device: str) -> tuple[dict, dict]:
        model = as_model("builtin:small-cnn", checkpoint=digits_ckpt)
        board, posts = bayescli.select(model, train, val, methods=methods, device=device)
        report = bayescli.evaluate(posts["glm-vi"], test, methods=["map", "glm-probit"], device=device)
        return board, report

    with emulated_cuda():
        gpu_board, gpu_report = run("cuda")
    cpu_board, cpu_report = run("cpu")
    for board in (gpu_board, cpu_board):
        for row in board["methods"].values():
            row.pop("fit_seconds")
    same(gpu_board, cpu_board, "leaderboard")
    for report in (gpu_report, cpu_report):
        report.pop("timings", None), report.pop("environment", None)
    same(gpu_report, cpu_report, "report")


@pytest.mark.parametrize(
    ("likelihood", "data"), [("categorical", "digits"), ("bernoulli", "composed-digits")]
)
def test_map_training_reads_the_host_per_epoch_not_per_step_and_equals_cpu(likelihood, data):
    """The MAP trainer (``train``, the from-scratch methods' first stage) on the device: the loss is
    summed there and read once an epoch, the accuracies are counted there and read once, so the
    host reads do not grow with the number of steps or batches; the loss curve and the accuracies
    are the CPU run's (the same float64 sums of the same float32 losses)."""
    from bayescli.training.classifier import accuracy

    train, val = load_data(f"{data}:train[:200]"), load_data(f"{data}:val[:100]")
    reads, metas, accs = {}, {}, {}
    for bs in (16, 64):  # 13 vs 4 steps an epoch; 7 vs 2 batches for the accuracy
        config = TrainConfig(epochs=2, batch_size=bs, seed=0)
        with emulated_cuda() as stats:
            clf, metas[bs] = train_classifier("builtin:mlp", train, val, config, "cuda", likelihood)
            training = stats.host_reads
            stats.reset()
            accs[bs] = accuracy(  # the model trained with bs, in batches of bs
                clf, val, torch.device("cuda"), batch_size=bs
            )
            reads[bs] = (training, stats.host_reads)
    assert reads[16] == reads[64], reads
    _, cpu = train_classifier(
        "builtin:mlp", train, val, TrainConfig(epochs=2, batch_size=16), "cpu", likelihood
    )
    same(metas[16]["train_loss"], cpu["train_loss"], "loss curve")
    for key in ("train_accuracy", "val_accuracy"):
        assert metas[16][key] == cpu[key], key
    assert all(accs[bs] == metas[bs]["val_accuracy"] for bs in accs), (accs, metas)  # one batch there
