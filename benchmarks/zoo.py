"""Model zoo: checkpoints saved the way their ecosystems save them, read back by the bayescli CLI.

Trains small nets in this process with plain torch (and Lightning, transformers) on genuine MNIST
test[:5000], measures each net's own accuracy and NLL in memory on the held-out test[5000:], saves
it the way its ecosystem does, then drives the CLI on the saved file as a user would:
``bayescli inspect --json`` (how the file was read), ``bayescli fit-laplace`` (last-layer KFAC,
default prior, on the training rows) and ``bayescli evaluate --methods map,glm-probit`` on the
held-out rows. One row per format:

1. ``state dict .pt``: ``torch.save(model.state_dict())`` of a CNN, ``--model py:zoo_models:CNN``;
2. ``old BatchNorm .th``: a BatchNorm CNN saved as ``{"state_dict": {"module." + k: v}}`` with
   every ``num_batches_tracked`` removed (DataParallel on torch < 0.4.1);
3. ``Lightning .ckpt``: a ``LightningModule`` keeping the network under ``self.network``, ending
   in ``nn.LogSoftmax`` (NLL loss), ``save_hyperparameters()`` with ``hidden`` and ``lr``, saved by
   ``Trainer.save_checkpoint``; read with the factory ``py:zoo_models:lit_net(hidden)`` (the
   same dict written by hand when ``lightning`` is not importable; the row says so);
4. ``pickled module``: ``torch.save(model)`` of the row-1 CNN, a class of this script's
   ``__main__``, in the zip and the legacy format, read into ``--model py:zoo_models:CNN``;
5. ``tuple output``: ``forward`` returns ``(logits, features)``;
6. ``1×1 conv head``: ``Conv2d(C, 10, 1) → AdaptiveAvgPool2d(1) → Flatten`` (SqueezeNet style);
7. ``HF save_pretrained``: a tiny ``ResNetForImageClassification`` (1 input channel), ``--model
   hf:FOLDER`` without ``--checkpoint``;
8. ``--model-arg``: a factory ``mlp_model(input_dim, output_dim)`` with required arguments.

The model code lives in ``zoo_models.py`` in the work folder, written from this file's classes,
and the CLI runs with that folder as its current directory, so ``py:zoo_models:…`` must be found
there (``--add-pythonpath`` also puts it on PYTHONPATH). A format that fails prints as a row with
loaded = no and the CLI's one-line error; the script goes on with the next one.

Prints a markdown table: format, how saved, loaded, MAP accuracy from bayescli vs the net's own,
MAP NLL (bayescli, own), Laplace probit NLL, and what ``inspect`` reported. Exit status 1 when a
format failed (after the table).

Run: ``.venv/bin/python benchmarks/zoo.py [--shared ../shared] [--out DIR] [--quick]`` (the
``bayescli`` beside the interpreter is used, else the one on PATH, else ``python -m bayescli``;
about 6 minutes on 2 cores when every format gets through, ``--quick`` about 3: 2,000 training rows,
2 epochs, 2,000 held-out rows). ``--only lightning_ckpt,hugging_face`` runs some formats.
"""

from __future__ import annotations

import argparse
import gzip
import inspect
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
BATCH = 128
CMD_TIMEOUT_S = 600


# ---------------------------------------------------------------------------------------------
# the zoo's architectures (copied verbatim into zoo_models.py for the CLI)
# ---------------------------------------------------------------------------------------------


class CNN(nn.Module):
    """Two conv blocks and a two-layer head; plain logits."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 7 * 7, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class BNCNN(nn.Module):
    """Conv → BatchNorm → ReLU → pool, twice, then a linear classifier."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def lit_net(hidden: int) -> nn.Module:
    """The network a Lightning module keeps under ``self.network``: log-probabilities out."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10), nn.LogSoftmax(dim=1)
    )


class TupleNet(nn.Module):
    """An MLP whose forward returns ``(logits, features)``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return self.fc(features), features


class ConvHeadNet(nn.Module):
    """SqueezeNet-style: a 1×1 convolution to class maps, global average pooling, flatten."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Conv2d(128, num_classes, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def mlp_model(input_dim: int, output_dim: int) -> nn.Module:
    """A factory with required arguments (``--model-arg input_dim=784 --model-arg output_dim=10``)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(input_dim, 128), nn.ReLU(), nn.Linear(128, output_dim))


