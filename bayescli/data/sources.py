"""Readers for each data source, returning a :class:`~bayescli.data.base.Data` per stored split.

Small sets are held in memory as uint8 (digits, ``.npz``, IDX, SVHN's ``.mat`` whose variables are
compressed, CIFAR's pickled python version); CIFAR's binary version is memory-mapped record by
record and image folders are decoded file by file, so neither is ever loaded whole. Each split is
read from its own files: a root holding only the test files serves ``:test``.

torchvision does the downloading (``--download``); reading is done here where torchvision would
insist on checksums of the files (CIFAR, SVHN) so that files in the official formats load
whatever their origin. CIFAR's pickled "python version" is unpickled only after its MD5 matches
the official release; the binary version needs no unpickling at all.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bayescli.data.base import ArrayData, Data, Source, UnreadableItem
from bayescli.errors import BayescliError
from bayescli.models.preprocess import Preprocess, warn_resize


def _missing(name: str, root: Path, expected: str) -> BayescliError:
    return BayescliError(
        f"{name} not found under {root} (looked for {expected}); pass --data-root DIR, "
        "or --download to fetch it"
    )


def digits() -> ArrayData:
    """scikit-learn's bundled 8×8 digits: ``[1797, 1, 8, 8]`` float in [0, 1] (values/16)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    return ArrayData(x, y, [str(i) for i in range(10)], {"source": "sklearn.datasets.load_digits"})


