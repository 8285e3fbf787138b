"""The in-memory dataset every loader returns."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from bayescli.errors import BayescliError


@dataclass
class ArrayData:
    """Inputs, optional labels and provenance.

    ``x`` is ``[N, *input_shape]``: ``uint8`` pixels (0–255, scaled to [0, 1] on access) or
    ``float32`` already in model space (pixels in [0, 1], or tabular values). ``y`` is ``[N]``
    int64 or ``None`` for unlabeled data. ``info`` records the spec, split and seeds.
    """

    x: torch.Tensor
    y: torch.Tensor | None
    class_names: list[str]
    info: dict = field(default_factory=dict)
    index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.y is not None and len(self.y) != len(self.x):
            raise BayescliError(f"{len(self.x)} inputs but {len(self.y)} labels in {self.spec}")
        if self.index is None:
            self.index = torch.arange(len(self.x))

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def spec(self) -> str:
        return str(self.info.get("spec", "data"))

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def inputs(self, index: slice | torch.Tensor) -> torch.Tensor:
        """Float inputs for ``index`` (``[B, *input_shape]``), pixels scaled to [0, 1]."""
        xb = self.x[index]
        return xb.float().div_(255.0) if xb.dtype == torch.uint8 else xb.float()

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Yield ``(x [B, ...] float, y [B] or None)`` in order."""
        for start in range(0, len(self), batch_size):
            sl = slice(start, start + batch_size)
            yield self.inputs(sl), None if self.y is None else self.y[sl]

    def subset(self, index: torch.Tensor | slice, **info: object) -> ArrayData:
        """The rows ``index`` as a new dataset, with ``info`` added to the provenance."""
        return ArrayData(
            self.x[index],
            None if self.y is None else self.y[index],
            self.class_names,
            {**self.info, **info},
            self.index[index],
        )

    def map_inputs(self, fn, batch_size: int = 1024) -> ArrayData:
        """A copy whose inputs are ``fn(x)`` (pixel-space float batches ``[B, ...]`` → ``[B, ...]``)."""
        x = torch.cat([fn(xb) for xb, _ in self.batches(batch_size)]) if len(self) else self.x.float()
        return ArrayData(x, self.y, self.class_names, dict(self.info), self.index)

    def check_finite(self) -> None:
        """Raise if any input is NaN or infinite."""
        if self.x.is_floating_point() and not torch.isfinite(self.x).all():
            bad = int((~torch.isfinite(self.x)).flatten(1).any(1).sum())
            raise BayescliError(f"{self.spec}: {bad} inputs contain NaN or inf; clean the data first")