ZOO_MODELS = (CNN, BNCNN, lit_net, TupleNet, ConvHeadNet, mlp_model)


def write_zoo_models(folder: Path) -> Path:
    """``zoo_models.py`` with the classes above, source for source (same attribute names)."""
    header = (
        '"""Architectures of benchmarks/zoo.py (written by it)."""\n\nimport torch\nfrom torch import nn\n'
    )
    body = "\n\n".join(inspect.getsource(obj) for obj in ZOO_MODELS)
    path = folder / "zoo_models.py"
    path.write_text(f"{header}\n\n{body}")
    return path


# ---------------------------------------------------------------------------------------------
# data, training and in-memory metrics
# ---------------------------------------------------------------------------------------------


def read_idx(path: Path) -> np.ndarray:
    """An IDX array (MNIST's format, gzipped): magic ``0 0 dtype ndim``, big-endian dims, data."""
    raw = gzip.decompress(path.read_bytes())
    if raw[:3] != b"\x00\x00\x08":
        sys.exit(f"{path} is not a uint8 IDX file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_mnist_test(raw: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST test images in [0, 1] as ``[10000, 1, 28, 28]`` float32 and labels as int64."""
    x = read_idx(raw / "t10k-images-idx3-ubyte.gz").astype(np.float32) / 255.0
    y = read_idx(raw / "t10k-labels-idx1-ubyte.gz").astype(np.int64)
    return torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y)


def as_logits(out: object) -> torch.Tensor:
    """The logits of a forward's output: a tensor, a tuple's first element, or HF's ``.logits``."""
    if isinstance(out, tuple | list):
        return out[0]
    return out if isinstance(out, torch.Tensor) else out.logits


def train(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float = 3e-3, seed: int = 0
) -> None:
    """Adam on cross-entropy (equal to the NLL loss for nets that end in ``LogSoftmax``)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    net.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), BATCH):
            idx = perm[i : i + BATCH]
            loss = F.cross_entropy(as_logits(net(x[idx])), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    recalibrate_batchnorm(net, x)
    net.eval()


@torch.no_grad()
def recalibrate_batchnorm(net: nn.Module, x: torch.Tensor) -> None:
    """Running statistics of every BatchNorm as the exact average over ``x`` under the final weights
    (after a few hundred steps the exponential averages still trail the weights they normalise)."""
    norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average
    net.train()
    for i in range(0, len(x), 512):
        net(x[i : i + 512])
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum


@torch.no_grad()
def own_metrics(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Accuracy and NLL of the in-memory net (``log_softmax`` of log-probabilities is themselves)."""
    net.eval()
    logits = torch.cat([as_logits(net(x[i : i + 512])) for i in range(0, len(x), 512)]).double()
    nll = F.cross_entropy(logits, y, reduction="mean").item()
    return (logits.argmax(1) == y).double().mean().item(), nll


# ---------------------------------------------------------------------------------------------
# the formats
# ---------------------------------------------------------------------------------------------


@dataclass
class Entry:
    """One saved model and how to hand it to the CLI."""

    name: str
    how: str
    model: str  # --model spec
    checkpoint: Path | None
    own: tuple[float, float]
    extra: list[str] = field(default_factory=list)  # e.g. --model-arg ...
    note: str = ""


@dataclass
class Ctx:
    work: Path
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_held: torch.Tensor
    y_held: torch.Tensor
    epochs: int

    def fit_and_score(self, net: nn.Module, seed: int = 0) -> tuple[float, float]:
        torch.manual_seed(seed)
        train(net, self.x_train, self.y_train, self.epochs, seed=seed)
        return own_metrics(net, self.x_held, self.y_held)

    def trained(self, build: Callable[[], nn.Module], seed: int) -> tuple[nn.Module, tuple[float, float]]:
        """A net built and trained under ``seed``, and its own held-out (accuracy, NLL)."""
        torch.manual_seed(seed)
        net = build()
        return net, self.fit_and_score(net, seed)

    def save_state(self, net: nn.Module, name: str) -> Path:
        """``torch.save(net.state_dict())`` into the work folder, as most authors publish."""
        path = self.work / name
        torch.save(net.state_dict(), path)
        return path


