"""Segmentation scenes composed from digit images: the per-pixel benchmark of issue 36.

A scene is a blank canvas (e.g. 64×64) with several digit images (e.g. MNIST's 28×28) pasted at
random positions whose boxes do not overlap. Its mask holds ``digit class + 1`` on each digit's
foreground (pixels brighter than ``threshold``, on the [0, 1] scale) and 0 (background)
everywhere else, so ``K = classes + 1`` (11 for digits). The anomaly variant pastes further
images (notMNIST letters) into the scene, again without overlapping any box: their foreground
pixels are ``ignore_index`` in the class mask (they belong to no class) and 1 in a separate
anomaly mask (0 elsewhere), the labels of pixel-level anomaly segmentation
(:class:`bayescli.metrics.segmentation.AnomalySegmentationMetrics`).

Everything is fixed by the seed (a ``torch.Generator``). Images come in as tensors ``[N, h, w]``
(or ``[N, 1, h, w]``), uint8 or float in [0, 1]; scenes keep their dtype. :func:`save_scenes`
writes the ``.npz`` the segmentation loader reads: ``x [N, H, W]``, ``mask [N, H, W]`` uint8,
``class_names``, and ``anomaly`` and ``placed`` (the layout) beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bayescli.errors import BayescliError

IGNORE_INDEX = 255
THRESHOLD = 0.5
TRIES = 100  # positions tried per object, and layouts tried per scene, before giving up
DIGIT, ANOMALY = 0, 1  # kinds in Scenes.placed


@dataclass
class Scenes:
    """Composed scenes: ``x [N, H, W]`` (the images' dtype), ``mask [N, H, W]`` uint8 (0
    background, ``c + 1`` for class ``c``, ``ignore_index`` on anomalies), ``anomaly [N, H, W]``
    uint8 0/1 (``None`` without anomalies), ``placed [P, 5]`` int64 rows ``(scene, kind, source
    row, top, left)`` with kind 0 a digit (row of the digit images) and 1 an anomaly (row of the
    anomaly images), and ``class_names`` ``["background", *classes]``."""

    x: torch.Tensor
    mask: torch.Tensor
    anomaly: torch.Tensor | None
    placed: torch.Tensor
    class_names: list[str]


def _grey(images: torch.Tensor, what: str) -> torch.Tensor:
    """``[N, h, w]`` of ``images [N, h, w]`` or ``[N, 1, h, w]``."""
    if images.dim() == 4 and images.shape[1] == 1:
        images = images[:, 0]
    if images.dim() != 3 or not len(images):
        raise BayescliError(f"{what} must be grey images [N, h, w] or [N, 1, h, w], got {list(images.shape)}")
    if images.dtype is not torch.uint8 and not images.is_floating_point():
        raise BayescliError(f"{what} must be uint8 or float pixels, got {images.dtype}")
    return images


def foreground(images: torch.Tensor, threshold: float = THRESHOLD) -> torch.Tensor:
    """Boolean ``[..., h, w]``: pixels brighter than ``threshold`` on the [0, 1] scale (uint8 /255)."""
    scale = 255.0 if images.dtype is torch.uint8 else 1.0
    return images.float() / scale > threshold


def _overlaps(box: tuple[int, int, int, int], boxes: list[tuple[int, int, int, int]]) -> bool:
    t, left, h, w = box
    return any(t < t2 + h2 and t2 < t + h and left < l2 + w2 and l2 < left + w for t2, l2, h2, w2 in boxes)


def _layout(
    gen: torch.Generator, canvas: tuple[int, int], sizes: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Top-left corners for boxes of ``sizes`` on ``canvas``, none overlapping: each box tries
    :data:`TRIES` uniform positions; a box that finds no room restarts the whole layout."""
    for _ in range(TRIES):
        boxes: list[tuple[int, int, int, int]] = []
        for h, w in sizes:
            for _ in range(TRIES):
                t = int(torch.randint(canvas[0] - h + 1, (), generator=gen))
                left = int(torch.randint(canvas[1] - w + 1, (), generator=gen))
                if not _overlaps((t, left, h, w), boxes):
                    boxes.append((t, left, h, w))
                    break
            else:
                break
        if len(boxes) == len(sizes):
            return [(t, left) for t, left, _, _ in boxes]
    raise BayescliError(
        f"cannot place {len(sizes)} images of {sizes[0][0]}×{sizes[0][1]} without overlap on a "
        f"{canvas[0]}×{canvas[1]} canvas; use a larger canvas or fewer objects per scene"
    )


