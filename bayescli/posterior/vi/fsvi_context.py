"""FSVI's context distributions ``p_Xc`` (VI-SPEC B1; seed 001 App. D.8), in pixel space.

``monochrome``: each channel filled with one pixel value drawn from that channel's pooled
training pixels (flat inputs: uniform within the training range per dimension); ``augment``:
training images randomly flipped, shifted and rotated; or a related data set, supplied by the
caller as :class:`~bayescli.data.Data` (this module loads nothing by spec).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bayescli.data import Data
from bayescli.errors import BayescliError, require

CONTEXT_KINDS = ("monochrome", "augment")  # the keyword contexts; any other string is a data spec
AUG_MAX_ROTATION = 180.0  # degrees; augment context: any rotation ...
AUG_MAX_SHIFT = 0.25  # ... a shift of up to a quarter of the side, and a horizontal flip (p = ½)


def monochrome(data: Data, num: int, generator: torch.Generator) -> torch.Tensor:
    """``num`` monochrome images ``[num, C, H, W]`` in pixel space (seed App. D.8).

    Channel ``c`` of each image is filled with one value drawn from the pooled pixel values of
    channel ``c`` over all of ``data`` (a uniform (image, pixel) pair: every image has the same
    number of pixels). Flat inputs ``[D]``: uniform in ``[min, max]`` of the data per dimension.
    """
    if len(data.input_shape) != 3:
        x = data.inputs(slice(None)).flatten(1)
        return _uniform_box(x.min(0).values, x.max(0).values, num, data.input_shape, generator)
    c, h, w = data.input_shape
    image = torch.randint(len(data), (num, c), generator=generator)
    pixel = torch.randint(h * w, (num, c), generator=generator)
    values = data.x.reshape(len(data), c, h * w)[image, torch.arange(c), pixel]
    values = values.float() / 255.0 if data.x.dtype == torch.uint8 else values.float()
    return values[:, :, None, None].expand(num, c, h, w).contiguous()


def _uniform_box(
    lo: torch.Tensor, hi: torch.Tensor, num: int, shape: tuple[int, ...], generator: torch.Generator
) -> torch.Tensor:
    """``num`` draws ``[num, *shape]`` uniform in the box ``[lo, hi]`` (flat ``[D]`` bounds)."""
    return (lo + torch.rand(num, len(lo), generator=generator) * (hi - lo)).reshape(num, *shape)


def augment_images(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random horizontal flip (p = ½), rotation (±``AUG_MAX_ROTATION``°) and shift (up to
    ``AUG_MAX_SHIFT`` of the side) of images ``[N, C, H, W]``, bilinear with zero fill."""
    if x.dim() != 4:
        raise BayescliError(f"context augment needs image inputs [C, H, W], got {list(x.shape[1:])}")
    n = len(x)
    flip = torch.rand(n, generator=generator) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    angle = (2 * torch.rand(n, generator=generator) - 1) * math.radians(AUG_MAX_ROTATION)
    shift = (2 * torch.rand(n, 2, generator=generator) - 1) * 2 * AUG_MAX_SHIFT  # grid spans [−1, 1]
    cos, sin = angle.cos(), angle.sin()
    theta = torch.stack(
        [torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1
    )
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


class ContextSampler:
    """Draws context inputs in pixel space ``[n, *input_shape]`` from ``p_Xc``.

    ``context``: ``monochrome``, ``augment`` (of ``train``'s images) or a :class:`Data` pool in
    the fitting data's pixel space; a pool with more than ``pool_rows`` rows keeps a seeded
    random subset of that many (``seed``: the rows ``load_data(spec, limit=pool_rows, seed=seed)``
    keeps, so a spec loaded whole or with that limit gives the same pool).
    """

    def __init__(
        self, context: str | Data, train: Data, generator: torch.Generator, pool_rows: int, seed: int
    ) -> None:
        self.train, self.generator = train, generator
        self.kind = context if isinstance(context, str) else "data"
        self.pool: Data | None = None
        self.box: tuple[torch.Tensor, torch.Tensor] | None = None
        if isinstance(context, Data):
            if context.input_shape != train.input_shape:
                raise BayescliError(
                    f"context {context.spec} has inputs of shape {list(context.input_shape)} but the "
                    f"training data {list(train.input_shape)}; use a context set of the same shape"
                )
            if len(context) > pool_rows:
                rows = torch.randperm(len(context), generator=torch.Generator().manual_seed(seed))
                context = context.subset(rows[:pool_rows].sort().values, limit=pool_rows, limit_seed=seed)
            self.pool = context
        elif context == "monochrome" and len(train.input_shape) != 3:
            x = train.inputs(slice(None)).flatten(1)  # flat inputs: the training range, found once
            self.box = x.min(0).values, x.max(0).values
        elif context == "augment":
            require(len(train.input_shape) == 3, "context augment needs image inputs [C, H, W]")
        else:
            require(
                context == "monochrome",
                f"context '{context}' is a data spec: load it and pass the Data as context "
                "(FSVIConfig.data_specs() lists the specs to load)",
            )

    def __call__(self, num: int) -> torch.Tensor:
        gen = self.generator
        if self.box is not None:
            return _uniform_box(*self.box, num, self.train.input_shape, gen)
        if self.kind == "monochrome":
            return monochrome(self.train, num, gen)
        source = self.pool if self.pool is not None else self.train
        x = source.inputs(torch.randint(len(source), (num,), generator=gen))
        return augment_images(x, gen) if self.kind == "augment" else x
