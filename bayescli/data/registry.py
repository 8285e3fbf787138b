"""``--data NAME[:split][[lo:hi]]``: parse a data spec and load it as a lazy :class:`Data` view.

Splits are deterministic: ``digits``, ``npz:``, ``imagefolder:`` and ``csv:`` are split 70/10/20
(train/val/test) by a seeded permutation; the torchvision sets keep their official test set
and hold out a seeded 10% of the official training set as ``val``. ``idx:DIR`` (any data in
MNIST's IDX format) has official splits when DIR holds both ``train-*`` and ``t10k-*`` files, and
is one source split 70/10/20 otherwise. Every split records its seed. A trailing index range
``[lo:hi]`` (Python slice syntax) keeps those rows of the split, e.g. ``mnist:test[:5000]``.
Splits, ranges and ``--limit`` are index maps over the stored set: no pixels are read to make them.

Multi-label sets (labels ``[N, K]`` 0/1):

* ``npz:FILE`` whose ``y`` is ``[N, K]``;
* ``csv:FILE.csv``: images listed in a CSV file, rows ``file,labels`` with the labels separated by
  ``;`` (``img001.png,cat;dog``; empty: no label), files relative to the CSV's folder
  (:func:`~bayescli.data.sources.image_list`);
* ``composed:BASE[:split]``: composites of 1–3 images of any single-label image spec ``BASE``
  side by side, labelled by the set of classes shown (:mod:`bayescli.data.composed`). ``BASE`` is
  read whole and split 70/10/20 by the split seed; composed split S is made only of base split S's
  images. A trailing ``:train``/``:val``/``:test`` is the composed split, whatever ``BASE`` is, so
  ``composed:mnist:test:train`` composes the training 70% of MNIST's test set, while
  ``composed:mnist:test`` is the composed test split of ``mnist`` (itself MNIST's test set); the
  name alone is the whole composed set, and ``[lo:hi]`` keeps rows of the composed split. The OOD
  counterpart of composed MNIST: ``composed:idx:NOTMNIST_DIR``. ``composed-digits[:split]`` is
  ``composed`` over all of scikit-learn's 8×8 digits (canvas ``1×8×24``; test split by default,
  like ``digits``).

Segmentation sets (masks ``[N, H, W]``): ``seg:FILE.npz[:split][[lo:hi]]`` reads ``x`` and ``mask``
(and ``anomaly``, ``class_names``) with :func:`~bayescli.data.segmentation.segmentation_npz`; the
name alone is the whole file, a split is the same seeded 70/10/20 partition as ``npz:``. They load
with :func:`load_segmentation` (not :func:`load_data`): a :class:`SegmentationData`, not a
:class:`Data`. ``digit-scenes[:split]`` needs no file: 32×32 scenes of 1–3 of scikit-learn's 8×8
digits (:func:`digit_scenes`); ``digit-scenes:anomaly`` adds letter glyphs as anomalies.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bayescli.data import sources
from bayescli.data.base import Data
from bayescli.data.composed import compose
from bayescli.data.scenes import compose_scenes
from bayescli.data.segmentation import IGNORE_INDEX, SegmentationData, segmentation_npz
from bayescli.errors import BayescliError
from bayescli.models.preprocess import Preprocess, warn_resize

SPLITS = ("train", "val", "test")
DEFAULT_SPLIT_SEED = 0
_FRACTIONS = {"train": (0.0, 0.7), "val": (0.7, 0.8), "test": (0.8, 1.0)}
_PATH_KINDS = ("npz", "imagefolder", "idx", "csv", "composed", "seg")
_PATH_EXAMPLES = {
    "npz": "batch.npz",
    "csv": "images/labels.csv",
    "composed": "mnist:test",
    "seg": "scenes.npz",
}
_ROWS = re.compile(r"^(?P<spec>.*)\[(?P<lo>-?\d*):(?P<hi>-?\d*)\]$")


@dataclass(frozen=True)
class DataSpec:
    """A parsed ``--data`` value."""

    name: str
    split: str | None = None
    path: str | None = None
    rows: tuple[int | None, int | None] | None = None

    @classmethod
    def parse(cls, text: str) -> DataSpec:
        ranged = _ROWS.match(text)
        if ranged:
            lo, hi = (int(v) if v else None for v in (ranged["lo"], ranged["hi"]))
            return replace(cls.parse(ranged["spec"]), rows=(lo, hi))
        if "[" in text or "]" in text:
            raise BayescliError(
                f"bad index range in '{text}'; use e.g. mnist:test[:5000] or npz:f.npz[100:200]"
            )
        kind, _, rest = text.partition(":")
        if kind in _PATH_KINDS:
            path, split = rest, None
            head, sep, tail = rest.rpartition(":")
            if sep and tail in SPLITS:
                path, split = head, tail
            if not path:
                raise BayescliError(f"'{text}' needs a path, e.g. {kind}:" + _PATH_EXAMPLES.get(kind, "DIR"))
            if kind == "composed":
                cls.parse(path)  # a bad base spec fails now, with its own message
            return cls(kind, split, path)
        if kind == "digit-scenes" and rest == "anomaly":
            return cls(kind, rest, None)
        if kind not in DATASETS:
            raise BayescliError(
                f"unknown dataset '{kind}'; choose one of "
                f"{', '.join(sorted(set(DATASETS) - set(_PATH_KINDS)))}, "
                "npz:PATH, idx:DIR, imagefolder:PATH, csv:FILE.csv, composed:SPEC or seg:FILE.npz"
            )
        if rest and rest not in SPLITS:
            raise BayescliError(f"unknown split '{rest}' in '{text}'; use one of {', '.join(SPLITS)}")
        return cls(kind, rest or None, None)

    def __str__(self) -> str:
        base = f"{self.name}:{self.path}" if self.path else self.name
        base = f"{base}:{self.split}" if self.split else base
        if self.rows is None:
            return base
        lo, hi = ("" if v is None else str(v) for v in self.rows)
        return f"{base}[{lo}:{hi}]"

    def with_split(self, split: str) -> DataSpec:
        """The same source's ``split``, all its rows."""
        return replace(self, split=split, rows=None)


