"""The small trainer behind ``bayescli train``: demo and test checkpoints, since pretrained
weights cannot be downloaded everywhere.

Adam with decoupled weight decay, a cosine learning-rate schedule, seeded shuffling. The
per-channel normalisation statistics of the training inputs become part of the model wrapper.

Two likelihoods, recorded in the checkpoint as ``"likelihood"`` (a checkpoint without the key is
categorical):

* ``categorical``: single-label data (``y [N]``), softmax cross-entropy; ``train_accuracy`` and
  ``val_accuracy`` are top-1 accuracies.
* ``bernoulli``: multi-label data (``y [N, K]`` 0/1), a sigmoid per class and binary
  cross-entropy (mean over inputs and classes); a class is predicted present when its logit is
  positive. ``train_accuracy`` and ``val_accuracy`` are mean per-label accuracies (the fraction
  of the N·K decisions that are right), ``train_subset_accuracy`` and ``val_subset_accuracy`` the
  fraction of inputs whose whole label set is right.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from bayescli._version import __version__
from bayescli.data import Data
from bayescli.errors import BayescliError
from bayescli.io import save_tensors
from bayescli.models.specs import (
    LIKELIHOODS,
    Classifier,
    ModelSpec,
    build_network,
    builtin_names,
    last_linear_name,
)
from bayescli.options import TrainConfig
from bayescli.progress import track


def channel_stats(data: Data, max_rows: int = 20_000) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the inputs (per column for flat data) ``([C], [C])``, streamed."""
    mean, std = data.channel_moments(max_rows)
    return mean.float().tolist(), std.float().clamp_min(1e-3).tolist()


def check_likelihood(likelihood: str, data: Data) -> None:
    """Raise unless ``likelihood`` fits ``data``'s labels: categorical for class indices ``[N]``,
    bernoulli for multi-label ``[N, K]``."""
    if likelihood not in LIKELIHOODS:
        raise BayescliError(f"unknown likelihood '{likelihood}'; choose one of {', '.join(LIKELIHOODS)}")
    if data.y is None:
        return
    if likelihood == "bernoulli" and not data.multilabel:
        raise BayescliError(
            f"likelihood 'bernoulli' needs multi-label data (y [N, K] of 0/1), but {data.spec} has one "
            "class per input; use --likelihood categorical, or multi-label data such as composed-digits"
        )
    if likelihood == "categorical" and data.multilabel:
        raise BayescliError(
            f"{data.spec} is multi-label (y [N, {data.num_classes}] of 0/1) but the likelihood is "
            "'categorical' (one class per input); use --likelihood bernoulli"
        )


@torch.no_grad()
def accuracy(model: nn.Module, data: Data, device: torch.device, batch_size: int = 512) -> float:
    """Top-1 accuracy of ``model`` on labelled ``data``; on multi-label data the mean per-label
    accuracy (see :func:`multilabel_accuracy`)."""
    if data.multilabel:
        return multilabel_accuracy(model, data, device, batch_size)[0]
    model.eval()
    # counted on the device and read once: a read per batch would wait for the GPU every time
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for xb, yb in data.batches(batch_size):
        correct += (model(xb.to(device)).argmax(1) == yb.to(device)).sum()
    return int(correct) / len(data)


@torch.no_grad()
def multilabel_accuracy(
    model: nn.Module, data: Data, device: torch.device, batch_size: int = 512
) -> tuple[float, float]:
    """``(mean per-label accuracy, subset accuracy)`` of ``model`` on multi-label ``data``
    (``y [N, K]``): class k is predicted present when its logit is positive (sigmoid > 1/2)."""
    model.eval()
    right = torch.zeros(2, dtype=torch.int64, device=device)  # labels, sets; read once
    for xb, yb in data.batches(batch_size):
        hit = (model(xb.to(device)) > 0) == yb.to(device).bool()  # [B, K]
        right += torch.stack([hit.sum(), hit.all(1).sum()])
    right_labels, right_sets = right.tolist()
    return right_labels / (len(data) * data.num_classes), right_sets / len(data)


