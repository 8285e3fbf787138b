"""Images with per-pixel class masks (semantic segmentation sets).

A :class:`SegmentationData` pairs images ``x [N, C, H, W]`` (uint8 pixels, or floats in [0, 1]) with
integer masks ``[N, H, W]``: a class index per pixel, or ``ignore_index`` (default 255, the value
VOC and Cityscapes use for borders and void) for pixels that no loss, curvature or metric counts.
:meth:`SegmentationData.batches` yields ``(x [B, C, H, W] float, mask [B, H, W] int64)``.

Held in memory (``npz``, small sets); the pixels of a batch are read as they are yielded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from bayescli.data.sources import check_layout, check_pixel_range
from bayescli.errors import BayescliError, require

IGNORE_INDEX = 255


def valid_pixels(mask: torch.Tensor, ignore_index: int | None = IGNORE_INDEX) -> torch.Tensor:
    """Boolean ``[...]`` of the pixels of ``mask [...]`` that count (not ``ignore_index``)."""
    return torch.ones_like(mask, dtype=torch.bool) if ignore_index is None else mask != ignore_index


def check_mask(mask: torch.Tensor, num_classes: int, ignore_index: int | None, where: str) -> None:
    """Raise unless every pixel of ``mask`` is a class index below ``num_classes`` or ``ignore_index``."""
    valid = mask[valid_pixels(mask, ignore_index)]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= num_classes):
        bad = int(valid.min()) if int(valid.min()) < 0 else int(valid.max())
        ignored = f" or the ignore index {ignore_index}" if ignore_index is not None else ""
        raise BayescliError(
            f"{where}: mask holds class {bad} but the model has {num_classes} classes (0–{num_classes - 1}"
            f"{ignored}); use masks with the model's classes or set ignore_index"
        )


class SegmentationData:
    """Images ``x [N, C, H, W]`` and masks ``[N, H, W]`` int64 (``None``: unlabelled), class names,
    ``ignore_index``, provenance ``info`` and, for anomaly segmentation, ``anomaly [N, H, W]`` uint8
    0/1 (1 on the pixels of an out-of-distribution object, as :func:`bayescli.data.scenes.save_scenes`
    writes them; ``None`` otherwise)."""

    def __init__(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        class_names: list[str],
        ignore_index: int | None = IGNORE_INDEX,
        info: dict | None = None,
        anomaly: torch.Tensor | None = None,
    ) -> None:
        where = str((info or {}).get("source", "data"))
        require(x.dim() == 4, f"{where}: images must be [N, C, H, W], got {list(x.shape)}")
        if mask is not None:
            require(
                mask.dim() == 3 and tuple(mask.shape) == (x.shape[0], *x.shape[2:]),
                f"{where}: masks must be [N, H, W] = {[x.shape[0], *x.shape[2:]]} to match the images, "
                f"got {list(mask.shape)}",
            )
            require(
                not mask.is_floating_point() and mask.dtype is not torch.bool,
                f"{where}: masks must hold integer class indices, got {mask.dtype}",
            )
            mask = mask.long()
            check_mask(mask, len(class_names), ignore_index, where)
        if anomaly is not None:
            require(
                tuple(anomaly.shape) == (x.shape[0], *x.shape[2:]),
                f"{where}: 'anomaly' must be [N, H, W] = {[x.shape[0], *x.shape[2:]]}, "
                f"got {list(anomaly.shape)}",
            )
            require(
                bool(((anomaly == 0) | (anomaly == 1)).all()),
                f"{where}: 'anomaly' must hold 0 (normal) or 1 (anomalous) per pixel",
            )
            anomaly = anomaly.to(torch.uint8)
        self.x, self.mask, self.class_names = x, mask, list(class_names)
        self.ignore_index, self.info, self.anomaly = ignore_index, dict(info or {}), anomaly

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def spec(self) -> str:
        """The data spec it was loaded from (else its source file)."""
        return str(self.info.get("spec", self.info.get("source", "data")))

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def _pixels(self, xb: torch.Tensor) -> torch.Tensor:
        return xb.float().div_(255.0) if xb.dtype == torch.uint8 else xb.float()

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Yield ``(x [B, C, H, W] float in [0, 1], mask [B, H, W] int64 or None)`` in order."""
        for start in range(0, len(self), batch_size):
            sl = slice(start, start + batch_size)
            yield self._pixels(self.x[sl]), None if self.mask is None else self.mask[sl]

    def subset(self, index: slice | torch.Tensor | list) -> SegmentationData:
        """The rows ``index`` as a new set (same class names, ignore index and provenance)."""
        rows = torch.arange(len(self))[index] if isinstance(index, slice) else torch.as_tensor(index)
        mask = None if self.mask is None else self.mask[rows]
        anomaly = None if self.anomaly is None else self.anomaly[rows]
        return SegmentationData(self.x[rows], mask, self.class_names, self.ignore_index, self.info, anomaly)

    def valid_count(self) -> int:
        """The number of pixels that count (every pixel of unlabelled data)."""
        if self.mask is None:
            return len(self) * int(self.x.shape[2] * self.x.shape[3])
        return int(valid_pixels(self.mask, self.ignore_index).sum())


def segmentation_npz(path: Path, ignore_index: int | None = IGNORE_INDEX) -> SegmentationData:
    """Arrays ``x`` (``[N, H, W]`` grey or ``[N, C, H, W]``; uint8 pixels or floats in [0, 1]), ``mask``
    (``[N, H, W]`` integer class indices, ``ignore_index`` for void pixels; optional), optional
    ``class_names`` (else ``0 … max class``) and optional ``anomaly`` (``[N, H, W]`` 0/1): the files
    :func:`bayescli.data.scenes.save_scenes` writes, among others."""
    if not path.is_file():
        raise BayescliError(f"npz file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as f:
            if "x" not in f.files:
                raise BayescliError(f"{path} has no array 'x' (found: {', '.join(f.files) or 'none'})")
            x_np, m_np = f["x"], (f["mask"] if "mask" in f.files else None)
            a_np = f["anomaly"] if "anomaly" in f.files else None
            names = [str(s) for s in f["class_names"]] if "class_names" in f.files else None
    except (ValueError, OSError) as exc:
        raise BayescliError(f"cannot read {path} as .npz ({exc}); save with numpy.savez") from None
    if x_np.ndim == 3:
        x_np = x_np[:, None]
    require(x_np.ndim == 4, f"{path}: 'x' must be [N, H, W] or [N, C, H, W] images, got {list(x_np.shape)}")
    check_layout(x_np, path)
    if x_np.dtype != np.uint8:
        x_np = x_np.astype(np.float32)
        check_pixel_range(x_np, path)
        require(bool(np.isfinite(x_np).all()), f"{path}: 'x' contains NaN or inf; clean the data first")
    x = torch.from_numpy(np.ascontiguousarray(x_np))
    mask = None
    if m_np is not None:
        require(
            np.issubdtype(m_np.dtype, np.integer),
            f"{path}: 'mask' must hold integer class indices, got {m_np.dtype}",
        )
        mask = torch.from_numpy(m_np.astype(np.int64))
    if names is None:
        valid = None if mask is None else mask[valid_pixels(mask, ignore_index)]
        k = int(valid.max()) + 1 if valid is not None and valid.numel() else 0
        names = [str(i) for i in range(k)]
    anomaly = None if a_np is None else torch.from_numpy(np.ascontiguousarray(a_np))
    return SegmentationData(x, mask, names, ignore_index, {"source": str(path)}, anomaly)