def validation_spec(text: str) -> str:
    """The validation split of the source that ``text`` names (``npz:f.npz[:900]`` → ``npz:f.npz:val``)."""
    return str(DataSpec.parse(text).with_split("val"))


def _seeded_split(n: int, split: str, seed: int) -> torch.Tensor:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    lo, hi = _FRACTIONS[split]
    return perm[int(round(lo * n)) : int(round(hi * n))].sort().values


def _split_whole(data: Data, split: str | None, seed: int) -> Data:
    """70/10/20 seeded split of a source without official splits."""
    if split is None:
        return data.subset(torch.arange(len(data)), split="all")
    idx = _seeded_split(len(data), split, seed)
    return data.subset(
        idx, split=split, split_seed=seed, split_fractions={"train": 0.7, "val": 0.1, "test": 0.2}
    )


Loader = Callable[[Path, bool, bool], Data]  # (root, train, download) -> data


def _official(loader: Loader) -> Callable[[DataSpec, Path, bool, int, Preprocess], Data]:
    """Wrap a train/test loader: ``val`` is a seeded 10% of the official training set."""

    def load(spec: DataSpec, root: Path, download: bool, seed: int, pre: Preprocess) -> Data:
        split = spec.split or "test"
        if split == "test":
            full = loader(root, False, download)
            return full.subset(slice(None), split="test", source_size=len(full))
        full = loader(root, True, download)
        perm = torch.randperm(len(full), generator=torch.Generator().manual_seed(seed))
        n_val = len(full) // 10
        idx = (perm[:n_val] if split == "val" else perm[n_val:]).sort().values
        return full.subset(idx, split=split, split_seed=seed, val_fraction_of_train=0.1)

    return load


def _digits(spec: DataSpec, root: Path, download: bool, seed: int, pre: Preprocess) -> Data:
    return _split_whole(sources.digits(), spec.split or "test", seed)


