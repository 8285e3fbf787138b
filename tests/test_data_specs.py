"""IDX files (MNIST's format) read split by split, ``idx:`` specs, index ranges, validation specs."""

import gzip
import struct

import numpy as np
import pytest
import torch

from bayescli.data import DataSpec, load_data, validation_spec
from bayescli.data.sources import read_idx
from bayescli.errors import BayescliError


def write_idx(path, array: np.ndarray, gz: bool = True) -> None:
    """The official IDX layout: magic 0 0 0x08 ndim, big-endian int32 dims, then the bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def make_pair(folder, prefix: str, n: int, seed: int, gz: bool = True):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, n, dtype=np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / f"{prefix}-images-idx3-ubyte", x, gz)
    write_idx(folder / f"{prefix}-labels-idx1-ubyte", y, gz)
    return x, y


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_round_trip(tmp_path, gz):
    x, _ = make_pair(tmp_path, "t10k", 7, 0, gz)
    name = "t10k-images-idx3-ubyte" + (".gz" if gz else "")
    assert np.array_equal(read_idx(tmp_path / name), x)


def test_read_idx_refuses_truncated_and_foreign_files(tmp_path):
    make_pair(tmp_path, "t10k", 5, 0, gz=False)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(BayescliError, match="truncated"):
        read_idx(path)
    path.write_bytes(b"\x89PNG\r\n")
    with pytest.raises(BayescliError, match="not an IDX file"):
        read_idx(path)


def test_mnist_root_with_only_the_test_files(tmp_path):
    x, y = make_pair(tmp_path / "MNIST" / "raw", "t10k", 30, 1)
    data = load_data("mnist:test", root=tmp_path)
    assert torch.equal(data.x[:, 0], torch.from_numpy(x)) and torch.equal(data.y, torch.from_numpy(y).long())
    assert data.class_names[0] == "0 - zero"
    with pytest.raises(BayescliError, match="train-images-idx3-ubyte"):
        load_data("mnist:train", root=tmp_path)


def test_idx_spec_single_source_and_official_splits(tmp_path):
    x, y = make_pair(tmp_path / "letters", "t10k", 50, 2)
    whole = load_data(f"idx:{tmp_path / 'letters'}")
    assert len(whole) == 50 and torch.equal(whole.y, torch.from_numpy(y).long())
    parts = [load_data(f"idx:{tmp_path / 'letters'}:{s}") for s in ("train", "val", "test")]
    assert [len(p) for p in parts] == [35, 5, 10]
    assert sorted(torch.cat([p.index for p in parts]).tolist()) == list(range(50))

    make_pair(tmp_path / "both", "train", 40, 3)
    xt, _ = make_pair(tmp_path / "both", "t10k", 12, 4)
    test = load_data(f"idx:{tmp_path / 'both'}:test")
    assert torch.equal(test.x[:, 0], torch.from_numpy(xt))
    assert len(load_data(f"idx:{tmp_path / 'both'}:val")) == 4


def test_index_ranges_slice_the_split(tmp_path):
    full = load_data("digits:test")
    for text, sl in [("[:100]", slice(None, 100)), ("[100:]", slice(100, None)), ("[-7:-2]", slice(-7, -2))]:
        part = load_data("digits:test" + text)
        assert torch.equal(part.x, full.x[sl]) and part.spec == "digits:test" + text
        assert part.info["rows_of"] == len(full)
    np.savez(tmp_path / "f.npz", x=np.zeros((20, 3), np.float32), y=np.arange(20) % 2)
    assert len(load_data(f"npz:{tmp_path / 'f.npz'}[5:15]")) == 10
    with pytest.raises(BayescliError, match="bad index range"):
        DataSpec.parse("digits:test[1:x]")


def test_validation_spec_comes_from_the_same_source():
    assert validation_spec("npz:some/file.npz") == "npz:some/file.npz:val"
    assert validation_spec("npz:f.npz:train[0:900]") == "npz:f.npz:val"
    assert validation_spec("mnist:train[:5000]") == "mnist:val"
    assert str(DataSpec.parse("idx:d:test[3:]")) == "idx:d:test[3:]"


def test_val_nll_on_npz_without_val_data(cli, digits_ckpt, tmp_path):
    data = load_data("digits:train")
    np.savez(tmp_path / "d.npz", x=data.x.numpy(), y=data.y.numpy())
    res = cli(
        "fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt,
        "--data", f"npz:{tmp_path / 'd.npz'}:train", "--prior-precision", "val-nll",
        "--out", tmp_path / "p.safetensors", "--quiet",
    )  # fmt: skip
    assert res.code == 0, res.err
