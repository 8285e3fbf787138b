import math
import pickle

import numpy as np
import pytest
import torch
from formats import write_cifar_binary, write_idx, write_svhn

from bayescli.data import DataSpec, load_data
from bayescli.errors import BayescliError


def test_digits_splits_are_disjoint_deterministic_and_complete():
    parts = {s: load_data(f"digits:{s}") for s in ("train", "val", "test")}
    sizes = {s: len(d) for s, d in parts.items()}
    assert sum(sizes.values()) == 1797
    assert sizes["test"] in (math.floor(0.2 * 1797), math.ceil(0.2 * 1797))
    again = load_data("digits:test")
    assert torch.equal(again.x, parts["test"].x)
    assert parts["test"].info["split_seed"] == 0
    x = torch.cat([d.x.flatten(1) for d in parts.values()])
    assert x.min() >= 0 and x.max() <= 1
    # different split seed -> different partition
    assert not torch.equal(load_data("digits:test", split_seed=1).x, parts["test"].x)


def test_limit_is_a_seeded_subset():
    a = load_data("digits:train", limit=50, seed=3)
    b = load_data("digits:train", limit=50, seed=3)
    c = load_data("digits:train", limit=50, seed=4)
    assert len(a) == 50 and torch.equal(a.x, b.x) and not torch.equal(a.x, c.x)
    assert a.info["limit"] == 50 and a.info["limit_seed"] == 3


@pytest.mark.parametrize("text", ["nope", "digits:holdout"])
def test_bad_specs(text):
    with pytest.raises(BayescliError):
        DataSpec.parse(text)


def test_npz_with_and_without_labels(tmp_path):
    x = np.random.default_rng(0).integers(0, 256, size=(12, 1, 8, 8), dtype=np.uint8)
    np.savez(tmp_path / "a.npz", x=x, y=np.arange(12) % 3)
    np.savez(tmp_path / "b.npz", x=x)
    a = load_data(f"npz:{tmp_path / 'a.npz'}")
    assert a.inputs(slice(None)).max() <= 1 and a.num_classes == 3 and len(a) == 12
    b = load_data(f"npz:{tmp_path / 'b.npz'}")
    assert b.y is None
    split = load_data(f"npz:{tmp_path / 'a.npz'}:test")
    assert len(split) == round(0.2 * 12)


def test_npz_nan_and_bad_labels_are_refused(tmp_path):
    x = np.zeros((4, 3), dtype=np.float32)
    x[1, 2] = np.nan
    np.savez(tmp_path / "nan.npz", x=x)
    with pytest.raises(BayescliError, match="NaN"):
        load_data(f"npz:{tmp_path / 'nan.npz'}")
    np.savez(tmp_path / "y.npz", x=np.zeros((4, 3), dtype=np.float32), y=np.zeros((3,), dtype=np.int64))
    with pytest.raises(BayescliError, match="'y' must be"):
        load_data(f"npz:{tmp_path / 'y.npz'}")
    with pytest.raises(BayescliError, match="not found"):
        load_data(f"npz:{tmp_path / 'missing.npz'}")


def test_imagefolder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            size = (10, 10) if i else (12, 9)
            Image.fromarray(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)).save(
                tmp_path / cls / f"{i}.png"
            )
    data = load_data(f"imagefolder:{tmp_path}")
    assert data.class_names == ["cat", "dog"] and len(data) == 6
    x = data.inputs(slice(None))
    assert data.input_shape[0] == 3 and x.shape == (6, *data.input_shape)


@pytest.mark.parametrize(
    ("name", "folder"), [("mnist", "MNIST"), ("fashion-mnist", "FashionMNIST"), ("kmnist", "KMNIST")]
)
def test_mnist_family_official_idx_format(tmp_path, name, folder):
    write_idx(tmp_path, folder)
    test = load_data(f"{name}:test", root=tmp_path)
    assert len(test) == 20 and test.input_shape == (1, 28, 28) and test.x.dtype == torch.uint8
    train, val = load_data(f"{name}:train", root=tmp_path), load_data(f"{name}:val", root=tmp_path)
    assert len(train) + len(val) == 30 and len(val) == 3
    assert test.y.tolist() == [i % 10 for i in range(20)]


def test_cifar10_binary_format(tmp_path):
    pixels = write_cifar_binary(tmp_path)
    test = load_data("cifar10:test", root=tmp_path)
    assert test.input_shape == (3, 32, 32) and test.class_names[0] == "class0"
    stored = (test.inputs(slice(None)) * 255).round().to(torch.uint8)  # memory-mapped, scaled on read
    assert torch.equal(stored.reshape(len(test), -1), torch.from_numpy(pixels))
    assert len(load_data("cifar10:train", root=tmp_path)) + len(load_data("cifar10:val", root=tmp_path)) == 60


def test_cifar100_binary_uses_fine_labels(tmp_path):
    write_cifar_binary(tmp_path, hundred=True, per_file=120)
    test = load_data("cifar100:test", root=tmp_path)
    assert test.y.tolist() == [i % 100 for i in range(120)]


def test_cifar_python_version_with_wrong_checksum_is_not_unpickled(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump({"data": np.zeros((2, 3072), np.uint8), "labels": [0, 1]}, f)
    with pytest.raises(BayescliError, match="refusing to unpickle"):
        load_data("cifar10:test", root=tmp_path)


def test_svhn_mat_format(tmp_path):
    write_svhn(tmp_path)
    test = load_data("svhn:test", root=tmp_path)
    assert test.input_shape == (3, 32, 32)
    assert test.y.tolist() == [(i % 10 + 1) % 10 for i in range(15)]


@pytest.mark.parametrize("name", ["mnist", "cifar10", "cifar100", "svhn"])
def test_missing_dataset_says_how_to_fix(tmp_path, name):
    with pytest.raises(BayescliError, match="--download"):
        load_data(f"{name}:test", root=tmp_path)