def compose_scenes(
    images: torch.Tensor,
    labels: torch.Tensor,
    count: int,
    seed: int,
    *,
    canvas: tuple[int, int] = (64, 64),
    objects: tuple[int, int] = (1, 3),
    anomalies: torch.Tensor | None = None,
    anomaly_objects: tuple[int, int] = (1, 1),
    threshold: float = THRESHOLD,
    ignore_index: int = IGNORE_INDEX,
    class_names: list[str] | None = None,
) -> Scenes:
    """``count`` scenes of ``images [N, h, w]`` (classes ``labels [N]`` in ``0 … C−1``): each holds
    between ``objects[0]`` and ``objects[1]`` digits (uniformly many, rows drawn uniformly with
    replacement) and, with ``anomalies [M, h', w']``, between ``anomaly_objects[0]`` and
    ``anomaly_objects[1]`` of those pasted after them; no two boxes overlap. Deterministic given
    ``seed``. ``class_names``: the ``C`` classes' names (default ``"0" … "C−1"``)."""
    images = _grey(images, "digit images")
    if count < 0:
        raise BayescliError(f"the number of scenes must be ≥ 0, got {count}")
    labels = labels.reshape(-1).long()
    if len(labels) != len(images):
        raise BayescliError(f"{len(images)} digit images but {len(labels)} labels")
    if bool((labels < 0).any()):
        raise BayescliError("digit labels must be class indices ≥ 0")
    classes = int(labels.max()) + 1
    names = [str(c) for c in range(classes)] if class_names is None else list(class_names)
    if len(names) < classes:
        raise BayescliError(f"labels reach class {classes - 1} but {len(names)} class names were given")
    if len(names) + 1 > 255 or 0 <= ignore_index <= len(names):
        raise BayescliError(
            f"{len(names)} classes and background need mask values 0–{len(names)}, which must fit uint8 "
            f"and leave ignore_index {ignore_index} free"
        )
    kinds = [(DIGIT, images, objects)]
    if anomalies is not None:
        anomalies = _grey(anomalies, "anomaly images")
        kinds.append((ANOMALY, anomalies, anomaly_objects))
    for _, src, (lo, hi) in kinds:
        if not 0 <= lo <= hi:
            raise BayescliError(
                f"objects per scene must be a range (lo, hi) with 0 ≤ lo ≤ hi, got {(lo, hi)}"
            )
        if src.shape[1] > canvas[0] or src.shape[2] > canvas[1]:
            raise BayescliError(
                f"images of {src.shape[1]}×{src.shape[2]} do not fit a {canvas[0]}×{canvas[1]} canvas"
            )
    dtype = images.dtype if anomalies is None or anomalies.dtype == images.dtype else torch.float32

    gen = torch.Generator().manual_seed(seed)
    placed: list[tuple[int, int, int, int, int]] = []
    for scene in range(count):
        picks = []  # (kind, source row) in pasting order
        for kind, src, (lo, hi) in kinds:
            n = int(torch.randint(lo, hi + 1, (), generator=gen))
            picks += [(kind, int(r)) for r in torch.randint(len(src), (n,), generator=gen)]
        sizes = [tuple(kinds[kind][1].shape[1:]) for kind, _ in picks]
        corners = _layout(gen, canvas, sizes) if picks else []
        placed += [(scene, kind, row, t, left) for (kind, row), (t, left) in zip(picks, corners, strict=True)]

    x = torch.zeros(count, *canvas, dtype=dtype)
    mask = torch.zeros(count, *canvas, dtype=torch.uint8)
    anomaly = None if anomalies is None else torch.zeros(count, *canvas, dtype=torch.uint8)
    for scene, kind, row, t, left in placed:
        img = kinds[kind][1][row]
        h, w = img.shape
        box = (scene, slice(t, t + h), slice(left, left + w))
        x[box] = img.to(dtype) / 255.0 if img.dtype != dtype and img.dtype is torch.uint8 else img.to(dtype)
        fg = foreground(img, threshold)
        if kind == DIGIT:
            mask[box][fg] = int(labels[row]) + 1
        else:
            mask[box][fg] = ignore_index
            anomaly[box][fg] = 1
    placed_t = torch.tensor(placed, dtype=torch.int64).reshape(-1, 5)
    return Scenes(x, mask, anomaly, placed_t, ["background", *names])


def save_scenes(scenes: Scenes, path: Path) -> None:
    """Write ``scenes`` as a compressed ``.npz``: ``x``, ``mask``, ``class_names``, ``placed`` and,
    for the anomaly variant, ``anomaly``."""
    arrays = {
        "x": scenes.x.numpy(),
        "mask": scenes.mask.numpy(),
        "class_names": np.array(scenes.class_names),
        "placed": scenes.placed.numpy(),
    }
    if scenes.anomaly is not None:
        arrays["anomaly"] = scenes.anomaly.numpy()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
