"""Multi-label sets composed from a single-label image set: several images side by side.

Composite ``i`` is a canvas of ``slots`` cells in a row (``[C, H, slots·W]`` for base images
``[C, H, W]``, e.g. ``1×28×84`` from MNIST, ``1×8×24`` from scikit-learn's digits). Between 1 and
``slots`` cells (uniformly many, in random cells) hold a base image; the others stay empty (zero).
Its label is the multi-hot set of the classes shown, ``[K]`` 0/1 over the base's class names; a
class shown twice counts once.

Composites are drawn per group of base rows: composite ``i`` uses only base images of the group
that holds base row ``i`` (there are as many composites as base rows). Passing the base's
train/val/test partition as the groups keeps every base image in the composed split of that name,
so no image is shared between a composed training and test set. Everything is fixed by ``seed``;
pixels are assembled lazily, batch by batch, from the base set.
"""

from __future__ import annotations

import torch

from bayescli.data.base import Data, Source
from bayescli.errors import BayescliError

DEFAULT_SLOTS = 3


class ComposedSource(Source):
    """Composites of ``base`` images: ``picks [N, slots]`` holds the base positions shown in each cell
    (``-1`` for an empty cell), ``labels [N, K]`` the multi-hot classes shown."""

    def __init__(self, base: Data, picks: torch.Tensor, labels: torch.Tensor) -> None:
        super().__init__()
        c, h, w = base.input_shape
        self.base, self.picks, self.labels = base, picks, labels
        self.shape = (c, h, picks.shape[1] * w)

    def __len__(self) -> int:
        return int(self.picks.shape[0])

    def load_many(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
        picks = self.picks[rows]
        used = picks[picks >= 0].unique()  # each base image is read once per batch
        images = self.base.take(used)[0]
        if len(images) != len(used):
            raise BayescliError(f"{self.base.spec}: some base images cannot be read; cannot compose them")
        # one zero image per empty cell, so a single gather fills the canvas
        images = torch.cat([images, images.new_zeros(1, *images.shape[1:])])
        where = torch.where(picks >= 0, torch.searchsorted(used, picks), len(used))
        cells = images[where]  # [B, slots, C, H, W]
        return torch.cat(cells.unbind(1), dim=-1), rows, []


def compose(base: Data, groups: list[torch.Tensor], seed: int, slots: int = DEFAULT_SLOTS) -> Data:
    """The composed multi-label set of ``base`` (single-label images ``[C, H, W]``), one composite per
    base row; composite ``i`` draws its images from the group (``groups``: base positions,
    together covering every row once) that holds row ``i``. Deterministic given ``seed``."""
    if base.y is None:
        raise BayescliError(f"composing needs labelled images; {base.spec} has no labels")
    if base.multilabel:
        raise BayescliError(f"composing needs single-label images; {base.spec} is already multi-label")
    if len(base.input_shape) != 3:
        shape = list(base.input_shape)
        raise BayescliError(f"composing needs images [C, H, W]; {base.spec} has inputs {shape}")
    if slots < 1:
        raise BayescliError(f"composing needs at least one cell per image, got {slots}")
    n = len(base)
    owner = torch.full((n,), -1, dtype=torch.int64)
    for g, rows in enumerate(groups):
        owner[rows] = g
    if bool((owner < 0).any()) or sum(len(rows) for rows in groups) != n:
        raise BayescliError("composing needs groups that hold every base row exactly once")
    gen = torch.Generator().manual_seed(seed)
    count = torch.randint(1, slots + 1, (n,), generator=gen)
    # cells in a random order per composite: the first `count` of them are filled
    filled = torch.rand(n, slots, generator=gen).argsort(1) < count[:, None]
    picks = torch.full((n, slots), -1, dtype=torch.int64)
    for rows in groups:
        if len(rows):
            drawn = rows[torch.randint(len(rows), (len(rows), slots), generator=gen)]
            picks[rows] = torch.where(filled[rows], drawn, -1)
    y = base.y
    labels = torch.zeros(n, base.num_classes, dtype=torch.int64)
    for cell in range(slots):
        shown = picks[:, cell] >= 0
        labels[shown.nonzero().squeeze(1), y[picks[shown, cell]]] = 1
    info = {
        "source": f"composed from {base.spec}",
        "composed": {"base": base.info, "slots": slots, "seed": seed, "images_per_composite": [1, slots]},
    }
    return Data(ComposedSource(base, picks, labels), base.class_names, info)