def plain_state_dict(ctx: Ctx, cache: dict) -> list[Entry]:
    net, own = ctx.trained(CNN, 1)
    cache["cnn"] = (net, own)
    path = ctx.save_state(net, "cnn_state.pt")
    return [Entry("state dict .pt", "torch.save(model.state_dict())", "py:zoo_models:CNN", path, own)]


def old_batchnorm(ctx: Ctx, cache: dict) -> list[Entry]:
    net, own = ctx.trained(BNCNN, 2)
    state = {f"module.{k}": v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    path = ctx.work / "bn_old.th"
    torch.save({"state_dict": state, "epoch": ctx.epochs, "best_prec1": own[0]}, path)
    how = '{"state_dict": {"module."+k: v}}, no num_batches_tracked'
    return [Entry("old BatchNorm .th", how, "py:zoo_models:BNCNN", path, own)]


def lightning_ckpt(ctx: Ctx, cache: dict) -> list[Entry]:
    hidden, lr = 48, 3e-3
    path = ctx.work / "lit.ckpt"
    torch.manual_seed(3)
    try:
        import lightning as L
    except ImportError:
        L = None
    if L is None:  # the same layout, by hand
        net = lit_net(hidden)
        own = ctx.fit_and_score(net, 3)
        state = {f"network.{k}": v for k, v in net.state_dict().items()}
        torch.save(
            {
                "epoch": ctx.epochs - 1,
                "global_step": ctx.epochs * math.ceil(len(ctx.x_train) / BATCH),
                "pytorch-lightning_version": "2.6.0",
                "state_dict": state,
                "hyper_parameters": {"hidden": hidden, "lr": lr},
                "optimizer_states": [],
                "lr_schedulers": [],
            },
            path,
        )
        how = "lightning not importable: Lightning's dict written by hand"
        return [Entry("Lightning .ckpt", how, "py:zoo_models:lit_net", path, own)]

    class LitNet(L.LightningModule):
        def __init__(self, hidden: int, lr: float = 1e-3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.network = lit_net(hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.network(x)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return F.nll_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    module = LitNet(hidden, lr)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(ctx.x_train, ctx.y_train),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
    )
    trainer = L.Trainer(
        max_epochs=ctx.epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, loader)
    trainer.save_checkpoint(path)
    own = own_metrics(module.network, ctx.x_held, ctx.y_held)
    how = f"Trainer.save_checkpoint (lightning {L.__version__}), hparams hidden={hidden}, lr={lr}"
    return [Entry("Lightning .ckpt", how, "py:zoo_models:lit_net", path, own)]


def pickled_module(ctx: Ctx, cache: dict) -> list[Entry]:
    if "cnn" not in cache:
        plain_state_dict(ctx, cache)
    net, own = cache["cnn"]
    where = f"{type(net).__module__}.{type(net).__name__}"
    zipped, legacy = ctx.work / "cnn_whole.pt", ctx.work / "cnn_whole_legacy.pt"
    torch.save(net, zipped)
    torch.save(net, legacy, _use_new_zipfile_serialization=False)
    return [
        Entry("pickled module (zip)", f"torch.save(model) of {where}", "py:zoo_models:CNN", zipped, own),
        Entry(
            "pickled module (legacy)",
            f"torch.save(model, _use_new_zipfile_serialization=False) of {where}",
            "py:zoo_models:CNN",
            legacy,
            own,
        ),
    ]


def tuple_output(ctx: Ctx, cache: dict) -> list[Entry]:
    net, own = ctx.trained(TupleNet, 5)
    path = ctx.save_state(net, "tuple_state.pt")
    how = "state dict; forward returns (logits, features[64])"
    return [Entry("tuple output", how, "py:zoo_models:TupleNet", path, own)]


def conv_head(ctx: Ctx, cache: dict) -> list[Entry]:
    net, own = ctx.trained(ConvHeadNet, 6)
    path = ctx.save_state(net, "convhead_state.pt")
    how = "state dict; Conv2d(128, 10, 1) → AdaptiveAvgPool2d(1) → Flatten"
    return [Entry("1×1 conv head", how, "py:zoo_models:ConvHeadNet", path, own)]


def hugging_face(ctx: Ctx, cache: dict) -> list[Entry]:
    from transformers import ResNetConfig, ResNetForImageClassification
    from transformers import __version__ as hf_version
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    config = ResNetConfig(
        num_channels=1,
        embedding_size=16,
        hidden_sizes=[32, 64],
        depths=[1, 1],
        layer_type="basic",
        num_labels=10,
        id2label={i: str(i) for i in range(10)},
        label2id={str(i): i for i in range(10)},
    )
    net, own = ctx.trained(lambda: ResNetForImageClassification(config), 7)
    folder = ctx.work / "hf_resnet"
    net.save_pretrained(folder)
    how = f"save_pretrained (transformers {hf_version}), tiny ResNet, 1 channel"
    return [Entry("HF save_pretrained", how, f"hf:{folder}", None, own)]


def model_args(ctx: Ctx, cache: dict) -> list[Entry]:
    net, own = ctx.trained(lambda: mlp_model(784, 10), 8)
    path = ctx.save_state(net, "mlp_state.pt")
    extra = ["--model-arg", "input_dim=784", "--model-arg", "output_dim=10"]
    how = "state dict; factory mlp_model(input_dim, output_dim), no defaults"
    return [Entry("--model-arg", how, "py:zoo_models:mlp_model", path, own, extra)]


FORMATS: list[Callable[[Ctx, dict], list[Entry]]] = [
    plain_state_dict,
    old_batchnorm,
    lightning_ckpt,
    pickled_module,
    tuple_output,
    conv_head,
    hugging_face,
    model_args,
]


# ---------------------------------------------------------------------------------------------
# driving the CLI
# ---------------------------------------------------------------------------------------------


def bayescli_command() -> list[str]:
    """``bayescli`` beside this interpreter (as ``make`` sets it up), else on PATH, else ``python -m``."""
    beside = Path(sys.executable).with_name("bayescli")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("bayescli")
    return [found] if found else [sys.executable, "-m", "bayescli"]


class CliError(Exception):
    """A CLI command that failed, with its one-line message."""


def run_cli(args: list[object], cwd: Path, env: dict) -> str:
    """Run ``bayescli ARGS`` in ``cwd``; its stdout, or :class:`CliError` with stderr's last line."""
    cmd = [*bayescli_command(), *map(str, args)]
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CliError(f"{args[0]}: timed out after {CMD_TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
        raise CliError(f"{args[0]} (exit {done.returncode}): {lines[-1] if lines else 'no message'}")
    return done.stdout


def parse_json(text: str) -> dict:
    """The JSON object a ``--json`` command printed (anything before its first ``{`` skipped)."""
    start = text.find("{")
    return json.loads(text[start:]) if start >= 0 else {}


_NOT_NOTES = {
    "model", "checkpoint", "checkpoint_sha256", "class_names", "data", "inputs", "map_accuracy",
    "num_classes", "feature_dim", "preprocess", "warnings",
}  # fmt: skip


def short(value: object, width: int = 40) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(short(v, width) for v in value) or "—"
    if isinstance(value, dict):
        return ", ".join(f"{k}={short(v, width)}" for k, v in value.items())
    text = str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _empty(value: object) -> bool:
    return value is None or (isinstance(value, str | list | tuple | dict) and not value)


def inspect_notes(info: dict) -> str:
    """What ``inspect --json`` reported about reading the file, compactly: format, container key,
    prefix mapping, factory arguments (and where they came from), head, output kind; any other
    non-empty fact as ``key: value``."""
    facts = {k: v for k, v in info.items() if k not in _NOT_NOTES and not _empty(v)}
    take = facts.pop
    parts = []
    for key in [k for k in facts if k.endswith("format")]:
        parts.append(f"format {short(take(key))}")
    if "lightning_version" in facts:
        parts.append(f"Lightning {take('lightning_version')}")
    if "checkpoint_key" in facts:
        parts.append(f"key {take('checkpoint_key')}")
    for verb in ("stripped", "added"):
        if f"{verb}_prefixes" in facts:
            parts.append(f"prefix {short(take(f'{verb}_prefixes'))} {verb}")
    if facts.get("ignored_keys"):
        parts.append(f"{short(facts['ignored_keys'])} keys ignored")
    facts.pop("ignored_keys", None)
    if "model_args" in facts:
        args = take("model_args")
        sources = take("model_args_sources", {})
        parts.append(
            "args "
            + ", ".join(
                f"{k}={short(v)}" + (f" (from {sources[k]})" if sources.get(k, "user") != "user" else "")
                for k, v in (args.items() if isinstance(args, dict) else [])
            )
        )
    if "model_args_ignored" in facts:
        parts.append(f"not passed: {short(take('model_args_ignored'))}")
    if "head" in facts:
        kind = take("head_kind", None)
        parts.append(f"head {take('head')}" + (f" ({kind})" if kind else ""))
    if "output_kind" in facts or "output" in facts:
        which = take("output", None)
        parts.append(
            f"output {short(take('output_kind', '?'))}" + (f" [element {which}]" if which is not None else "")
        )
    if facts.pop("last_layer_exact", True) is False:
        parts.append("last layer not exact")
    parts += [f"{k}: {short(v)}" for k, v in facts.items()]
    return "; ".join(parts)


@dataclass
class Row:
    entry: Entry
    loaded: bool = False
    map_acc: float | None = None
    map_nll: float | None = None
    probit_nll: float | None = None
    inspect_acc: float | None = None
    delta: float | None = None
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


def drive(entry: Entry, ctx: Ctx, root: Path, fit_spec: str, held_spec: str, env: dict) -> Row:
    """inspect → fit-laplace → evaluate on one saved model; failures end the row, not the run."""
    row = Row(entry)
    if entry.note:
        row.notes.append(entry.note)
    out = ctx.work / "runs" / entry.name.replace(" ", "_").replace("/", "_").lstrip("-")
    out.mkdir(parents=True, exist_ok=True)
    load_args = ["--model", entry.model, *(["--checkpoint", entry.checkpoint] if entry.checkpoint else [])]
    load_args += entry.extra
    data = ["--data-root", root]
    start = time.perf_counter()
    try:
        try:
            info = parse_json(
                run_cli(["inspect", *load_args, "--data", held_spec, *data, "--json"], ctx.work, env)
            )
        except CliError as exc:
            if "No such command" not in str(exc):
                raise
            info = {}
            row.notes.append("no inspect command in this CLI")
        else:
            row.loaded = True
        row.inspect_acc = info.get("map_accuracy")
        if info:
            row.notes.append(inspect_notes(info))
        post = out / "post.safetensors"
        fit_cmd = ["fit-laplace", *load_args, "--data", fit_spec, "--hessian", "kron", *data, "--out", post]
        fit = parse_json(run_cli([*fit_cmd, "--json"], ctx.work, env))
        row.loaded = True
        row.delta = fit.get("prior_precision")
        report = out / "report.json"
        evaluate = ["evaluate", "--posterior", post, "--data", held_spec, "--methods", "map,glm-probit",
                    *data, "--out", report, "--quiet"]  # fmt: skip
        try:  # py: code named in a posterior file is imported only when --model names it too
            confirm = ["--model", entry.model] if entry.model.startswith("py:") else []
            run_cli([*evaluate, *confirm], ctx.work, env)
        except CliError as exc:
            if "No such option: --model" not in str(exc):
                raise
            run_cli(evaluate, ctx.work, env)  # a CLI from before that rule
        ind = json.loads(report.read_text())["results"]["in_distribution"]
        row.map_acc, row.map_nll = ind["map"]["accuracy"], ind["map"]["nll"]
        row.probit_nll = ind["glm-probit"]["nll"]
    except CliError as exc:
        row.error = str(exc)
    except (OSError, KeyError, ValueError) as exc:  # a report that is missing or lacks an entry
        row.error = f"reading the outputs: {type(exc).__name__}: {exc}"
    row.seconds = time.perf_counter() - start
    return row


def cell(value: float | None, digits: int = 4) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def table(rows: list[Row]) -> str:
    head = ["format", "how saved", "loaded", "MAP acc (bayescli)", "own acc (in memory)", "MAP NLL",
            "own NLL", "Laplace probit NLL", "notes"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        notes = list(r.notes)
        if r.delta is not None:
            notes.append(f"δ = {r.delta:.4g}")
        if r.map_acc is not None and abs(r.map_acc - r.entry.own[0]) > 1e-3:
            notes.append(f"**MAP acc differs from own by {r.map_acc - r.entry.own[0]:+.4f}**")
        if r.map_acc is not None and r.inspect_acc is not None and abs(r.map_acc - r.inspect_acc) > 1e-3:
            notes.append(f"**inspect said accuracy {r.inspect_acc:.4f}**")
        if r.error:
            notes.append(f"error: {short(r.error, 300)}")
        cells = [
            r.entry.name,
            r.entry.how,
            "yes" if r.loaded else "no",
            cell(r.map_acc),
            cell(r.entry.own[0]),
            cell(r.map_nll),
            cell(r.entry.own[1]),
            cell(r.probit_nll),
            "; ".join(n for n in notes if n).replace("|", "\\|"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def log(msg: str) -> None:
    print(f"[zoo] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=HERE.parent.parent / "shared")
    ap.add_argument("--out", type=Path, default=None, help="keep the saved models and outputs here")
    ap.add_argument("--quick", action="store_true", help="2,000 rows, 2 epochs, 2,000 held-out rows")
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated formats to run: " + ", ".join(f.__name__ for f in FORMATS),
    )
    ap.add_argument(
        "--add-pythonpath",
        action="store_true",
        help="also put the work folder on PYTHONPATH (for a CLI that does not look in the current directory)",
    )
    args = ap.parse_args()
    mnist_root = (args.shared / "data" / "mnist").resolve()
    raw = mnist_root / "MNIST" / "raw"
    if not (raw / "t10k-images-idx3-ubyte.gz").is_file() or not (raw / "t10k-labels-idx1-ubyte.gz").is_file():
        sys.exit(f"MNIST test files not found under {raw}; pass --shared DIR (the folder holding data/mnist)")
    n_train, n_held, epochs = (2000, 2000, 2) if args.quick else (5000, 5000, 3)
    fit_spec = f"mnist:test[:{n_train}]"
    held_spec = "mnist:test[5000:]" if n_held == 5000 else f"mnist:test[5000:{5000 + n_held}]"

    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="bayescli-zoo-")
    work = (args.out or Path(tmp.name)).resolve()
    work.mkdir(parents=True, exist_ok=True)
    write_zoo_models(work)
    env = dict(os.environ)
    paths = [str(work)] if args.add_pythonpath else []
    if len(bayescli_command()) > 1:  # python -m bayescli: this clone's package
        paths.append(str(HERE.parent))
    if paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])

    x, y = load_mnist_test(raw)
    ctx = Ctx(work, x[:n_train], y[:n_train], x[5000 : 5000 + n_held], y[5000 : 5000 + n_held], epochs)
    chosen = FORMATS
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {f.__name__ for f in FORMATS}
        if unknown:
            names = ", ".join(f.__name__ for f in FORMATS)
            sys.exit(f"unknown --only {', '.join(sorted(unknown))}; choose from {names}")
        chosen = [f for f in FORMATS if f.__name__ in wanted]
    started = time.perf_counter()
    try:
        rows = run_zoo(ctx, chosen, mnist_root, fit_spec, held_spec, env)
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(
        f"MNIST {fit_spec} (training and Laplace fit) → {held_spec} (held out); {epochs} epoch(s); "
        f"last-layer KFAC, default prior; torch {torch.__version__}\n"
    )
    print(table(rows))
    failed = [r for r in rows if r.error]
    print(
        f"\n{len(rows) - len(failed)}/{len(rows)} formats end to end; "
        f"{time.perf_counter() - started:.0f} s" + (f"; files in {work}" if args.out else "")
    )
    if failed:
        sys.exit(1)


def run_zoo(
    ctx: Ctx, chosen: list[Callable], root: Path, fit_spec: str, held_spec: str, env: dict
) -> list[Row]:
    """Build, save and drive each chosen format; one :class:`Row` per saved model."""
    rows: list[Row] = []
    cache: dict = {}
    for make in chosen:
        t0 = time.perf_counter()
        try:
            entries = make(ctx, cache)
        except Exception as exc:  # a library missing or failing here is a row, not a crash
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            log(f"{make.__name__}: could not build ({type(exc).__name__}: {msg})")
            entry = Entry(make.__name__, "not built", "—", None, (math.nan, math.nan))
            rows.append(Row(entry, error=f"building: {type(exc).__name__}: {msg[:200]}"))
            continue
        log(f"{make.__name__}: trained and saved in {time.perf_counter() - t0:.1f} s")
        for entry in entries:
            row = drive(entry, ctx, root, fit_spec, held_spec, env)
            status = "ok" if row.error is None else row.error
            log(f"  {entry.name}: {status} ({row.seconds:.1f} s in the CLI)")
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