def npz(path: Path) -> ArrayData:
    """Arrays ``x`` (``[N, ...]``; uint8 pixels or floats), optional ``y`` and ``class_names``.

    ``y`` is ``[N]`` integer class indices, or ``[N, K]`` multi-label indicators (any numeric
    dtype or bool, every value exactly 0 or 1; ``class_names``, if given, has one entry per
    column), read as int64. Float images must lie in [0, 1] (:func:`check_pixel_range`) and images
    be channels-first (:func:`check_layout`).
    """
    if not path.is_file():
        raise BayescliError(f"npz file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as f:
            if "x" not in f.files:
                raise BayescliError(f"{path} has no array 'x' (found: {', '.join(f.files) or 'none'})")
            x_np, y_np = f["x"], (f["y"] if "y" in f.files else None)
            names = [str(s) for s in f["class_names"]] if "class_names" in f.files else None
    except (ValueError, OSError) as exc:
        raise BayescliError(f"cannot read {path} as .npz ({exc}); save with numpy.savez") from None
    check_layout(x_np, path)
    if x_np.dtype != np.uint8:
        x_np = x_np.astype(np.float32)
        check_pixel_range(x_np, path)
    x = torch.from_numpy(np.ascontiguousarray(x_np))
    y = None
    if y_np is not None:
        if y_np.ndim not in (1, 2) or len(y_np) != len(x_np):
            raise BayescliError(
                f"{path}: 'y' must be [N] class indices or [N, K] 0/1 labels with N={len(x_np)}, "
                f"got {list(y_np.shape)}"
            )
        if y_np.ndim == 2:
            y, names = _multi_hot(y_np, names, path)
            return ArrayData(x, y, names, {"source": str(path)})
        if not np.issubdtype(y_np.dtype, np.integer):
            raise BayescliError(f"{path}: 'y' must hold integer class indices, got {y_np.dtype}")
        y = torch.from_numpy(y_np.astype(np.int64))
    k = int(y.max()) + 1 if y is not None and len(y) else 0
    return ArrayData(x, y, names or [str(i) for i in range(k)], {"source": str(path)})


# Float pixels are read as [0, 1]; above this the array holds another scale (0–255 most often).
# The slack over 1 leaves room for resampling overshoot in images saved after a resize.
MAX_FLOAT_PIXEL = 1.5


def check_layout(x_np: np.ndarray, path: Path) -> None:
    """Refuse channels-last images ``[N, H, W, C]`` (numpy/PIL/TensorFlow order): bayescli reads
    ``[N, C, H, W]``, and a transposed array would otherwise fail later as a shape mismatch."""
    channels = (1, 3, 4)
    if x_np.ndim == 4 and x_np.shape[-1] in channels and x_np.shape[1] not in channels:
        n, h, w, c = x_np.shape
        raise BayescliError(
            f"{path}: 'x' is channels-last [N, H, W, C] = [{n}, {h}, {w}, {c}]; bayescli reads images "
            "as [N, C, H, W]: save x.transpose(0, 3, 1, 2)"
        )


def check_pixel_range(x_np: np.ndarray, path: Path) -> None:
    """Refuse float images (``x [N, C, H, W]`` or ``[N, H, W]``) with values above
    :data:`MAX_FLOAT_PIXEL`: float pixels are read as [0, 1], and 0–255 floats used as such give
    a net inputs 255× too bright while the accuracy only drops a little (nothing would say so).
    Tabular ``[N, D]`` inputs have no pixel scale and pass."""
    if x_np.ndim < 3 or not x_np.size:
        return
    finite = x_np[np.isfinite(x_np)]  # NaN/inf are refused by the caller's finiteness check
    if finite.size and float(finite.max()) > MAX_FLOAT_PIXEL:
        lo, hi = float(finite.min()), float(finite.max())
        raise BayescliError(
            f"{path}: float images 'x' hold values in [{lo:g}, {hi:g}], but float pixels are read in "
            "[0, 1]: save x / 255 (0–255 pixels) or x.astype(numpy.uint8); for normalised inputs save "
            "the [0, 1] pixels and pass --mean/--std"
        )


def _multi_hot(y_np: np.ndarray, names: list[str] | None, path: Path) -> tuple[torch.Tensor, list[str]]:
    """Multi-label ``y [N, K]`` of an npz file as int64 and its class names, after checking the
    dtype, the values and the names.

    Checked here (not only by :class:`Data`) so that the messages name the array and file. Class
    names default to the column numbers.
    """
    if not (np.issubdtype(y_np.dtype, np.number) or y_np.dtype == np.bool_):
        raise BayescliError(f"{path}: multi-label 'y' [N, K] must hold numbers 0/1, got {y_np.dtype}")
    # any numeric dtype, as long as every value is exactly 0 or 1 (float 0./1. is what
    # BCEWithLogitsLoss takes); soft or smoothed targets are not labels
    bad = (y_np != 0) & (y_np != 1)
    if bad.any():
        values = np.unique(y_np[bad])
        shown = ", ".join(f"{v:g}" if np.isfinite(v) else str(v) for v in values[:5].tolist())
        more = f" and {len(values) - 5} more" if len(values) > 5 else ""
        cells = int(bad.sum())
        raise BayescliError(
            f"{path}: multi-label 'y' [N, K] must hold only 0 and 1; found {shown}{more} "
            f"in {cells} cell{'s' if cells != 1 else ''} ({y_np.dtype})"
        )
    if names is not None and len(names) != y_np.shape[1]:
        raise BayescliError(
            f"{path}: 'class_names' has {len(names)} entries but 'y' has {y_np.shape[1]} label columns"
        )
    labels = torch.from_numpy(y_np.astype(np.int64))
    return labels, names if names is not None else [str(i) for i in range(y_np.shape[1])]


def decode_image(path: str) -> torch.Tensor:
    """The RGB pixels ``[3, H, W]`` uint8 of an image file; raises :class:`UnreadableItem` if it cannot."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            arr = np.array(im.convert("RGB"))
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        raise UnreadableItem(path, str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    return torch.from_numpy(arr).permute(2, 0, 1)


def _header_size(paths: list[str]) -> tuple[int, int]:
    """``(H, W)`` of the first image whose header can be read (no pixels are decoded)."""
    from PIL import Image

    for path in paths:
        try:
            with Image.open(path) as im:
                return im.size[1], im.size[0]
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError):
            continue
    raise BayescliError(f"none of the {len(paths)} images under {Path(paths[0]).parent.parent} can be read")


class ImageFolderSource(Source):
    """Image files decoded on demand (in the ``DataLoader`` workers), each resized and cropped by
    ``pre`` at its own size and then, if its size still differs, resized to ``size``."""

    def __init__(self, paths: list[str], labels: torch.Tensor, size: tuple[int, int], pre: Preprocess | None):
        super().__init__()
        self.paths, self.labels, self.pre = paths, labels, pre
        self.size = (int(size[0]), int(size[1]))
        self.shape = (3, *self.size)

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, row: int) -> torch.Tensor:
        from torchvision.transforms.v2.functional import resize

        t = decode_image(self.paths[row]).float().div_(255.0)
        if self.pre is not None:
            t = self.pre.pixels(t[None])[0]
        if tuple(t.shape[1:]) != self.size:
            t = resize(t, list(self.size), antialias=True).clamp_(0.0, 1.0)
        return t


def imagefolder(path: Path, pre: Preprocess | None = None) -> Data:
    """A torchvision ``ImageFolder`` tree (``root/class/img.png``), listed now and decoded lazily.

    Files are sorted within sorted class folders. With a preprocess that resizes/crops, each image
    is resized and cropped at its own size (aspect ratio kept); without one, images are resized to
    the first image's size (read from its header).
    """
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    if not path.is_dir():
        raise BayescliError(f"image folder not found: {path}")
    try:
        classes, class_to_idx = find_classes(str(path))
        samples = make_dataset(str(path), class_to_idx, extensions=IMG_EXTENSIONS)
    except (FileNotFoundError, RuntimeError) as exc:
        raise BayescliError(f"{path}: {exc}") from None
    paths = [p for p, _ in samples]
    labels = torch.tensor([c for _, c in samples], dtype=torch.int64)
    return _image_files(paths, labels, list(classes), str(path), pre)


def _image_files(
    paths: list[str], labels: torch.Tensor, classes: list[str], source: str, pre: Preprocess | None
) -> Data:
    """Image files ``paths`` with ``labels`` (``[N]`` or ``[N, K]``) as a lazily decoded :class:`Data`."""
    pre = pre if pre is not None and pre.changes_pixels else None
    size = _header_size(paths)
    if pre is not None:
        # photos are routinely larger than a model's input: only upsampling (judged on the first
        # image) is suspicious here; the warning points at the caller of load_data
        warn_resize(pre, (3, *size), downsampling=False, stacklevel=6)
        size = tuple(pre.pixels(torch.zeros(1, 1, *size)).shape[-2:])
    info: dict = {"source": source, "image_size": list(size)}
    if pre is not None:
        info["preprocessed"] = True
    return Data(ImageFolderSource(paths, labels, size, pre), classes, info)


LABEL_SEPARATOR = ";"


def image_list(path: Path, pre: Preprocess | None = None) -> Data:
    """Multi-label images listed in a CSV file: rows ``file,labels`` (``img001.png,cat;dog``).

    ``file`` is relative to the CSV's folder (or absolute); ``labels`` separates class names with
    ``;`` and may be empty (an image of none of the classes: all zeros). Class names are the sorted
    union of the labels, so ``y`` is ``[N, K]`` 0/1 in that column order. An optional first row
    ``file,labels`` is a header. Names may not contain whitespace, ``,`` or ``|`` (such a name is
    taken for a list with the wrong separator). Images are decoded lazily, as :func:`imagefolder`.
    """
    import csv

    if not path.is_file():
        raise BayescliError(f"label file not found: {path}")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise BayescliError(f"cannot read {path} as CSV ({exc})") from None
    listed: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for number, row in enumerate(rows, start=1):
        if not row or not "".join(row).strip():
            continue
        if number == 1 and [c.strip().lower() for c in row] == ["file", "labels"]:
            continue
        if len(row) != 2:
            raise BayescliError(
                f"{path} row {number}: expected 2 fields 'file,labels', found {len(row)}; "
                f"separate labels with '{LABEL_SEPARATOR}' (img001.png,cat;dog)"
            )
        name, text = row[0].strip(), row[1]
        file = path.parent / name
        if not file.is_file():
            raise BayescliError(f"{path} row {number}: image not found: {file}")
        if str(file) in seen:
            raise BayescliError(f"{path} row {number}: {name} is listed twice")
        seen.add(str(file))
        labels = [t.strip() for t in text.split(LABEL_SEPARATOR)]
        if text.strip() and not all(labels):
            raise BayescliError(f"{path} row {number}: empty label in '{text}'")
        odd = [t for t in labels if any(ch.isspace() or ch in ",|" for ch in t)]
        if odd:
            raise BayescliError(
                f"{path} row {number}: label '{odd[0]}' contains a separator other than "
                f"'{LABEL_SEPARATOR}'; write e.g. img001.png,cat;dog"
            )
        listed.append((str(file), [t for t in labels if t]))
    if not listed:
        raise BayescliError(f"{path} lists no images")
    classes = sorted({t for _, labels in listed for t in labels})
    if not classes:
        raise BayescliError(f"{path}: no image has a label; give at least one class")
    column = {c: i for i, c in enumerate(classes)}
    y = torch.zeros(len(listed), len(classes), dtype=torch.int64)
    for i, (_, labels) in enumerate(listed):
        y[i, [column[t] for t in labels]] = 1
    return _image_files([f for f, _ in listed], y, classes, str(path), pre)


_MNIST_CLASSES = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "kmnist": "KMNIST"}


_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
IDX_SPLIT_STEMS = {"train": "train", "test": "t10k"}


def read_idx(path: Path) -> np.ndarray:
    """An array in the IDX format of MNIST (``.gz`` or plain): magic ``0 0 dtype ndim``, big-endian dims."""
    import gzip

    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise BayescliError(f"cannot read {path} ({exc}); the file may be truncated") from None
    if len(raw) < 4 or raw[0] or raw[1] or raw[2] not in _IDX_DTYPES:
        raise BayescliError(f"{path} is not an IDX file (bad magic number)")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    offset = 4 + 4 * ndim
    count = int(np.prod(dims)) if dims else 0
    if len(raw) - offset != count * dtype.itemsize:
        have, want = len(raw) - offset, count * dtype.itemsize
        raise BayescliError(f"{path} holds {have} data bytes, its header says {want}; it is truncated")
    return np.frombuffer(raw, dtype, count, offset).reshape(dims).astype(dtype.newbyteorder("="))


def _idx_file(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def idx_pair(folder: Path, prefix: str) -> ArrayData | None:
    """``{prefix}-images-idx3-ubyte[.gz]`` and optional ``{prefix}-labels-idx1-ubyte[.gz]`` in ``folder``."""
    images = _idx_file(folder, f"{prefix}-images-idx3-ubyte")
    if images is None:
        return None
    x = torch.from_numpy(read_idx(images).copy())
    if x.dim() != 3 or x.dtype != torch.uint8:
        raise BayescliError(f"{images} must hold uint8 images [N, H, W], got {x.dtype} {list(x.shape)}")
    labels = _idx_file(folder, f"{prefix}-labels-idx1-ubyte")
    y = torch.from_numpy(read_idx(labels).astype(np.int64)) if labels else None
    if y is not None and len(y) != len(x):
        raise BayescliError(f"{labels} has {len(y)} labels for {len(x)} images in {images}")
    k = int(y.max()) + 1 if y is not None and len(y) else 0
    return ArrayData(x.unsqueeze(1), y, [str(i) for i in range(k)], {"source": str(images)})


def mnist_family(name: str) -> Callable[[Path, bool, bool], ArrayData]:
    """MNIST, Fashion-MNIST or KMNIST from IDX files under ``ROOT/CLASS/raw`` (torchvision's layout).

    Read here, split by split, so a root holding only the test files serves ``:test`` (torchvision
    insists on both); ``--download`` lets torchvision fetch missing files first.
    """

    def load(root: Path, train: bool, download: bool) -> ArrayData:
        import torchvision.datasets as tvd

        cls = getattr(tvd, _MNIST_CLASSES[name])
        folder = root / cls.__name__ / "raw"
        prefix = IDX_SPLIT_STEMS["train" if train else "test"]
        data = idx_pair(folder, prefix)
        if data is None and download:
            try:
                cls(str(root), train=train, download=True)
            except (RuntimeError, OSError) as exc:
                raise BayescliError(f"{name}: download failed ({exc})") from None
            data = idx_pair(folder, prefix)
        if data is None:
            raise _missing(name, root, f"{folder}/{prefix}-images-idx3-ubyte[.gz]")
        if data.y is None:
            raise BayescliError(f"{name}: {folder} lacks {prefix}-labels-idx1-ubyte[.gz]")
        data.class_names = [str(c) for c in cls.classes]
        data.info["source"] = f"{cls.__name__} IDX files in {folder}"
        return data

    return load


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


class CifarBinarySource(Source):
    """CIFAR binary records (label byte(s) + 3072 pixel bytes), memory-mapped: rows are read on demand."""

    shape = (3, 32, 32)

    def __init__(self, files: list[Path], label_bytes: int) -> None:
        super().__init__()
        self.files, self.label_bytes, self.record = [str(f) for f in files], label_bytes, label_bytes + 3072
        sizes = [f.stat().st_size for f in files]
        if any(size % self.record for size in sizes):
            raise BayescliError(f"{files[0].parent} holds truncated CIFAR binary files; re-download them")
        self.ends = np.cumsum([size // self.record for size in sizes])
        self._maps: list[np.ndarray] | None = None
        # fine label = the last label byte; reading this column pages the files through once
        self.labels = torch.from_numpy(
            np.concatenate([m[:, label_bytes - 1].astype(np.int64) for m in self._mapped()])
        )

    def _mapped(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [np.memmap(f, np.uint8, "r").reshape(-1, self.record) for f in self.files]
        return self._maps

    def __getstate__(self) -> dict:  # workers started by spawn map the files themselves
        return {**self.__dict__, "_maps": None}

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def load_many(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
        r = rows.numpy()
        which = np.searchsorted(self.ends, r, side="right")
        starts = np.concatenate([[0], self.ends[:-1]])
        out = np.empty((len(r), 3072), np.uint8)
        for f in np.unique(which):
            sel = which == f
            out[sel] = self._mapped()[f][r[sel] - starts[f], self.label_bytes :]
        return torch.from_numpy(out).reshape(-1, 3, 32, 32).float().div_(255.0), rows, []


def _read_cifar_python(
    files: list[tuple[str, str]], folder: Path, label_key: str
) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for fname, md5 in files:
        p = folder / fname
        if _md5(p) != md5:
            raise BayescliError(
                f"{p} does not match the official CIFAR release (MD5); refusing to unpickle it. "
                "Re-download with --download or use the binary version"
            )
        with open(p, "rb") as f:
            entry = pickle.load(f, encoding="latin1")  # official file, checksum verified above
        xs.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(entry[label_key], dtype=np.int64))
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


def _cifar(root: Path, train: bool, download: bool, hundred: bool) -> Data:
    import torchvision.datasets as tvd

    name = "cifar100" if hundred else "cifar10"
    cls = tvd.CIFAR100 if hundred else tvd.CIFAR10
    bin_dir = root / ("cifar-100-binary" if hundred else "cifar-10-batches-bin")
    py_dir = root / cls.base_folder
    if hundred:
        bin_files = [bin_dir / ("train.bin" if train else "test.bin")]
        names_file = bin_dir / "fine_label_names.txt"
    else:
        bin_files = (
            [bin_dir / f"data_batch_{i}.bin" for i in range(1, 6)] if train else [bin_dir / "test_batch.bin"]
        )
        names_file = bin_dir / "batches.meta.txt"
    if all(f.is_file() for f in bin_files):
        names = (
            names_file.read_text().split()
            if names_file.is_file()
            else [str(i) for i in range(100 if hundred else 10)]
        )
        return Data(
            CifarBinarySource(bin_files, 2 if hundred else 1),
            names,
            {"source": f"{bin_dir} (binary version)"},
        )
    files = cls.train_list if train else cls.test_list
    if download and not all((py_dir / f).is_file() for f, _ in files):
        cls(str(root), train=train, download=True)
    if not all((py_dir / f).is_file() for f, _ in files):
        split_files = ", ".join(f.name for f in bin_files)
        raise _missing(name, root, f"{bin_dir.name}/{{{split_files}}} or {py_dir.name}/")
    # the pickled version cannot be read record by record: this split is held in memory (uint8)
    x, y = _read_cifar_python(files, py_dir, "fine_labels" if hundred else "labels")
    meta = py_dir / cls.meta["filename"]
    names = [str(i) for i in range(100 if hundred else 10)]
    if meta.is_file() and _md5(meta) == cls.meta["md5"]:
        with open(meta, "rb") as f:
            names = list(pickle.load(f, encoding="latin1")[cls.meta["key"]])  # verified above
    return ArrayData(x, y, names, {"source": f"{py_dir} (python version, MD5 verified)"})


def cifar10(root: Path, train: bool, download: bool) -> Data:
    """CIFAR-10: ``[N, 3, 32, 32]`` uint8 from the binary or (checksum-verified) python version."""
    return _cifar(root, train, download, hundred=False)


def cifar100(root: Path, train: bool, download: bool) -> Data:
    """CIFAR-100 (fine labels), as :func:`cifar10`."""
    return _cifar(root, train, download, hundred=True)


def svhn(root: Path, train: bool, download: bool) -> ArrayData:
    """SVHN cropped digits from ``{train,test}_32x32.mat`` (label 10 means digit 0)."""
    from scipy.io import loadmat

    split = "train" if train else "test"
    path = root / f"{split}_32x32.mat"
    if not path.is_file() and download:
        import torchvision.datasets as tvd

        tvd.SVHN(str(root), split=split, download=True)
    if not path.is_file():
        raise _missing("svhn", root, path.name)
    try:
        mat = loadmat(str(path))
    except (ValueError, OSError) as exc:
        raise BayescliError(f"cannot read {path} ({exc}); re-download it") from None
    x = torch.from_numpy(np.ascontiguousarray(mat["X"].transpose(3, 2, 0, 1)))
    y = torch.from_numpy(mat["y"].astype(np.int64).reshape(-1) % 10)
    return ArrayData(x, y, [str(i) for i in range(10)], {"source": str(path)})
