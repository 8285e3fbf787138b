"""``bayescli train`` on segmentation data: a builtin segmentation net fitted by MAP.

The objective is the pixel cross-entropy averaged over the valid pixels of a batch (mask not
``ignore_index``), as torchvision's and mmsegmentation's training recipes use it; the optimiser,
schedule, seeding and checkpoint layout are those of :func:`~bayescli.training.classifier.train_classifier`
(AdamW, one-cycle cosine schedule, seeded shuffling, per-channel input normalisation of the
training images). The checkpoint records ``"task": "segmentation"`` and ``ignore_index``, and its
scores are pixel accuracies over valid pixels.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch
from torch import nn

from bayescli._version import __version__
from bayescli.data.segmentation import SegmentationData
from bayescli.errors import BayescliError, require
from bayescli.evaluation.dense import map_pixel_accuracy
from bayescli.models.dense import DenseClassifier, find_dense_head
from bayescli.models.specs import Classifier, ModelSpec, build_network, builtin_names
from bayescli.options import TrainConfig
from bayescli.progress import track

TASK = "segmentation"


def pixel_stats(data: SegmentationData, max_images: int = 2000) -> tuple[list[float], list[float]]:
    """Per-channel mean and std ``([C], [C])`` of the pixels of the first ``max_images`` images, on
    the [0, 1] scale the batches yield (float64 sums, one batch at a time)."""
    total = sq = None
    count = 0
    for x, _ in data.subset(slice(0, max_images)).batches(256):
        x = x.double()
        part, part_sq = x.sum((0, 2, 3)), x.square().sum((0, 2, 3))
        total = part if total is None else total + part
        sq = part_sq if sq is None else sq + part_sq
        count += x.shape[0] * x.shape[2] * x.shape[3]
    mean = total / count
    std = (sq / count - mean.square()).clamp_min(0).sqrt()
    return mean.float().tolist(), std.float().clamp_min(1e-3).tolist()


def train_segmenter(
    model: str,
    train: SegmentationData,
    val: SegmentationData | None = None,
    config: TrainConfig | None = None,
    device: torch.device | str = "cpu",
) -> tuple[Classifier, dict]:
    """Train ``builtin:NAME`` (a segmentation net, e.g. ``builtin:small-segnet``) on ``train``'s
    images and masks; returns the network wrapped as a :class:`Classifier` (what
    :func:`~bayescli.training.classifier.save_checkpoint` writes) and the checkpoint metadata."""
    cfg = config or TrainConfig()
    spec = ModelSpec.parse(model)
    require(
        spec.kind == "builtin",
        f"bayescli train trains builtin models only ({', '.join(builtin_names())}); got {spec}",
    )
    require(train.mask is not None, f"{train.spec} has no masks; training needs labelled data")
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    k = train.num_classes
    net = build_network(spec, k, train.input_shape, {})
    mean, std = pixel_stats(train)
    try:
        head = find_dense_head(net)
    except BayescliError:
        raise BayescliError(
            f"{spec} is not a segmentation model (no 1×1 Conv2d dense head); train builtin:small-segnet "
            "on seg: data"
        ) from None
    dense = DenseClassifier(net, head, mean, std).to(device)
    with torch.no_grad():
        out = dense.net(dense.normalise(next(train.batches(1))[0].to(device)))
    require(
        isinstance(out, torch.Tensor) and out.dim() == 4,
        f"{spec} does not return per-pixel logits [N, K, H, W]; train builtin:small-segnet on seg: data",
    )
    opt = torch.optim.AdamW(dense.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = math.ceil(len(train) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=cfg.lr, total_steps=cfg.epochs * steps, pct_start=0.15
    )
    ignore = -100 if train.ignore_index is None else train.ignore_index
    loss_fn = nn.CrossEntropyLoss(ignore_index=ignore)
    gen = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []
    for _ in track(range(cfg.epochs), total=cfg.epochs, description=f"training {spec}"):
        dense.train()
        perm = torch.randperm(len(train), generator=gen)
        total = 0.0
        for start in range(0, len(train), cfg.batch_size):
            batch = train.subset(perm[start : start + cfg.batch_size])
            x, mask = next(batch.batches(len(batch)))
            loss = loss_fn(dense(x.to(device)), mask.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(batch)
        losses.append(total / len(train))
    dense.eval()
    clf = Classifier(net, head, mean, std)
    meta = {
        "format": "bayescli-checkpoint",
        "format_version": 1,
        "bayescli_version": __version__,
        "model": str(spec),
        "model_kwargs": {},
        "task": TASK,
        "ignore_index": train.ignore_index,
        "input_shape": list(train.input_shape),
        "num_classes": k,
        "likelihood": "categorical",
        "class_names": train.class_names,
        "normalisation": {"mean": mean, "std": std},
        "data": train.info,
        "training": asdict(cfg),
        "train_loss": losses,
        "train_accuracy": map_pixel_accuracy(dense, train, device),
        "val_accuracy": None if val is None or val.mask is None else map_pixel_accuracy(dense, val, device),
        # held out from training: fit-laplace chooses δ on it by default
        "val_data": None if val is None else val.info,
    }
    return clf, meta
