"""Multi-label data (labels ``[N, K]`` 0/1): npz, CSV-listed images, composed digits, and
``bayescli train --likelihood bernoulli``. Everything is generated here (no files from ../shared)."""

import csv
import json

import numpy as np
import pytest
import torch

from bayescli.data import DataSpec, load_data
from bayescli.errors import BayescliError
from bayescli.io import load_tensors


def one_error_line(res) -> str:
    assert res.code == 2, (res.code, res.out, res.err)
    assert "Traceback" not in res.err
    lines = [ln for ln in res.err.strip().splitlines() if ln.strip()]
    return lines[-1]


# -- npz ------------------------------------------------------------------------------------------


def _multilabel_npz(path, n=20, k=4, dtype=np.uint8, **extra):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(n, 1, 8, 8), dtype=np.uint8)
    y = rng.integers(0, 2, size=(n, k)).astype(dtype)
    np.savez(path, x=x, y=y, **extra)
    return x, y


def test_npz_multilabel_round_trip_through_views_batches_and_take(tmp_path):
    path = tmp_path / "m.npz"
    _, y = _multilabel_npz(path, class_names=np.array(["a", "b", "c", "d"]))
    whole = load_data(f"npz:{path}")
    assert whole.multilabel and whole.num_classes == 4 and whole.class_names == ["a", "b", "c", "d"]
    assert whole.y.dtype == torch.int64 and torch.equal(whole.y, torch.from_numpy(y).long())
    test = load_data(f"npz:{path}:test")
    assert len(test) == 4 and torch.equal(test.y, torch.from_numpy(y).long()[test.index])
    ranged = load_data(f"npz:{path}[3:9]")
    assert torch.equal(ranged.y, torch.from_numpy(y).long()[3:9])
    limited = load_data(f"npz:{path}", limit=7, seed=1)
    assert limited.y.shape == (7, 4) and torch.equal(limited.y, whole.y[limited.index])
    ys = [yb for _, yb in whole.batches(6)]
    assert [tuple(yb.shape) for yb in ys] == [(6, 4), (6, 4), (6, 4), (2, 4)]
    assert torch.equal(torch.cat(ys), whole.y)
    xb, yb = whole.take([5, 0])
    assert xb.shape == (2, 1, 8, 8) and torch.equal(yb, whole.y[[5, 0]])
    # single-label sets keep saying no
    assert not load_data("digits:test").multilabel
    # bool indicators and default class names (the column numbers)
    np.savez(tmp_path / "b.npz", x=np.zeros((3, 2), np.float32), y=np.eye(3, dtype=bool))
    booleans = load_data(f"npz:{tmp_path / 'b.npz'}")
    assert booleans.class_names == ["0", "1", "2"]
    assert torch.equal(booleans.y, torch.eye(3, dtype=torch.int64))


def test_npz_multilabel_bad_labels_are_refused_with_one_clear_line(tmp_path):
    x = np.zeros((3, 2), np.float32)
    cases = {
        "two.npz": (
            {"y": np.array([[0, 1], [2, 0], [1, 1]])},
            "{path}: multi-label 'y' [N, K] must hold only 0 and 1; found 2 in 1 cell (int64)",
        ),
        "soft.npz": (  # float 0./1. is accepted (tests/test_inputs.py); soft targets are not labels
            {"y": np.array([[0, 0.5], [1, 0], [0.5, 1]], np.float32)},
            "{path}: multi-label 'y' [N, K] must hold only 0 and 1; found 0.5 in 2 cells (float32)",
        ),
        "text.npz": (
            {"y": np.array([["a", "b"], ["a", "b"], ["a", "b"]])},
            "{path}: multi-label 'y' [N, K] must hold numbers 0/1, got <U1",
        ),
        "names.npz": (
            {"y": np.ones((3, 2), np.uint8), "class_names": np.array(["a", "b", "c"])},
            "{path}: 'class_names' has 3 entries but 'y' has 2 label columns",
        ),
        "cube.npz": (
            {"y": np.ones((3, 2, 2), np.uint8)},
            "{path}: 'y' must be [N] class indices or [N, K] 0/1 labels with N=3, got [3, 2, 2]",
        ),
        "rows.npz": (
            {"y": np.ones((2, 2), np.uint8)},
            "{path}: 'y' must be [N] class indices or [N, K] 0/1 labels with N=3, got [2, 2]",
        ),
    }
    for name, (arrays, message) in cases.items():
        path = tmp_path / name
        np.savez(path, x=x, **arrays)
        with pytest.raises(BayescliError) as err:
            load_data(f"npz:{path}")
        assert str(err.value) == message.format(path=path)


