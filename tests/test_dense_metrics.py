"""Streamed segmentation metrics against their in-memory definitions (valid pixels as inputs of the
classification metrics) and a direct IoU. All sums are float64 over ≤ 10³ pixels: agreement to
1e-12 relative covers summation order; the confusion counts are integers and must match exactly."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from bayescli.errors import BayescliError
from bayescli.metrics import classification as cm
from bayescli.metrics.segmentation import SegmentationMetrics

K, N, H, W = 4, 5, 6, 7


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(N, K, H, W, generator=gen)
    mask = torch.randint(0, K, (N, H, W), generator=gen)
    # predictions that agree with the mask on about half the pixels, so IoU is neither 0 nor 1
    logits += (
        4
        * torch.nn.functional.one_hot(mask, K).permute(0, 3, 1, 2)
        * (torch.rand(N, 1, H, W, generator=gen) < 0.5)
    )
    mask[0, :3] = 255
    mask[3, :, :2] = 255
    mask[mask == 3] = torch.where(torch.rand((mask == 3).sum(), generator=gen) < 0.9, 1, 3)  # class 3 rare
    return logits.softmax(1), logits.log_softmax(1).double(), mask


def direct_iou(pred: torch.Tensor, y: torch.Tensor, k: int) -> list[float | None]:
    out = []
    for c in range(k):
        inter = int(((pred == c) & (y == c)).sum())
        union = int(((pred == c) | (y == c)).sum())
        out.append(inter / union if union else None)
    return out


def test_streamed_metrics_equal_in_memory_definitions(batch):
    probs, log_probs, mask = batch
    metrics = SegmentationMetrics(K)
    for i in range(0, N, 2):
        metrics.update(probs[i : i + 2], mask[i : i + 2], log_probs[i : i + 2])
    got = metrics.result()
    valid = (mask != 255).reshape(-1)
    p = probs.permute(0, 2, 3, 1).reshape(-1, K)[valid]
    lp = log_probs.permute(0, 2, 3, 1).reshape(-1, K)[valid]
    y = mask.reshape(-1)[valid]
    assert got["pixels"] == int(valid.sum())
    assert_close(got["pixel_accuracy"], cm.accuracy(p, y), rtol=1e-12, what="pixel accuracy")
    assert_close(got["nll"], cm.nll(p, y, lp), rtol=1e-12, what="pixel NLL")
    assert_close(got["brier"], cm.brier(p, y), rtol=1e-12, what="pixel Brier")
    assert_close(got["ece"], cm.ece(p, y), rtol=1e-12, atol=1e-15, what="pixel ECE")
    iou = direct_iou(p.argmax(1), y, K)
    assert [v is None for v in got["iou"]] == [v is None for v in iou]
    assert_close(
        [v for v in got["iou"] if v is not None], [v for v in iou if v is not None], rtol=1e-12, what="IoU"
    )
    present = [v for v in iou if v is not None]
    assert_close(got["mean_iou"], sum(present) / len(present), rtol=1e-12, what="mean IoU")
    assert 0.2 < got["mean_iou"] < 0.9  # neither trivial extreme


def test_ignored_pixels_do_not_count(batch):
    probs, log_probs, mask = batch
    ref = SegmentationMetrics(K)
    ref.update(probs, mask, log_probs)
    scrambled = probs.clone()
    scrambled.permute(0, 2, 3, 1)[mask == 255] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    other = SegmentationMetrics(K)
    other.update(scrambled, mask)  # and without log_probs: the float64 log of probs
    a, b = ref.result(), other.result()
    assert torch.equal(ref.confusion(), other.confusion())
    for key in ("pixel_accuracy", "brier", "ece"):
        assert_close(b[key], a[key], rtol=1e-12, atol=1e-15, what=key)
    assert_close(b["nll"], a["nll"], rtol=1e-6, what="NLL from probs vs log-probs (float32 probs)")


def test_a_class_absent_everywhere_is_left_out_of_the_mean():
    probs = torch.zeros(1, 3, 1, 2)
    probs[0, 0] = 1.0  # predict class 0 everywhere
    metrics = SegmentationMetrics(3)
    metrics.update(probs, torch.tensor([[[0, 1]]]))
    got = metrics.result()
    assert got["iou"] == [0.5, 0.0, None] and got["mean_iou"] == 0.25
    assert metrics.confusion().tolist() == [[1, 0, 0], [1, 0, 0], [0, 0, 0]]  # rows: true class


def test_refusals():
    metrics = SegmentationMetrics(2)
    with pytest.raises(BayescliError, match=r"probs \[N, 2, H, W\] and masks \[N, H, W\]"):
        metrics.update(torch.rand(1, 2, 3, 3), torch.zeros(1, 3, 4, dtype=torch.long))
    metrics.update(torch.rand(1, 2, 2, 2), torch.full((1, 2, 2), 255))
    with pytest.raises(BayescliError, match="every pixel is ignored"):
        metrics.result()
