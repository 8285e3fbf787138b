"""Datasets as lazy views over a source, read batch by batch through a torch ``DataLoader``.

A :class:`Data` never holds the pixels of a whole set. It is

* a :class:`Source` — random access from a stored row to its pixels (float ``[C, H, W]`` in
  [0, 1] after any per-image resize/crop) and label: tensors in memory (:class:`TensorSource`,
  for small sets), memory-mapped records, or image files decoded on demand;
* an index map ``rows`` into the source (splits, ``--limit`` and index ranges are index maps, so
  they stay deterministic and cost no pixels), with labels and provenance (``info``, ``index``);
* lazy transforms (:meth:`Data.map_inputs`): batch functions applied while iterating, in the
  ``DataLoader`` workers unless they need the main process (e.g. a model's gradient).

:meth:`Data.batches` yields ``(x [B, ...] float, y [B] or None)`` in a fixed order whatever
``num_workers`` is. :meth:`Data.take` / :meth:`Data.inputs` read a few rows at random.

Labels are single-label class indices ``[N]`` int64, or multi-label ``[N, K]`` 0/1 indicators
(int64 or uint8; :attr:`Data.multilabel`), one column per class name; every view, batch and
``take`` then carries ``y`` as ``[B, K]``.

Unreadable items (a corrupt image file) stop the iteration with a :class:`BayescliError` naming the
file; with ``skip_unreadable`` they are dropped from the batch instead and remembered by the
source, so every later pass and every view of that source leaves them out too (``len``, ``y``
and ``index`` shrink accordingly) and ``info["unreadable"]`` lists them.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from bayescli.errors import BayescliError


class UnreadableItem(Exception):  # noqa: N818 - a per-item outcome, turned into BayescliError by Data
    """Raised by :meth:`Source.load` for an item that cannot be decoded."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path} ({reason})")
        self.path, self.reason = path, reason


class Source(ABC):
    """Random access to a stored set: row → float item ``shape`` (pixels in [0, 1]) and labels ``[N]``
    (class indices) or ``[N, K]`` (multi-label 0/1), or ``None``.

    ``unreadable`` maps rows found unreadable (under ``skip_unreadable``) to ``(path, reason)``;
    it lives in the process that iterates, shared by every view of this source.
    """

    labels: torch.Tensor | None
    shape: tuple[int, ...]

    def __init__(self) -> None:
        self.unreadable: dict[int, tuple[str, str]] = {}

    @abstractmethod
    def __len__(self) -> int: ...

    def load(self, row: int) -> torch.Tensor:
        """Item ``row`` as float ``shape``; raises :class:`UnreadableItem` if it cannot be read.

        A source implements this (one item at a time) or overrides :meth:`load_many` (whole batches,
        e.g. memory-mapped arrays); the default :meth:`load_many` calls this.
        """
        raise NotImplementedError(f"{type(self).__name__} reads whole batches through load_many")

    def load_many(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, str, str]]]:
        """Items ``rows`` stacked ``[B', *shape]``, the rows kept and ``(row, path, reason)`` of the rest."""
        items, kept, bad = [], [], []
        for r in rows.tolist():
            try:
                items.append(self.load(r))
                kept.append(r)
            except UnreadableItem as exc:
                bad.append((r, exc.path, exc.reason))
        x = torch.stack(items) if items else torch.empty(0, *self.shape)
        return x, torch.tensor(kept, dtype=torch.int64), bad


class TensorSource(Source):
    """A set held in memory: ``x [N, ...]`` uint8 pixels (scaled to [0, 1] on access) or float."""

    def __init__(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        super().__init__()
        if labels is not None and len(labels) != len(x):
            raise BayescliError(f"{len(x)} inputs but {len(labels)} labels")
        self.x, self.labels, self.shape = x, labels, tuple(x.shape[1:])

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def load_many(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, str, str]]]:
        xb = self.x[rows]
        return (xb.float().div_(255.0) if xb.dtype == torch.uint8 else xb.float()), rows, []