def _npz(spec: DataSpec, root: Path, download: bool, seed: int, pre: Preprocess) -> Data:
    return _split_whole(sources.npz(Path(spec.path)), spec.split, seed)


def _idx(spec: DataSpec, root: Path, download: bool, seed: int, pre: Preprocess) -> Data:
    folder = Path(spec.path)
    if not folder.is_dir():
        raise BayescliError(f"idx folder not found: {folder}")
    found = {s: sources.idx_pair(folder, stem) for s, stem in sources.IDX_SPLIT_STEMS.items()}
    if all(found.values()):
        official = _official(lambda _root, train, _download: found["train" if train else "test"])
        return official(spec, root, download, seed, pre)
    for pattern in ("*-images-idx3-ubyte", "*-images-idx3-ubyte.gz"):
        images = sorted(folder.glob(pattern))
        if len(images) == 1:
            prefix = images[0].name.split("-images-")[0]
            return _split_whole(sources.idx_pair(folder, prefix), spec.split, seed)
    raise BayescliError(
        f"{folder} needs one PREFIX-images-idx3-ubyte[.gz] file (with PREFIX-labels-idx1-ubyte[.gz]), "
        "or train-* and t10k-* pairs"
    )


def _imagefolder(spec: DataSpec, root: Path, download: bool, seed: int, pre: Preprocess) -> Data:
    return _split_whole(sources.imagefolder(Path(spec.path), pre), spec.split, seed)


def _csv(spec: DataSpec, root: Path, download: bool, seed: int, pre: Preprocess) -> Data:
    return _split_whole(sources.image_list(Path(spec.path), pre), spec.split, seed)


def _composed_split(base: Data, split: str | None, seed: int) -> Data:
    """Compose ``base`` group by group (its seeded 70/10/20 partition) and take composed ``split``."""
    groups = [_seeded_split(len(base), s, seed) for s in SPLITS]
    return _split_whole(compose(base, groups, seed), split, seed)


def _composed(spec: DataSpec, root: Path, download: bool, seed: int, pre: Preprocess) -> Data:
    # the base is read in pixel space: the model's preprocessing applies to the whole canvas
    base = load_data(spec.path, root=root, download=download, split_seed=seed)
    return _composed_split(base, spec.split, seed)


def _composed_digits(spec: DataSpec, root: Path, download: bool, seed: int, pre: Preprocess) -> Data:
    base = sources.digits()
    base.info["spec"] = "digits (all 1797)"
    return _composed_split(base, spec.split or "test", seed)


def _seg(spec: DataSpec, root: Path, download: bool, seed: int, pre: Preprocess) -> Data:
    raise BayescliError(
        f"{spec} is segmentation data (per-pixel masks); it serves segmentation models in train, "
        "inspect, fit-laplace and evaluate"
    )


DATASETS: dict[str, Callable[[DataSpec, Path, bool, int, Preprocess], Data]] = {
    "digits": _digits,
    "mnist": _official(sources.mnist_family("mnist")),
    "fashion-mnist": _official(sources.mnist_family("fashion-mnist")),
    "kmnist": _official(sources.mnist_family("kmnist")),
    "cifar10": _official(sources.cifar10),
    "cifar100": _official(sources.cifar100),
    "svhn": _official(sources.svhn),
    "npz": _npz,
    "idx": _idx,
    "imagefolder": _imagefolder,
    "csv": _csv,
    "composed": _composed,
    "composed-digits": _composed_digits,
    "seg": _seg,
    "digit-scenes": _seg,
}
SEGMENTATION = ("seg", "digit-scenes")

