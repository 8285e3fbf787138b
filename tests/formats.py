"""Writers for small files in the official on-disk formats of the torchvision datasets."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np


def write_idx(root: Path, folder: str, n_train: int = 30, n_test: int = 20, seed: int = 0) -> None:
    """MNIST-style idx files under ``root/folder/raw`` (uncompressed, big-endian headers)."""
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes()
        )
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + labels.tobytes())


def write_cifar_binary(root: Path, hundred: bool = False, per_file: int = 12, seed: int = 0) -> np.ndarray:
    """CIFAR binary version: records of label byte(s) + 3072 pixel bytes. Returns test pixels."""
    rng = np.random.default_rng(seed)
    folder = root / ("cifar-100-binary" if hundred else "cifar-10-batches-bin")
    folder.mkdir(parents=True, exist_ok=True)
    names = (
        ["train.bin", "test.bin"]
        if hundred
        else [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    )
    test_pixels = None
    for name in names:
        pixels = rng.integers(0, 256, size=(per_file, 3072), dtype=np.uint8)
        fine = (np.arange(per_file) % (100 if hundred else 10)).astype(np.uint8)
        labels = np.stack([fine // 5, fine], 1) if hundred else fine[:, None]
        (folder / name).write_bytes(np.concatenate([labels.astype(np.uint8), pixels], 1).tobytes())
        if name.startswith("test"):
            test_pixels = pixels
    if not hundred:
        (folder / "batches.meta.txt").write_text("\n".join(f"class{i}" for i in range(10)) + "\n")
    return test_pixels


def write_svhn(root: Path, n: int = 15, seed: int = 0) -> None:
    """SVHN ``{train,test}_32x32.mat`` with X [32,32,3,N] and labels 1..10 (10 = digit 0)."""
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
        y = (np.arange(n) % 10 + 1).reshape(-1, 1).astype(np.uint8)
        savemat(root / f"{split}_32x32.mat", {"X": x, "y": y})