@dataclass(frozen=True)
class _Transform:
    fn: Callable[..., torch.Tensor]
    seed: int | None
    labels: bool
    workers: bool

    def __call__(self, x: torch.Tensor, rows: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        kwargs: dict = {}
        if self.seed is not None:
            # Seeded by the batch's first stored row: the same numbers whichever worker runs it.
            mixed = (self.seed * 1_000_003 + int(rows[0])) % (2**63)
            kwargs["generator"] = torch.Generator().manual_seed(mixed)
        if self.labels:
            kwargs["y"] = y
        return self.fn(x, **kwargs)


def _apply(transforms: tuple[_Transform, ...], x, rows, y) -> torch.Tensor:
    if len(rows):
        for t in transforms:
            x = t(x, rows, y)
    return x


class _Reader(torch.utils.data.Dataset):
    """What a ``DataLoader`` worker runs: a list of positions → (x, rows kept, unreadable, error).

    A :class:`BayescliError` comes back as its message (``error``), so the main process can raise
    it as the one line it is rather than as the ``DataLoader``'s wrapped worker traceback.
    """

    def __init__(self, source: Source, rows: torch.Tensor, transforms: tuple, labelled: bool) -> None:
        self.source, self.rows, self.transforms, self.labelled = source, rows, transforms, labelled

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, positions: list[int]) -> tuple:
        try:
            x, kept, bad = self.source.load_many(self.rows[positions])
            labels = self.source.labels
            y = labels[kept] if self.labelled and labels is not None else None
            return _apply(self.transforms, x, kept, y), kept, bad, None
        except BayescliError as exc:
            return None, None, [], str(exc)


def _identity(batch):  # noqa: ANN001, ANN202 - the DataLoader's collate_fn (a picklable function)
    return batch


def check_multi_hot(labels: torch.Tensor, class_names: list[str], where: str) -> None:
    """Raise unless multi-label ``labels [N, K]`` are integer 0/1 with one class name per column."""
    if labels.dtype not in (torch.int64, torch.uint8):
        raise BayescliError(f"{where}: multi-label labels must be int64 or uint8 0/1, got {labels.dtype}")
    if labels.shape[1] == 0:
        raise BayescliError(f"{where}: multi-label labels [N, K] need at least one class (K = 0)")
    if len(class_names) != labels.shape[1]:
        raise BayescliError(
            f"{where}: {len(class_names)} class names for {labels.shape[1]} label columns; "
            "give one per column"
        )
    bad = (labels != 0) & (labels != 1)
    if bool(bad.any()):
        value = int(labels[bad][0])
        raise BayescliError(f"{where}: multi-label labels [N, K] must be 0 or 1, found {value}")


def _as_rows(index: slice | torch.Tensor | list, n: int) -> torch.Tensor:
    if isinstance(index, slice):
        return torch.arange(n)[index]
    return torch.as_tensor(index, dtype=torch.int64).reshape(-1)