def test_data_refuses_inconsistent_multilabel_labels():
    from bayescli.data import ArrayData

    x = torch.zeros(2, 3)
    with pytest.raises(BayescliError, match="must be 0 or 1, found 3"):
        ArrayData(x, torch.tensor([[0, 3], [1, 0]]), ["a", "b"])
    with pytest.raises(BayescliError, match="2 class names for 3 label columns"):
        ArrayData(x, torch.zeros(2, 3, dtype=torch.int64), ["a", "b"])
    assert ArrayData(x, torch.ones(2, 2, dtype=torch.uint8), ["a", "b"]).multilabel


# -- images listed in a CSV file ------------------------------------------------------------------


def _write_images(folder, names):
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        Image.fromarray(rng.integers(0, 256, size=(6, 5, 3), dtype=np.uint8)).save(folder / name)


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def test_csv_listed_images_are_multilabel(tmp_path):
    _write_images(tmp_path / "img", [f"{i}.png" for i in range(5)])
    rows = [
        ["file", "labels"],
        ["img/0.png", "dog;cat"],
        ["img/1.png", "cat"],
        ["img/2.png", ""],  # no label at all: every column 0
        ["img/3.png", " bird ; dog "],
        [str(tmp_path / "img" / "4.png"), "dog"],  # absolute paths work too
    ]
    _write_csv(tmp_path / "labels.csv", rows)
    data = load_data(f"csv:{tmp_path / 'labels.csv'}")
    assert data.multilabel and data.class_names == ["bird", "cat", "dog"] and len(data) == 5
    assert data.y.tolist() == [[0, 1, 1], [0, 1, 0], [0, 0, 0], [1, 0, 1], [0, 0, 1]]
    x, y = data.take([3])
    assert x.shape == (1, 3, 6, 5) and y.tolist() == [[1, 0, 1]]
    # the same without a header, split like any other source
    _write_csv(tmp_path / "plain.csv", rows[1:])
    plain = load_data(f"csv:{tmp_path / 'plain.csv'}")
    assert torch.equal(plain.y, data.y)
    assert len(load_data(f"csv:{tmp_path / 'plain.csv'}:test")) == 1


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([["img/0.png", "cat dog"]], "row 1: label 'cat dog' contains a separator other than ';'"),
        ([["img/0.png", "cat|dog"]], "row 1: label 'cat|dog' contains a separator other than ';'"),
        ([["img/0.png", "cat", "dog"]], "row 1: expected 2 fields 'file,labels', found 3"),
        ([["img/0.png", "cat;;dog"]], "row 1: empty label in 'cat;;dog'"),
        ([["img/0.png", "cat"], ["img/9.png", "dog"]], "row 2: image not found"),
        ([["img/0.png", "cat"], ["img/0.png", "dog"]], "row 2: img/0.png is listed twice"),
        ([["img/0.png", ""]], "no image has a label"),
        ([["file", "labels"]], "lists no images"),
    ],
)
def test_csv_listed_images_bad_rows(tmp_path, rows, message):
    _write_images(tmp_path / "img", ["0.png"])
    _write_csv(tmp_path / "labels.csv", rows)
    with pytest.raises(BayescliError) as err:
        load_data(f"csv:{tmp_path / 'labels.csv'}")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_csv_file_missing(tmp_path):
    with pytest.raises(BayescliError, match="label file not found"):
        load_data(f"csv:{tmp_path / 'nope.csv'}")


# -- composed digits ------------------------------------------------------------------------------

SPLIT_SIZES = {"train": 1258, "val": 180, "test": 359}  # 70/10/20 of scikit-learn's 1797 digits


def test_composed_digits_splits_sizes_and_shapes():
    parts = {s: load_data(f"composed-digits:{s}") for s in SPLIT_SIZES}
    assert {s: len(d) for s, d in parts.items()} == SPLIT_SIZES
    assert len(load_data("composed-digits")) == SPLIT_SIZES["test"]  # like `digits`: test by default
    for d in parts.values():
        assert d.multilabel and d.input_shape == (1, 8, 24) and d.num_classes == 10
        assert d.info["split_seed"] == 0 and d.info["composed"]["slots"] == 3
        assert set(d.y.sum(1).tolist()) <= {1, 2, 3}  # 1-3 digits, a repeated digit counts once
    index = torch.cat([d.index for d in parts.values()]).sort().values
    assert torch.equal(index, torch.arange(1797))


def test_composed_digits_are_deterministic_and_seeded():
    a, b = load_data("composed-digits:train"), load_data("composed-digits:train")
    assert torch.equal(a.inputs(slice(None)), b.inputs(slice(None))) and torch.equal(a.y, b.y)
    other = load_data("composed-digits:train", split_seed=1)
    assert not torch.equal(other.y, a.y)