# digit-scenes: scenes per split (train/val/test are made of that split's digits; the anomaly scenes
# of the test digits), each split's own composition seed, canvas and digits per scene.
DIGIT_SCENES = {"train": 600, "val": 100, "test": 150, "anomaly": 150}
_SCENE_SEEDS = {"train": 0, "val": 1, "test": 2, "anomaly": 3}
SCENE_CANVAS = (24, 24)
SCENE_OBJECTS = (2, 4)
# Letter-like glyphs on the digits' 8×8 grid, the anomalies of digit-scenes:anomaly: A, E, F, H,
# K, L, T, X, shapes no digit class has (scikit-learn's digits have no letters).
_GLYPHS = {
    "A": ["..####..", ".##..##.", "##....##", "##....##", "########", "##....##", "##....##", "##....##"],
    "E": ["########", "##......", "##......", "######..", "######..", "##......", "##......", "########"],
    "F": ["########", "##......", "##......", "######..", "######..", "##......", "##......", "##......"],
    "H": ["##....##", "##....##", "##....##", "########", "########", "##....##", "##....##", "##....##"],
    "K": ["##...##.", "##..##..", "##.##...", "####....", "####....", "##.##...", "##..##..", "##...##."],
    "L": ["##......", "##......", "##......", "##......", "##......", "##......", "########", "########"],
    "T": ["########", "########", "...##...", "...##...", "...##...", "...##...", "...##...", "...##..."],
    "X": ["##....##", ".##..##.", "..####..", "...##...", "...##...", "..####..", ".##..##.", "##....##"],
}


def letter_glyphs() -> torch.Tensor:
    """``[8, 8, 8]`` float in {0, 1}: the letters A E F H K L T X drawn on an 8×8 grid."""
    rows = [[[c == "#" for c in line] for line in glyph] for glyph in _GLYPHS.values()]
    return torch.tensor(rows, dtype=torch.float32)


def digit_scenes(
    split: str, split_seed: int = DEFAULT_SPLIT_SEED, ignore_index: int = IGNORE_INDEX
) -> SegmentationData:
    """``digit-scenes:SPLIT``: :data:`DIGIT_SCENES` ``[SPLIT]`` scenes ``x [N, 1, 32, 32]`` float in
    [0, 1] with masks ``[N, 32, 32]`` (0 background, ``d + 1`` on digit ``d``'s pixels, K = 11),
    composed (:func:`~bayescli.data.scenes.compose_scenes`) from the digits of scikit-learn's
    seeded 70/10/20 split ``SPLIT`` (``anomaly``: of ``test``), so no digit image is in two splits.
    ``anomaly`` pastes one letter glyph (:func:`letter_glyphs`) per scene beside the digits: its
    pixels are ``ignore_index`` in the mask and 1 in ``anomaly``. Deterministic given ``split_seed``."""
    base = sources.digits()
    rows = _seeded_split(len(base), "test" if split == "anomaly" else split, split_seed)
    letters = letter_glyphs() if split == "anomaly" else None
    scenes = compose_scenes(
        base.x[rows, 0],
        base.y[rows],
        DIGIT_SCENES[split],
        seed=split_seed * len(_SCENE_SEEDS) + _SCENE_SEEDS[split],
        canvas=SCENE_CANVAS,
        objects=SCENE_OBJECTS,
        anomalies=letters,
        ignore_index=ignore_index,
    )
    info = {"source": "digit scenes of sklearn.datasets.load_digits", "digits_split": split}
    if letters is not None:
        info |= {"digits_split": "test", "anomalies": "letter glyphs A E F H K L T X"}
    return SegmentationData(
        scenes.x[:, None], scenes.mask, scenes.class_names, ignore_index, info, scenes.anomaly
    )


def is_segmentation(spec: str | None) -> bool:
    """Whether the data spec ``spec`` names segmentation data (``seg:FILE.npz…``, ``digit-scenes…``)."""
    return spec is not None and DataSpec.parse(spec).name in SEGMENTATION