def train_classifier(
    model: str,
    train: Data,
    val: Data | None = None,
    config: TrainConfig | None = None,
    device: torch.device | str = "cpu",
    likelihood: str = "categorical",
) -> tuple[Classifier, dict]:
    """Train ``builtin:NAME`` on ``train``; returns the classifier and a history/metadata dict.

    ``likelihood``: ``categorical`` (softmax cross-entropy, labels ``[N]``) or ``bernoulli``
    (a sigmoid per class with binary cross-entropy, multi-label ``[N, K]``); it must fit the
    labels of ``train`` and ``val``."""
    cfg = config or TrainConfig()
    spec = ModelSpec.parse(model)
    if spec.kind != "builtin":
        raise BayescliError(
            f"bayescli train trains builtin models only ({', '.join(builtin_names())}); "
            f"got {spec}. Train other architectures with your own code and pass the checkpoint"
        )
    if train.y is None:
        raise BayescliError(f"{train.spec} has no labels; training needs labelled data")
    for data in (train, val):
        if data is not None:
            check_likelihood(likelihood, data)
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    k = train.num_classes
    net = build_network(spec, k, train.input_shape, {})
    mean, std = channel_stats(train)
    clf = Classifier(net, last_linear_name(net), mean, std).to(device)
    opt = torch.optim.AdamW(clf.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(train) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=cfg.lr, total_steps=cfg.epochs * steps_per_epoch, pct_start=0.15
    )
    bernoulli = likelihood == "bernoulli"
    loss_fn = nn.BCEWithLogitsLoss() if bernoulli else nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []
    for _ in track(range(cfg.epochs), total=cfg.epochs, description=f"training {spec}"):
        clf.train()
        perm = torch.randperm(len(train), generator=gen)
        # summed on the device in float64 (the sums a Python float made of loss.item()) and read
        # once per epoch: a read per step would make the GPU wait every step
        total = torch.zeros((), dtype=torch.float64, device=device)
        for start in range(0, len(train), cfg.batch_size):
            idx = perm[start : start + cfg.batch_size]
            xb, yb = (t.to(device) for t in train.take(idx))
            loss = loss_fn(clf(xb), yb.float() if bernoulli else yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.detach().double() * len(yb)
        losses.append(total.item() / len(train))
    clf.eval()
    return clf, checkpoint_metadata(
        spec, clf, train, val, device, (mean, std), asdict(cfg), losses, likelihood=likelihood
    )


def checkpoint_metadata(
    spec: ModelSpec,
    clf: Classifier,
    train: Data,
    val: Data | None,
    device: torch.device,
    normalisation: tuple[list[float], list[float]],
    training: dict,
    train_loss: list[float],
    model_kwargs: dict | None = None,
    likelihood: str = "categorical",
) -> dict:
    """The header of a checkpoint that ``bayescli train`` writes (every ``--method``): the model,
    its likelihood, its input normalisation ``(mean, std)``, the data, the training settings and
    loss curve, and the trained network's accuracy on ``train`` and on labelled ``val`` (for
    ``bernoulli``: mean per-label accuracy, and subset accuracy under ``*_subset_accuracy``)."""
    mean, std = normalisation
    labelled_val = val is not None and val.y is not None
    scores: dict = {}
    if likelihood == "bernoulli":
        scores["train_accuracy"], scores["train_subset_accuracy"] = multilabel_accuracy(clf, train, device)
        scores["val_accuracy"], scores["val_subset_accuracy"] = (
            multilabel_accuracy(clf, val, device) if labelled_val else (None, None)
        )
    else:
        scores["train_accuracy"] = accuracy(clf, train, device)
        scores["val_accuracy"] = accuracy(clf, val, device) if labelled_val else None
    return {
        "format": "bayescli-checkpoint",
        "format_version": 1,
        "bayescli_version": __version__,
        "model": str(spec),
        "model_kwargs": model_kwargs or {},
        "input_shape": list(train.input_shape),
        "num_classes": train.num_classes,
        "likelihood": likelihood,
        "class_names": train.class_names,
        "normalisation": {"mean": mean, "std": std},
        "data": train.info,
        "training": training,
        "train_loss": train_loss,
        **scores,
        # held out from training: fitting commands choose hyperparameters on it by default
        "val_data": None if val is None else val.info,
    }


def save_checkpoint(path: str | Path, classifier: Classifier, metadata: dict) -> None:
    """Write the network's state dict (without the wrapper) and ``metadata`` as safetensors."""
    save_tensors(path, dict(classifier.network.state_dict()), metadata)