def test_composed_label_is_the_set_of_its_source_digits():
    from bayescli.data import sources

    digits = sources.digits()
    base_x, base_y = digits.inputs(slice(None)), digits.y
    for split in SPLIT_SIZES:
        data = load_data(f"composed-digits:{split}")
        picks = data.source.picks[data.rows]  # [N, 3] base rows shown (-1: empty cell)
        x = data.inputs(slice(None))
        counts = (picks >= 0).sum(1)
        assert set(counts.tolist()) == {1, 2, 3}
        for i in range(len(data)):
            cells = x[i].reshape(1, 8, 3, 8).permute(2, 0, 1, 3)  # the three 8×8 cells
            shown = picks[i][picks[i] >= 0]
            expected = torch.zeros(10, dtype=torch.int64)
            expected[base_y[shown]] = 1
            assert torch.equal(data.y[i], expected)
            for cell, pick in zip(cells, picks[i].tolist(), strict=True):
                assert torch.equal(cell, base_x[pick] if pick >= 0 else torch.zeros(1, 8, 8))


def test_composed_splits_share_no_base_image():
    used = {}
    for split in SPLIT_SIZES:
        data = load_data(f"composed-digits:{split}")
        picks = data.source.picks[data.rows]
        used[split] = set(picks[picks >= 0].tolist())
    assert not used["train"] & used["test"] and not used["train"] & used["val"]
    assert not used["val"] & used["test"]


def test_composed_any_base_spec(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "letters.npz"
    np.savez(path, x=rng.integers(0, 256, size=(50, 1, 4, 5), dtype=np.uint8), y=np.arange(50) % 5)
    whole = load_data(f"composed:npz:{path}")
    assert len(whole) == 50 and whole.input_shape == (1, 4, 15) and whole.num_classes == 5
    test = load_data(f"composed:npz:{path}:test")
    assert len(test) == 10 and test.spec == f"composed:npz:{path}:test"
    assert torch.equal(test.y, whole.y[test.index])
    assert DataSpec.parse(f"composed:npz:{path}:train").path == f"npz:{path}"
    assert len(load_data(f"composed:npz:{path}:test[2:5]")) == 3


def test_composed_refuses_bad_bases(tmp_path):
    with pytest.raises(BayescliError, match="unknown dataset 'nope'"):
        DataSpec.parse("composed:nope:test")
    with pytest.raises(BayescliError, match="needs a path, e.g. composed:mnist:test"):
        DataSpec.parse("composed:")
    np.savez(tmp_path / "u.npz", x=np.zeros((5, 1, 2, 2), np.uint8))
    with pytest.raises(BayescliError, match="composing needs labelled images"):
        load_data(f"composed:npz:{tmp_path / 'u.npz'}")
    _multilabel_npz(tmp_path / "m.npz")
    with pytest.raises(BayescliError, match="already multi-label"):
        load_data(f"composed:npz:{tmp_path / 'm.npz'}")
    np.savez(tmp_path / "flat.npz", x=np.zeros((5, 3), np.float32), y=np.arange(5))
    with pytest.raises(BayescliError, match=r"composing needs images \[C, H, W\]"):
        load_data(f"composed:npz:{tmp_path / 'flat.npz'}")


# -- training -------------------------------------------------------------------------------------


def test_multilabel_accuracy_thresholds_logits_at_zero():
    from torch import nn

    from bayescli.data import ArrayData
    from bayescli.training.classifier import accuracy, multilabel_accuracy

    logits = torch.tensor([[2.0, -0.5, 0.3], [-0.2, 0.4, -3.0], [1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    y = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 0, 1], [0, 0, 0]])  # 1 + 2 + 2 + 3 right of 3 each
    data = ArrayData(logits, y, ["a", "b", "c"])  # the model is the identity: inputs are its logits
    per_label, subset = multilabel_accuracy(nn.Identity(), data, torch.device("cpu"), batch_size=3)
    assert per_label == pytest.approx(10 / 12) and subset == pytest.approx(2 / 4)
    assert accuracy(nn.Identity(), data, torch.device("cpu")) == pytest.approx(10 / 12)


def test_train_bernoulli_on_composed_digits(cli, tmp_path):
    out = tmp_path / "multi.safetensors"
    res = cli(
        "train", "--model", "builtin:mlp", "--likelihood", "bernoulli", "--data", "composed-digits:train",
        "--epochs", "10", "--out", out, "--json",
    )  # fmt: skip
    assert res.code == 0, res.err
    summary = json.loads(res.out)
    # all-zeros predictions score 0.81 per label here; 10 epochs reach 0.933 per label, 0.54 per set
    assert summary["likelihood"] == "bernoulli"
    assert summary["val_accuracy"] > 0.9 and summary["val_subset_accuracy"] > 0.4
    _, meta = load_tensors(out)
    assert meta["likelihood"] == "bernoulli" and meta["num_classes"] == 10
    assert meta["input_shape"] == [1, 8, 24]
    assert meta["val_data"]["spec"] == "composed-digits:val"
    assert meta["val_accuracy"] == summary["val_accuracy"] and 0 <= meta["train_subset_accuracy"] <= 1


def test_train_records_categorical_likelihood(cli, tmp_path):
    out = tmp_path / "single.safetensors"
    res = cli("train", "--model", "builtin:mlp", "--data", "digits:train", "--epochs", "1", "--out", out)
    assert res.code == 0, res.err
    _, meta = load_tensors(out)
    assert meta["likelihood"] == "categorical" and "val_subset_accuracy" not in meta


NOT_MULTILABEL = (
    "error: likelihood 'bernoulli' needs multi-label data (y [N, K] of 0/1), but {spec} has one class per "
    "input; use --likelihood categorical, or multi-label data such as composed-digits"
)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--likelihood", "bernoulli", "--data", "digits:train"],
            NOT_MULTILABEL.format(spec="digits:train"),
        ),
        (
            ["--data", "composed-digits:train"],
            "error: composed-digits:train is multi-label (y [N, 10] of 0/1) but the likelihood is "
            "'categorical' (one class per input); use --likelihood bernoulli",
        ),
        (
            ["--likelihood", "bernoulli", "--data", "composed-digits:train", "--val", "digits:val"],
            NOT_MULTILABEL.format(spec="digits:val"),
        ),
        (
            ["--likelihood", "bernoulli", "--method", "fsvi", "--data", "composed-digits:train"],
            "--method fsvi trains categorical models only; use --method map or mnvi",
        ),
        (["--likelihood", "poisson"], "choose one of categorical, bernoulli"),
    ],
)
def test_train_likelihood_mismatch_exits_2(cli, tmp_path, args, message):
    out = tmp_path / "m.safetensors"
    res = cli("train", "--model", "builtin:mlp", "--epochs", "1", "--out", out, *args)
    assert message in one_error_line(res)
    assert not out.exists()