def load_segmentation(
    spec: str | DataSpec,
    ignore_index: int | None = IGNORE_INDEX,
    limit: int | None = None,
    seed: int = 0,
    split_seed: int = DEFAULT_SPLIT_SEED,
) -> SegmentationData:
    """Load ``seg:FILE.npz[:split][[lo:hi]]`` or ``digit-scenes[:split][[lo:hi]]`` as
    :class:`SegmentationData`: the split (``seg:`` seeded 70/10/20, as ``npz:``; ``digit-scenes``
    composed per split, :func:`digit_scenes`, ``test`` by default), then the row range, then
    ``limit`` seeded random images (``seed``). ``info`` records the spec and each step."""
    parsed = spec if isinstance(spec, DataSpec) else DataSpec.parse(spec)
    if parsed.name not in SEGMENTATION:
        raise BayescliError(
            f"{parsed} is not segmentation data; use seg:FILE.npz (arrays x and mask) or digit-scenes"
        )
    if parsed.name == "digit-scenes":
        split = parsed.split or "test"
        if split == "anomaly" and ignore_index is None:
            raise BayescliError(
                f"{parsed} marks its letters' pixels with the ignore index; keep one (--ignore-index ≥ 0)"
            )
        data = digit_scenes(split, split_seed, IGNORE_INDEX if ignore_index is None else ignore_index)
        info = {"spec": str(parsed), **data.info, "ignore_index": ignore_index, "split": split}
        info |= {"split_seed": split_seed}
    else:
        data = segmentation_npz(Path(parsed.path), ignore_index)
        info = {"spec": str(parsed), **data.info, "ignore_index": ignore_index}
    if parsed.split is not None and parsed.name == "seg":
        data = data.subset(_seeded_split(len(data), parsed.split, split_seed))
        info |= {"split": parsed.split, "split_seed": split_seed}
    if parsed.rows is not None:
        info |= {"rows": list(parsed.rows), "rows_of": len(data)}
        data = data.subset(slice(*parsed.rows))
    if limit is not None:
        if limit <= 0:
            raise BayescliError(f"--limit must be positive, got {limit}")
        if limit < len(data):
            idx = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:limit]
            data = data.subset(idx.sort().values)
            info |= {"limit": limit, "limit_seed": seed}
    if len(data) == 0:
        raise BayescliError(f"{parsed} is empty")
    data.info = info
    return data


def load_data(
    spec: str | DataSpec,
    root: str | Path = "data",
    download: bool = False,
    limit: int | None = None,
    seed: int = 0,
    split_seed: int = DEFAULT_SPLIT_SEED,
    preprocess: Preprocess | None = None,
    num_workers: int = 0,
    skip_unreadable: bool = False,
) -> Data:
    """Load ``spec`` (e.g. ``digits:test``, ``cifar10:train``, ``npz:batch.npz``) as a lazy view.

    ``limit`` keeps a seeded random subset of that many rows (``seed``); ``split_seed`` fixes the
    train/val/test partition; ``preprocess`` resizes and centre-crops the images in pixel space,
    image by image while iterating (image folders at their own sizes). ``num_workers`` is the
    number of ``DataLoader`` processes that read and decode; ``skip_unreadable`` skips image files
    that cannot be decoded (recorded in ``info["unreadable"]``) instead of stopping. Non-finite
    in-memory inputs raise :class:`BayescliError`.
    """
    if num_workers < 0:
        raise BayescliError(f"--num-workers must be 0 or more, got {num_workers}")
    parsed = spec if isinstance(spec, DataSpec) else DataSpec.parse(spec)
    pre = preprocess or Preprocess()
    data = DATASETS[parsed.name](parsed, Path(root), download, split_seed, pre)
    data.info = {"spec": str(parsed), **data.info}
    data.num_workers, data.skip_unreadable = num_workers, skip_unreadable
    if parsed.rows is not None:
        lo, hi = parsed.rows
        data = data.subset(slice(lo, hi), rows=[lo, hi], rows_of=len(data))
    if limit is not None:
        if limit <= 0:
            raise BayescliError(f"--limit must be positive, got {limit}")
        if limit < len(data):
            gen = torch.Generator().manual_seed(seed)
            idx = torch.randperm(len(data), generator=gen)[:limit].sort().values
            data = data.subset(idx, limit=limit, limit_seed=seed)
    if pre.changes_pixels and not data.info.get("preprocessed"):
        warn_resize(pre, data.input_shape)
        data = data.map_inputs(pre.pixels, shape=pre.output_shape(data.input_shape), shift=False)
    data.check_finite()
    if len(data) == 0:
        raise BayescliError(f"{parsed} is empty")
    return data
