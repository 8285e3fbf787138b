"""Composed segmentation scenes (bayescli/data/scenes.py, benchmarks/seg_scenes.py).

Scenes are built from scikit-learn's 8×8 digits upsampled to 16×16 (and, as "letters", the
digits turned upside down), checked against the layout they report: every pasted image sits
unchanged in its box, boxes never overlap, the class mask is ``label + 1`` exactly where a
digit's pixel is brighter than the threshold, the anomaly mask is 1 (and the class mask 255)
exactly on the letters' bright pixels, and everything else is background. All checks are exact
(integer masks, copied pixels).
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from formats import write_idx

from bayescli.data.scenes import ANOMALY, DIGIT, compose_scenes, foreground, save_scenes
from bayescli.errors import BayescliError

CANVAS = (40, 40)


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32) / 16  # [1797, 8, 8] in [0, 1]
    x = torch.nn.functional.interpolate(x[:, None], scale_factor=2, mode="bilinear")[:, 0].clamp(0, 1)
    return x[:300], torch.tensor(d.target[:300])


def letters_of(x: torch.Tensor) -> torch.Tensor:
    return x.flip(1)[150:]


def boxes(scenes, scene: int) -> list[tuple[int, int, int, int, int, int]]:
    """``(kind, row, top, left, h, w)`` of the images pasted into ``scene``."""
    rows = scenes.placed[scenes.placed[:, 0] == scene]
    return [(k, r, t, left, 16, 16) for _, k, r, t, left in rows.tolist()]


def test_scenes_agree_with_their_layout(digits):
    x, y = digits
    letters = letters_of(x)
    scenes = compose_scenes(x, y, 40, seed=3, canvas=CANVAS, objects=(1, 3), anomalies=letters)
    assert scenes.x.shape == (40, *CANVAS) and scenes.x.dtype == torch.float32
    assert scenes.mask.shape == scenes.anomaly.shape == (40, *CANVAS)
    assert scenes.mask.dtype == scenes.anomaly.dtype == torch.uint8
    assert scenes.class_names == ["background", *[str(i) for i in range(10)]]
    for s in range(40):
        placed = boxes(scenes, s)
        kinds = [k for k, *_ in placed]
        assert 1 <= kinds.count(DIGIT) <= 3 and kinds.count(ANOMALY) == 1
        want_mask = torch.zeros(CANVAS, dtype=torch.uint8)
        want_anomaly = torch.zeros(CANVAS, dtype=torch.uint8)
        covered = torch.zeros(CANVAS, dtype=torch.bool)
        for kind, row, t, left, h, w in placed:
            box = (slice(t, t + h), slice(left, left + w))
            assert t >= 0 and left >= 0 and t + h <= CANVAS[0] and left + w <= CANVAS[1]
            assert not bool(covered[box].any()), f"scene {s}: boxes overlap"
            covered[box] = True
            src = x[row] if kind == DIGIT else letters[row]
            assert torch.equal(scenes.x[s][box], src), (
                f"scene {s}: pasted pixels differ from the source image"
            )
            bright = src > 0.5
            if kind == DIGIT:
                want_mask[box][bright] = int(y[row]) + 1
            else:
                want_mask[box][bright] = 255
                want_anomaly[box][bright] = 1
        assert not bool(scenes.x[s][~covered].any()), f"scene {s}: pixels outside every box"
        assert torch.equal(scenes.mask[s], want_mask), f"scene {s}: class mask"
        assert torch.equal(scenes.anomaly[s], want_anomaly), f"scene {s}: anomaly mask"
    # without overlap, the foreground is exactly the bright pixels, whatever pasted them
    assert torch.equal(scenes.mask > 0, scenes.x > 0.5)
    assert torch.equal(scenes.mask == 255, scenes.anomaly == 1)


def test_seeded_and_deterministic(digits):
    x, y = digits
    a, b, c = (compose_scenes(x, y, 12, seed=s, canvas=CANVAS, anomalies=letters_of(x)) for s in (5, 5, 6))
    for field in ("x", "mask", "anomaly", "placed"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert not torch.equal(a.placed, c.placed)


def test_uint8_images_threshold_on_the_unit_scale(digits):
    x, y = digits
    pixels = (x * 255).round().to(torch.uint8)
    scenes = compose_scenes(pixels, y, 10, seed=0, canvas=CANVAS, threshold=0.3)
    assert scenes.x.dtype == torch.uint8 and scenes.anomaly is None
    assert torch.equal(scenes.mask > 0, scenes.x > 0.3 * 255)
    assert torch.equal(foreground(pixels, 0.3), pixels > 76.5)
    assert not bool((scenes.placed[:, 1] == ANOMALY).any())


def test_save_round_trip(digits, tmp_path):
    x, y = digits
    scenes = compose_scenes(x, y, 6, seed=1, canvas=CANVAS, anomalies=letters_of(x))
    save_scenes(scenes, tmp_path / "sub" / "anomaly.npz")
    with np.load(tmp_path / "sub" / "anomaly.npz", allow_pickle=False) as f:
        assert sorted(f.files) == ["anomaly", "class_names", "mask", "placed", "x"]
        np.testing.assert_array_equal(f["x"], scenes.x.numpy())
        np.testing.assert_array_equal(f["mask"], scenes.mask.numpy())
        np.testing.assert_array_equal(f["anomaly"], scenes.anomaly.numpy())
        assert f["class_names"].tolist() == scenes.class_names


def test_impossible_layouts_and_bad_inputs_raise(digits):
    x, y = digits
    with pytest.raises(BayescliError, match="without overlap"):
        compose_scenes(x, y, 2, seed=0, canvas=(20, 20), objects=(2, 2))
    with pytest.raises(BayescliError, match="do not fit"):
        compose_scenes(x, y, 2, seed=0, canvas=(12, 40))
    with pytest.raises(BayescliError, match="labels"):
        compose_scenes(x, y[:5], 2, seed=0)
    with pytest.raises(BayescliError, match="ignore_index 3 free"):
        compose_scenes(x, y, 2, seed=0, ignore_index=3)


def test_benchmark_script_writes_the_three_sets(tmp_path, capsys):
    write_idx(tmp_path / "data" / "mnist", "MNIST", n_test=20)
    write_idx(tmp_path / "data", "notmnist", n_test=20, seed=1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import seg_scenes
    finally:
        sys.path.pop(0)
    out = tmp_path / "scenes"
    seg_scenes.main(
        ["--shared", str(tmp_path), "--out", str(out), "--train", "6", "--test", "3", "--anomaly", "4"]
    )
    sets = {name: np.load(out / f"{name}.npz") for name in ("train", "test", "anomaly")}
    assert [len(sets[n]["x"]) for n in ("train", "test", "anomaly")] == [6, 3, 4]
    assert sets["train"]["x"].shape[1:] == (64, 64) and sets["train"]["x"].dtype == np.uint8
    assert "anomaly" not in sets["test"].files and sets["anomaly"]["anomaly"].any()
    # training scenes show MNIST test rows [0, 10) of the 20 here; test and anomaly scenes rows [10, 20)
    from bayescli.data.sources import read_idx

    mnist = read_idx(tmp_path / "data" / "mnist" / "MNIST" / "raw" / "t10k-images-idx3-ubyte")
    for name, offset in (("train", 0), ("test", 10), ("anomaly", 10)):
        for scene, kind, row, t, left in sets[name]["placed"].tolist():
            if kind == DIGIT:
                np.testing.assert_array_equal(
                    sets[name]["x"][scene, t : t + 28, left : left + 28], mnist[offset + row]
                )
    assert "train: 6 scenes" in capsys.readouterr().out