def test_posterior_commands_refuse_mismatched_models_and_data_naming_the_cause(cli, tmp_path):
    """Laplace, MNVI and GLM VI fit multi-label posteriors: a bernoulli checkpoint must fit multi-hot data, a
    softmax one single-label data, and the other commands refuse bernoulli models; each mismatch
    stops with exit 2 and a line naming it, never a softmax posterior computed on multi-hot labels."""
    multi, single = tmp_path / "multi.safetensors", tmp_path / "single.safetensors"
    for out, args in ((multi, ("--likelihood", "bernoulli", "--data", "composed-digits:train")),
                      (single, ("--data", "digits:train"))):  # fmt: skip
        assert cli("train", "--model", "builtin:mlp", "--epochs", "1", "--out", out, *args).code == 0
    res = cli("fit-laplace", "--model", "builtin:mlp", "--checkpoint", multi, "--data", "digits:train",
              "--out", tmp_path / "p.safetensors")  # fmt: skip
    assert res.code == 2 and "but the model is multi-label (likelihood 'bernoulli'" in res.err
    res = cli("fit-vi", "--method", "fsvi", "--model", "builtin:mlp", "--checkpoint", multi, "--data",
              "composed-digits:train", "--out", tmp_path / "p.safetensors")  # fmt: skip
    assert res.code == 2 and "is a multi-label classifier (likelihood 'bernoulli'" in res.err
    res = cli("fit-laplace", "--model", "builtin:mlp", "--checkpoint", single, "--data",
              "composed-digits:train", "--out", tmp_path / "p.safetensors")  # fmt: skip
    assert res.code == 2
    assert res.err.strip() == (
        "error: composed-digits:train is multi-label (y [N, 10] of 0/1), but the model is a softmax "
        "classifier (likelihood 'categorical', one class per input); use single-label data"
    )
    assert not (tmp_path / "p.safetensors").exists()
    res = cli("fit-laplace", "--model", "builtin:mlp", "--checkpoint", single, "--data", "digits:train",
              "--out", tmp_path / "p.safetensors")  # fmt: skip
    assert res.code == 0, res.err
    res = cli("evaluate", "--posterior", tmp_path / "p.safetensors", "--data", "composed-digits:test",
              "--out", tmp_path / "r.json")  # fmt: skip
    assert res.code == 2 and "composed-digits:test is multi-label" in res.err
    res = cli("fit-laplace", "--model", "builtin:mlp", "--checkpoint", multi, "--data",
              "composed-digits:train", "--out", tmp_path / "m.safetensors")  # fmt: skip
    assert res.code == 0, res.err
    res = cli("topk", "--posterior", tmp_path / "m.safetensors", "--data", "composed-digits:test")
    assert res.code == 2 and "is a multi-label classifier (likelihood 'bernoulli'" in res.err
    assert "top-k sets rank the classes of one label, a single-label notion" in res.err