class Data:
    """A lazy dataset view: labels ``y [N]`` (class indices), ``[N, K]`` (multi-label 0/1, one
    column per class name) or ``None``, class names, provenance ``info`` and ``index [N]`` (row
    numbers in the split's stored set), inputs read on demand.

    Build one with :class:`ArrayData` (tensors) or from a :class:`Source`.
    """

    def __init__(
        self,
        source: Source,
        class_names: list[str],
        info: dict | None = None,
        index: torch.Tensor | None = None,
        num_workers: int = 0,
        skip_unreadable: bool = False,
    ) -> None:
        n = len(source)
        self.source, self.class_names, self.info = source, list(class_names), dict(info or {})
        self._rows = torch.arange(n)
        self._index = torch.arange(n) if index is None else torch.as_tensor(index, dtype=torch.int64)
        if len(self._index) != n:
            raise BayescliError(f"{n} inputs but {len(self._index)} index entries")
        self._labelled = source.labels is not None
        if self._labelled and source.labels.dim() == 2:
            check_multi_hot(source.labels, self.class_names, str(self.info.get("source", "data")))
        elif self._labelled and source.labels.dim() != 1:
            raise BayescliError(f"labels must be [N] or [N, K], got {list(source.labels.shape)}")
        self._transforms: tuple[_Transform, ...] = ()
        self._shape = tuple(source.shape)
        self._shifted = False
        self.num_workers, self.skip_unreadable = num_workers, skip_unreadable
        self._live_cache: tuple[int, torch.Tensor] | None = None

    # -- the rows that are (still) readable -----------------------------------------------------

    def _live(self) -> torch.Tensor | None:
        """Mask of ``_rows`` not found unreadable (``None`` when nothing was)."""
        bad = self.source.unreadable
        if not bad:
            return None
        if self._live_cache is None or self._live_cache[0] != len(bad):
            mask = ~torch.isin(self._rows, torch.tensor(list(bad), dtype=torch.int64))
            self._live_cache = (len(bad), mask)
        return self._live_cache[1]

    @property
    def rows(self) -> torch.Tensor:
        """Stored rows of the source ``[N]`` this view reads, in order."""
        live = self._live()
        return self._rows if live is None else self._rows[live]

    @property
    def index(self) -> torch.Tensor:
        """Row numbers within the split's stored set ``[N]`` (what official shifted copies mirror)."""
        live = self._live()
        return self._index if live is None else self._index[live]

    @property
    def y(self) -> torch.Tensor | None:
        """Labels ``[N]`` int64 (class indices), ``[N, K]`` 0/1 (multi-label), or ``None`` for
        unlabelled data."""
        if not self._labelled or self.source.labels is None:
            return None
        return self.source.labels[self.rows]

    @property
    def multilabel(self) -> bool:
        """Whether the labels are multi-label indicators ``[N, K]`` (``False`` for unlabelled data)."""
        labels = self.source.labels
        return self._labelled and labels is not None and labels.dim() == 2

    def check_labels(self, num_classes: int, likelihood: str = "categorical") -> None:
        """Raise unless the labels suit a ``num_classes``-way classifier of ``likelihood``: class
        indices ``[N]`` below ``num_classes`` for ``categorical`` (softmax), multi-label
        ``[N, num_classes]`` for ``bernoulli`` (a sigmoid per class); unlabelled data suits both."""
        if likelihood == "bernoulli":
            if self.y is not None and not self.multilabel:
                raise BayescliError(
                    f"{self.spec} has one class per input (y [N]), but the model is multi-label (likelihood "
                    f"'bernoulli', a sigmoid per class); use multi-label data (y [N, {num_classes}] of 0/1)"
                )
            if self.multilabel and self.source.labels.shape[1] != num_classes:
                raise BayescliError(
                    f"{self.spec} has {self.source.labels.shape[1]} label columns but the model has "
                    f"{num_classes} classes; use data with the model's classes"
                )
            return
        if self.multilabel:
            raise BayescliError(
                f"{self.spec} is multi-label (y [N, {self.source.labels.shape[1]}] of 0/1), but the model is "
                "a softmax classifier (likelihood 'categorical', one class per input); use single-label data"
            )
        if self.y is not None and len(self.y) and int(self.y.max()) >= num_classes:
            raise BayescliError(
                f"{self.spec} has labels up to {int(self.y.max())} but the model has {num_classes} "
                "classes; use data with the model's classes"
            )

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def spec(self) -> str:
        return str(self.info.get("spec", "data"))

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def shifted(self) -> bool:
        """Whether the inputs were moved away from the stored set on purpose (a rotation, corruption,
        attack or shifted copy): low accuracy is expected there, so :func:`extract_features` does not
        warn about it."""
        return self._shifted

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def x(self) -> torch.Tensor:
        """The stored inputs ``[N, ...]`` of an in-memory set with no lazy transforms (raw dtype)."""
        if not isinstance(self.source, TensorSource) or self._transforms:
            raise BayescliError(f"{self.spec} is read lazily; iterate data.batches() or use data.take()")
        return self.source.x[self.rows]

    @property
    def unreadable(self) -> dict[int, tuple[str, str]]:
        """This view's stored rows skipped as unreadable so far → ``(path, reason)``."""
        bad = self.source.unreadable
        if not bad:
            return {}
        rows = torch.tensor(sorted(bad), dtype=torch.int64)
        return {int(r): bad[int(r)] for r in rows[torch.isin(rows, self._rows)]}

    @property
    def skipped(self) -> list[str]:
        """Paths of this view's items skipped as unreadable so far."""
        return [path for path, _ in self.unreadable.values()]

    # -- reading ------------------------------------------------------------------------------

    def _split_transforms(self) -> tuple[tuple[_Transform, ...], tuple[_Transform, ...]]:
        """(run in workers, run in the main process): everything from the first main-process one on."""
        for i, t in enumerate(self._transforms):
            if not t.workers:
                return self._transforms[:i], self._transforms[i:]
        return self._transforms, ()

    def _record(self, bad: list[tuple[int, str, str]]) -> None:
        if not bad:
            return
        if not self.skip_unreadable:
            _, path, reason = bad[0]
            raise BayescliError(
                f"cannot read {path} ({reason}); replace or remove the file, or pass --skip-unreadable"
            )
        self.source.unreadable.update({row: (path, reason) for row, path, reason in bad})

    def add_unreadable(self, found: list[dict[int, tuple[str, str]]]) -> None:
        """Record rows that other views (e.g. other processes' shards) found unreadable:
        ``found`` is a list of :attr:`unreadable` mappings ``{row: (path, reason)}``."""
        for part in found:
            self.source.unreadable.update(part)
        self._note_skipped()

    def _note_skipped(self) -> None:
        skipped = self.skipped
        if skipped:
            self.info["unreadable"] = {"count": len(skipped), "paths": skipped}

    def batches(
        self, batch_size: int, num_workers: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Yield ``(x [B, ...] float, y [B], [B, K] or None)`` in order (``num_workers``: the view's
        by default).

        Reading, decoding, per-image resizing and worker transforms run in ``num_workers``
        processes (``0``: in this one); the order and the values do not depend on it.
        """
        workers = self.num_workers if num_workers is None else num_workers
        in_workers, in_main = self._split_transforms()
        rows = self.rows
        if not len(rows):
            return
        reader = _Reader(self.source, rows, in_workers, self._labelled)
        sampler = torch.utils.data.BatchSampler(
            torch.utils.data.SequentialSampler(range(len(rows))), batch_size, drop_last=False
        )
        loader = torch.utils.data.DataLoader(
            reader, batch_size=None, sampler=sampler, num_workers=workers, collate_fn=_identity
        )
        labels = self.source.labels if self._labelled else None
        for x, kept, bad, error in loader:
            if error is not None:
                raise BayescliError(error)
            self._record(bad)
            if not len(kept):
                continue
            y = None if labels is None else labels[kept]
            yield _apply(in_main, x, kept, y), y
        self._note_skipped()

    def take(self, index: slice | torch.Tensor | list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``index`` of this view read here: ``(x [B, ...] float, y [B], [B, K] or None)``.

        For random access to a few rows (minibatches, reference statistics); rows found unreadable
        are dropped from both (under ``skip_unreadable``).
        """
        rows = self.rows[_as_rows(index, len(self))]
        x, kept, bad = self.source.load_many(rows)
        self._record(bad)
        labels = self.source.labels
        y = labels[kept] if self._labelled and labels is not None else None
        return _apply(self._transforms, x, kept, y), y

    def inputs(self, index: slice | torch.Tensor | list) -> torch.Tensor:
        """Float inputs ``[B, *input_shape]`` for rows ``index`` (see :meth:`take`)."""
        return self.take(index)[0]

    def channel_moments(self, rows: int = 5000, batch_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and (unbiased) std ``[C]`` per channel of images, or per column of flat inputs, over the
        first ``rows`` inputs, streamed in float64."""
        total = total_sq = None
        count = 0
        for xb, _ in self.subset(slice(0, rows)).batches(batch_size):
            xb = xb.double() if xb.dim() in (2, 4) else xb.double().flatten(1)
            dims = [0, 2, 3] if xb.dim() == 4 else [0]
            s, sq = xb.sum(dims), xb.pow(2).sum(dims)
            total = s if total is None else total + s
            total_sq = sq if total_sq is None else total_sq + sq
            count += xb.numel() // s.numel()
        if total is None:
            raise BayescliError(f"{self.spec} has no readable inputs")
        mean = total / count
        var = (total_sq - count * mean.pow(2)).clamp_min(0) / max(count - 1, 1)
        return mean, var.sqrt()

    # -- views --------------------------------------------------------------------------------

    def _view(self) -> Data:
        view = copy.copy(self)
        view.info = dict(self.info)
        view._live_cache = None
        return view

    def subset(self, index: slice | torch.Tensor | list, **info: object) -> Data:
        """The rows ``index`` as a new view (no pixels read), with ``info`` added to the provenance."""
        pick = _as_rows(index, len(self))
        view = self._view()
        view._rows, view._index = self.rows[pick], self.index[pick]
        view.info.update(info)
        return view

    def map_inputs(
        self,
        fn: Callable[..., torch.Tensor],
        *,
        seed: int | None = None,
        labels: bool = False,
        workers: bool = True,
        shape: tuple[int, ...] | None = None,
        shift: bool = True,
    ) -> Data:
        """A view whose inputs are ``fn(x)`` for each batch ``x [B, ...]`` (applied while iterating).

        ``seed``: ``fn(x, generator=g)`` gets a generator seeded by ``seed`` and the batch's first
        row (so the numbers depend on the batch size but not on the workers). ``labels``: ``fn``
        also gets ``y=``. ``workers=False`` runs ``fn`` in the main process (e.g. it uses a model).
        ``shape``: the new input shape (default: unchanged). ``fn`` must be picklable for workers
        started by ``spawn`` (a module-level function or a ``functools.partial`` of one). ``shift``:
        ``fn`` moves the inputs away from the data (see :attr:`shifted`); ``False`` for a change of
        representation such as the model's resize/crop recipe or a reshape.
        """
        view = self._view()
        view._shifted = self._shifted or shift
        view._transforms = (*self._transforms, _Transform(fn, seed, labels, workers))
        view._shape = tuple(shape) if shape is not None else self._shape
        return view

    def drop_labels(self, class_names: list[str] | None = None) -> Data:
        """A view without labels (optionally with other class names)."""
        view = self._view()
        view._labelled = False
        if class_names is not None:
            view.class_names = list(class_names)
        return view

    def with_source(self, source: Source, **info: object) -> Data:
        """The same rows, transforms and labels read from ``source`` (a shifted copy of the stored set)."""
        if len(source) != len(self.source):
            raise BayescliError(
                f"the replacement source has {len(source)} rows, {self.spec} {len(self.source)}"
            )
        source.labels = self.source.labels
        source.unreadable = self.source.unreadable
        view = self._view()
        view.source = source
        view._shifted = True
        view.info.update(info)
        return view

    def check_finite(self) -> None:
        """Raise if any stored float input of an in-memory set is NaN or infinite."""
        if isinstance(self.source, TensorSource) and self.source.x.is_floating_point():
            x = self.source.x[self.rows]
            if not torch.isfinite(x).all():
                bad = int((~torch.isfinite(x)).flatten(1).any(1).sum())
                raise BayescliError(f"{self.spec}: {bad} inputs contain NaN or inf; clean the data first")


class ArrayData(Data):
    """A set held in memory: ``x [N, ...]`` (uint8 pixels, or floats already in [0, 1] or tabular),
    labels ``y [N]``, ``[N, K]`` (multi-label 0/1) or ``None``, class names, provenance and
    optionally ``index``."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None,
        class_names: list[str],
        info: dict | None = None,
        index: torch.Tensor | None = None,
    ) -> None:
        if y is not None and len(y) != len(x):
            raise BayescliError(f"{len(x)} inputs but {len(y)} labels in {(info or {}).get('spec', 'data')}")
        super().__init__(TensorSource(x, y), class_names, info, index)
