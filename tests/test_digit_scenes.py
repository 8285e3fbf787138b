"""The builtin segmentation set ``digit-scenes``: deterministic, the documented shapes, splits made
of disjoint digit images, anomaly masks only in the anomaly split, loaded as ``seg:`` data is."""

from __future__ import annotations

import pytest
import torch

from bayescli.data.registry import (
    DIGIT_SCENES,
    SCENE_CANVAS,
    DataSpec,
    _seeded_split,
    is_segmentation,
    letter_glyphs,
    load_data,
    load_segmentation,
)
from bayescli.data.sources import digits
from bayescli.errors import BayescliError

SPLITS = ("train", "val", "test", "anomaly")


@pytest.fixture(scope="module")
def sets():
    return {s: load_segmentation(f"digit-scenes:{s}") for s in SPLITS}


def test_shapes_and_classes(sets):
    for split, data in sets.items():
        assert tuple(data.x.shape) == (DIGIT_SCENES[split], 1, *SCENE_CANVAS)
        assert tuple(data.mask.shape) == (DIGIT_SCENES[split], *SCENE_CANVAS)
        assert data.class_names == ["background", *map(str, range(10))] and data.num_classes == 11
        assert float(data.x.min()) >= 0.0 and float(data.x.max()) <= 1.0
        assert data.info["spec"] == f"digit-scenes:{split}" and data.info["split"] == split
        valid = data.mask[data.mask != 255]
        assert set(valid.unique().tolist()) == set(range(11))  # every class appears


def test_deterministic_and_seeded(sets):
    again = load_segmentation("digit-scenes:train")
    assert torch.equal(again.x, sets["train"].x) and torch.equal(again.mask, sets["train"].mask)
    other = load_segmentation("digit-scenes:train", split_seed=1)
    assert not torch.equal(other.x, sets["train"].x)
    whole = load_segmentation("digit-scenes")  # the test split by default, as digits
    assert torch.equal(whole.x, sets["test"].x)


def test_splits_use_disjoint_digit_images(sets):
    """Every 8×8 window that holds a whole digit image is one of that split's digits only (the
    anomaly scenes' digits are the test split's)."""
    base = digits().x[:, 0]
    owners = {}
    for split in ("train", "val", "test"):
        rows = _seeded_split(len(base), split, 0)
        owners[split] = {tuple(base[r].flatten().tolist()) for r in rows.tolist()}
    assert not owners["train"] & owners["val"] and not owners["train"] & owners["test"]
    assert not owners["val"] & owners["test"]
    for split in SPLITS:
        windows = sets[split].x[:, 0].unfold(1, 8, 1).unfold(2, 8, 1).reshape(-1, 64)
        seen = {tuple(w.tolist()) for w in windows[windows.sum(1) > 20]}
        pasted = {w for o, ws in owners.items() for w in ws if w in seen}
        assert pasted and pasted <= owners["test" if split == "anomaly" else split], split


def test_anomaly_masks_only_in_the_anomaly_split(sets):
    for split in ("train", "val", "test"):
        assert sets[split].anomaly is None and not bool((sets[split].mask == 255).any())
    data = sets["anomaly"]
    assert data.anomaly is not None and int(data.anomaly.sum()) > 0
    # each scene holds one letter: its foreground is ignored in the mask and 1 in the anomaly mask
    assert torch.equal(data.anomaly.bool(), data.mask == 255)
    assert bool((data.anomaly.flatten(1).sum(1) > 0).all())
    glyph_pixels = {int(g.sum()) for g in letter_glyphs()}
    assert {int(n) for n in data.anomaly.flatten(1).sum(1)} <= glyph_pixels


def test_ignore_index_follows_the_option():
    data = load_segmentation("digit-scenes:anomaly[:5]", ignore_index=200)
    assert torch.equal(data.anomaly.bool(), data.mask == 200) and data.ignore_index == 200
    with pytest.raises(BayescliError, match="keep one"):
        load_segmentation("digit-scenes:anomaly", ignore_index=None)


def test_spec_parsing_rows_and_refusals():
    assert is_segmentation("digit-scenes:val") and is_segmentation("digit-scenes:anomaly")
    assert str(DataSpec.parse("digit-scenes:anomaly[2:4]")) == "digit-scenes:anomaly[2:4]"
    assert len(load_segmentation("digit-scenes:val[:7]")) == 7
    assert len(load_segmentation("digit-scenes:train", limit=9)) == 9
    with pytest.raises(BayescliError, match="unknown split 'anomalous'"):
        DataSpec.parse("digit-scenes:anomalous")
    with pytest.raises(BayescliError, match="is segmentation data"):
        load_data("digit-scenes:test")
