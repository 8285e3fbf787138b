"""Segmentation data: npz images with integer masks, ignore_index, batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bayescli.data.segmentation import SegmentationData, check_mask, segmentation_npz, valid_pixels
from bayescli.errors import BayescliError


def _save(tmp_path, **arrays):
    path = tmp_path / "seg.npz"
    np.savez(path, **arrays)
    return path


def test_grey_uint8_images_with_masks(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (5, 6, 7), dtype=np.uint8)
    mask = rng.integers(0, 3, (5, 6, 7)).astype(np.uint8)
    mask[0, 0, :] = 255
    data = segmentation_npz(_save(tmp_path, x=x, mask=mask))
    assert data.input_shape == (1, 6, 7) and data.class_names == ["0", "1", "2"]  # 255 is not a class
    assert data.valid_count() == 5 * 6 * 7 - 7
    batches = list(data.batches(2))
    assert [len(b[0]) for b in batches] == [2, 2, 1]
    xb, mb = batches[1]
    assert xb.dtype == torch.float32 and mb.dtype == torch.int64
    assert torch.equal(xb, torch.from_numpy(x[2:4, None]).float() / 255)  # the same bytes, scaled
    assert torch.equal(mb, torch.from_numpy(mask[2:4]).long())
    sub = data.subset([4, 0])
    assert torch.equal(sub.mask, torch.from_numpy(mask[[4, 0]]).long())


def test_colour_float_images_class_names_and_unlabelled(tmp_path):
    x = np.random.default_rng(1).random((2, 3, 4, 4)).astype(np.float32)
    mask = np.zeros((2, 4, 4), dtype=np.int64)
    data = segmentation_npz(_save(tmp_path, x=x, mask=mask, class_names=np.array(["bg", "cat"])))
    assert data.class_names == ["bg", "cat"] and data.num_classes == 2
    unlabelled = segmentation_npz(_save(tmp_path, x=x))
    assert unlabelled.mask is None and unlabelled.valid_count() == 32
    assert next(unlabelled.batches(8))[1] is None


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (
            {"x": np.zeros((2, 4, 4), np.uint8), "mask": np.zeros((2, 4, 5), np.int64)},
            r"masks must be \[N, H, W\]",
        ),
        (
            {"x": np.zeros((2, 4, 4), np.uint8), "mask": np.zeros((2, 4, 4), np.float32)},
            "integer class indices",
        ),
        ({"x": np.zeros((2, 8, 8, 3), np.uint8), "mask": np.zeros((2, 8, 8), np.int64)}, "channels-last"),
        ({"x": np.full((2, 4, 4), 200.0, np.float32)}, "float pixels are read in"),
        ({"mask": np.zeros((2, 4, 4), np.int64)}, "has no array 'x'"),
        (
            {
                "x": np.zeros((1, 2, 2), np.uint8),
                "mask": np.array([[[0, 1], [7, 255]]]),
                "class_names": np.array(["a", "b"]),
            },
            r"mask holds class 7 but the model has 2 classes \(0–1 or the ignore index 255\)",
        ),
    ],
)
def test_bad_files_are_refused_with_the_cause(tmp_path, arrays, message):
    with pytest.raises(BayescliError, match=message):
        segmentation_npz(_save(tmp_path, **arrays))


def test_ignore_index_none_counts_every_pixel():
    mask = torch.tensor([[[0, 255], [1, 1]]])
    assert valid_pixels(mask).tolist() == [[[True, False], [True, True]]]
    assert valid_pixels(mask, None).all()
    with pytest.raises(BayescliError, match="mask holds class 255"):
        check_mask(mask, 2, None, "data")
    check_mask(mask, 2, 255, "data")
    data = SegmentationData(torch.zeros(1, 1, 2, 2), mask, ["a", "b"], ignore_index=255)
    assert data.valid_count() == 3
    with pytest.raises(BayescliError, match="class -1"):
        SegmentationData(torch.zeros(1, 1, 2, 2), -mask.clamp_max(1), ["a", "b"], ignore_index=255)


def test_composed_scenes_load_with_their_anomaly_masks(tmp_path):
    """The files bayescli.data.scenes writes (digits and a pasted anomaly) read back as they were."""
    from sklearn.datasets import load_digits

    from bayescli.data.scenes import compose_scenes, save_scenes

    d = load_digits()
    images = torch.tensor(d.images[:40], dtype=torch.float32) / 16
    scenes = compose_scenes(
        images, torch.tensor(d.target[:40]), 6, seed=0, canvas=(24, 24), anomalies=1 - images[:5]
    )
    save_scenes(scenes, tmp_path / "scenes.npz")
    data = segmentation_npz(tmp_path / "scenes.npz")
    assert data.class_names == ["background", *[str(i) for i in range(10)]]
    assert torch.equal(data.mask, scenes.mask.long()) and torch.equal(data.anomaly, scenes.anomaly)
    assert bool((data.mask[data.anomaly.bool()] == 255).all())  # anomalies are void for the classes
    assert torch.equal(data.subset([5, 1]).anomaly, scenes.anomaly[[5, 1]])
    with pytest.raises(BayescliError, match="'anomaly' must hold 0"):
        SegmentationData(data.x, data.mask, data.class_names, anomaly=data.anomaly * 2)
