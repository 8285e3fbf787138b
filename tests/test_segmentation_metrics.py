"""Streamed segmentation metrics against their in-memory definitions.

Oracles: the classification metrics applied to the valid pixels as rows (NLL, Brier, ECE,
reliability bins, accuracy), an IoU written here from a confusion matrix counted pixel by pixel
in NumPy, scikit-learn's ``roc_auc_score`` / ``average_precision_score`` and a NumPy FPR@95%TPR
over every distinct threshold.

Tolerances: the streamed sums and the oracles are float64 sums of at most a few thousand terms in
different orders, so they agree to ≤ N·eps ≈ 1e-12 relative; 1e-10 keeps a margin of 100×.
Histogram-binned detection metrics must lie within the error bound they report (derived in the
module docstring), plus the same float64 slack.
"""

import math

import numpy as np
import pytest
import torch
from tolerance import assert_below, assert_close

from bayescli.errors import BayescliError
from bayescli.metrics import segmentation as seg
from bayescli.metrics.classification import accuracy, brier, ece, entropy, mmc, nll, reliability
from bayescli.metrics.segmentation import (
    AnomalySegmentationMetrics,
    SegmentationMetrics,
    anomaly_scores,
    float_bins,
)

F64 = 1e-10
K = 5
BATCHINGS = [[4], [1, 1, 1, 1], [1, 3], [2, 2]]


def scene_batch(
    seed: int = 0, b: int = 4, k: int = K, h: int = 6, w: int = 7
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[b, k, h, w]`` (per-pixel scales from near-uniform to saturated) and masks with
    about 20% ``ignore_index`` pixels."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(b, 1, h, w).uniform_(-2, 4, generator=g))
    logits = torch.randn(b, k, h, w, generator=g) * scale
    mask = torch.randint(k, (b, h, w), generator=g)
    mask[torch.rand(b, h, w, generator=g) < 0.2] = 255
    return logits, mask


def pixel_rows(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The valid pixels of ``t [B, K, H, W]`` as rows ``[P, K]``."""
    return t.movedim(1, -1)[mask != 255]


def streamed(mask: torch.Tensor, sizes: list[int], **preds: torch.Tensor) -> dict:
    m = SegmentationMetrics(K)
    start = 0
    for n in sizes:
        m.update(mask[start : start + n], **{k: v[start : start + n] for k, v in preds.items()})
        start += n
    return m.compute()


@pytest.mark.parametrize("sizes", BATCHINGS)
@pytest.mark.parametrize("given", ["log_probs", "probs", "both"])
def test_streamed_metrics_equal_pixels_as_rows(sizes, given, monkeypatch):
    monkeypatch.setattr(seg, "CHUNK_ELEMENTS", 7 * K)  # several chunks per image
    logits, mask = scene_batch()
    log_probs = logits.double().log_softmax(1)
    probs = logits.softmax(1)  # float32, as a predictive hands them over
    preds = {"log_probs": {"log_probs": log_probs}, "probs": {"probs": probs}}.get(
        given, {"log_probs": log_probs, "probs": probs}
    )
    out = streamed(mask, sizes, **preds)
    y = mask[mask != 255]
    lp = pixel_rows(log_probs, mask) if given != "probs" else None
    p = pixel_rows(probs, mask).double() if given != "log_probs" else lp.exp()
    assert out["pixels"] == len(y) == int((mask != 255).sum())
    assert_close(out["pixel_accuracy"], accuracy(p, y), atol=F64, what="pixel accuracy")
    assert_close(out["nll"], nll(p, y, lp), rtol=F64, what="nll")
    assert_close(out["brier"], brier(p, y), rtol=F64, what="brier")
    assert_close(out["ece"], ece(p, y), atol=F64, what="ece")
    assert_close(out["mmc"], mmc(p), rtol=F64, what="mmc")
    assert_close(out["entropy"], entropy(p).mean(), rtol=F64, what="entropy")
    rel = reliability(p, y)
    assert out["reliability"]["count"] == rel["count"]
    for key in ("confidence", "accuracy"):
        assert_close(out["reliability"][key], rel[key], atol=F64, what=f"reliability {key}")


def direct_iou(pred: np.ndarray, y: np.ndarray, k: int) -> tuple[list, float | None]:
    """IoU per class from a confusion matrix counted pixel by pixel; 0/0 classes are None and
    left out of the mean."""
    cm = np.zeros((k, k), dtype=np.int64)
    for t, q in zip(y.tolist(), pred.tolist(), strict=True):
        cm[t, q] += 1
    iou = []
    for c in range(k):
        tp, fp, fn = cm[c, c], cm[:, c].sum() - cm[c, c], cm[c, :].sum() - cm[c, c]
        iou.append(None if tp + fp + fn == 0 else tp / (tp + fp + fn))
    present = [v for v in iou if v is not None]
    return iou, sum(present) / len(present)


@pytest.mark.parametrize("sizes", BATCHINGS)
def test_iou_equals_direct_confusion_matrix(sizes):
    logits, mask = scene_batch(seed=1)
    # class 4: never true and never predicted (absent: left out); class 3: true but never predicted
    # (IoU 0, counted in the mean)
    logits[:, 3:] = -1e4
    mask[mask == 4] = 0
    out = streamed(mask, sizes, log_probs=logits.log_softmax(1))
    pred = pixel_rows(logits, mask).argmax(-1).numpy()
    iou, mean = direct_iou(pred, mask[mask != 255].numpy(), K)
    assert iou[4] is None and out["iou"][4] is None
    assert iou[3] == 0.0 and out["iou"][3] == 0.0
    assert_close(
        [v for v in out["iou"] if v is not None], [v for v in iou if v is not None], atol=F64, what="iou"
    )
    assert_close(out["mean_iou"], mean, atol=F64, what="mean iou")


def test_iou_on_hand_computed_image():
    # truth [[0, 0], [1, void]], prediction [[0, 1], [1, 2]]: class 0 IoU 1/2, class 1 IoU 1/2;
    # class 2 is predicted only on the void pixel and class 3 nowhere: both absent, mean 1/2
    mask = torch.tensor([[[0, 0], [1, 255]]])
    pred = torch.tensor([[[0, 1], [1, 2]]])
    probs = torch.nn.functional.one_hot(pred, 4).movedim(-1, 1).double() * 0.7 + 0.075
    m = SegmentationMetrics(4)
    m.update(mask, probs=probs)
    out = m.compute()
    assert out["iou"] == [0.5, 0.5, None, None]
    assert_close(out["mean_iou"], 0.5, atol=F64, what="mean iou")
    assert_close(out["pixel_accuracy"], 2 / 3, atol=F64, what="pixel accuracy")


def test_ignore_pixels_change_nothing():
    logits, mask = scene_batch(seed=2)
    other = logits.clone()
    void = (mask == 255).unsqueeze(1).expand_as(logits)
    other[void] = math.nan  # a void pixel's prediction may be anything
    a, b = (streamed(mask, [1, 3], log_probs=t.log_softmax(1)) for t in (logits, other))
    for key in ("pixel_accuracy", "mean_iou", "nll", "brier", "ece"):
        assert_close(a[key], b[key], atol=F64, what=key)

    scores = anomaly_scores(logits=logits)
    noisy = {
        name: torch.where(mask == 255, torch.randn(mask.shape, dtype=torch.float64), s).masked_fill(
            (mask == 255) & (torch.rand(mask.shape) < 0.3), math.nan
        )
        for name, s in scores.items()
    }
    label = (mask == 1).long().masked_fill(mask == 255, 255)
    results = []
    for settings in ({"exact": True}, {}):
        for sc in (scores, noisy):
            m = AnomalySegmentationMetrics(**settings)
            m.update(sc, label)
            results.append(m.compute())
    assert results[0]["pixels"] == int((mask != 255).sum())
    for clean, dirty in ((0, 1), (2, 3)):
        for name in scores:
            for key in ("auroc", "ap", "fpr95"):
                assert_close(
                    results[clean]["scores"][name][key],
                    results[dirty]["scores"][name][key],
                    atol=F64,
                    what=f"{name} {key}",
                )


def test_merge_equals_one_stream():
    logits, mask = scene_batch(seed=3)
    lp = logits.log_softmax(1)
    whole = SegmentationMetrics(K)
    whole.update(mask, log_probs=lp)
    left, right = SegmentationMetrics(K), SegmentationMetrics(K)
    left.update(mask[:1], log_probs=lp[:1])
    right.update(mask[1:], log_probs=lp[1:])
    left.merge(right)
    a, b = whole.compute(), left.compute()
    for key in ("pixels", "pixel_accuracy", "mean_iou", "nll", "brier", "ece"):
        assert_close(a[key], b[key], atol=F64, what=key)


def test_bad_masks_and_shapes_raise():
    logits, mask = scene_batch()
    m = SegmentationMetrics(K)
    with pytest.raises(BayescliError, match=r"\[B, 5, H, W\]"):
        m.update(mask[:, :5], log_probs=logits)
    m.update(mask.masked_fill(mask == 0, 7), log_probs=logits)  # counted on the device, raised at the end
    with pytest.raises(BayescliError, match=r"mask holds class 7 \(\d+ pixels\)"):
        m.compute()
    m = SegmentationMetrics(K)
    m.update(mask[:0], log_probs=logits[:0])  # an empty batch adds nothing
    m.update(torch.full_like(mask, 255), log_probs=logits)
    with pytest.raises(BayescliError, match="at least one labelled pixel"):
        m.compute()


def test_update_reads_nothing_back_and_equals_cpu():
    from emulated_cuda import emulated_cuda

    logits, mask = scene_batch(seed=10)
    scores = anomaly_scores(logits=logits.double())
    label = (mask == 2).long().masked_fill(mask == 255, 255)
    cpu_seg, cpu_an = SegmentationMetrics(K), AnomalySegmentationMetrics()
    cpu_seg.update(mask, log_probs=logits.log_softmax(1))
    cpu_an.update(scores, label)
    with emulated_cuda() as stats:
        dev_logits, dev_mask, dev_label = logits.cuda(), mask.cuda(), label.cuda()
        dev_scores = {k: v.cuda() for k, v in scores.items()}
        seg_m, an_m = SegmentationMetrics(K), AnomalySegmentationMetrics()
        stats.reset()
        for b in range(len(mask)):
            seg_m.update(dev_mask[b : b + 1], log_probs=dev_logits[b : b + 1].log_softmax(1))
            an_m.update({k: v[b : b + 1] for k, v in dev_scores.items()}, dev_label[b : b + 1])
        assert stats.host_reads == 0, stats.events
        assert seg_m.confusion.is_cuda
        dev_seg, dev_an = seg_m.compute(), an_m.compute()
    want_seg, want_an = cpu_seg.compute(), cpu_an.compute()
    for key in ("pixel_accuracy", "mean_iou", "nll", "brier", "ece"):
        assert_close(dev_seg[key], want_seg[key], atol=F64, what=key)
    for name in scores:
        for key in ("auroc", "ap", "fpr95"):
            assert_close(dev_an["scores"][name][key], want_an["scores"][name][key], atol=F64, what=key)


# ---------------------------------------------------------------- anomaly segmentation


def numpy_fpr95(score: np.ndarray, positive: np.ndarray) -> float:
    """FPR at the highest threshold (every distinct score, calling ``s ≥ t`` anomalous) whose
    TPR reaches 0.95."""
    for t in np.unique(score)[::-1]:
        if (score[positive] >= t).mean() >= 0.95:
            return float((score[~positive] >= t).mean())
    raise AssertionError("unreachable: the lowest threshold has TPR 1")


def anomaly_batch(seed: int = 0, b: int = 4, h: int = 16, w: int = 16, ties: bool = False):
    """Scores ``{name: [b, h, w]}`` where anomalous pixels score higher on average, labels 0/1
    with void pixels 255. ``ties``: scores rounded to a coarse grid (many exact ties)."""
    g = torch.Generator().manual_seed(seed)
    label = (torch.rand(b, h, w, generator=g) < 0.3).long()
    base = torch.randn(b, h, w, generator=g, dtype=torch.float64) + 1.2 * label
    scores = {"normal": base, "lognormal": torch.exp(3 * base), "negative": base - 10}
    if ties:
        scores = {k: (v * 4).round() / 4 for k, v in scores.items()}
    label[torch.rand(b, h, w, generator=g) < 0.1] = 255
    return scores, label


def exact_oracle(score: torch.Tensor, label: torch.Tensor) -> dict:
    from sklearn.metrics import average_precision_score, roc_auc_score

    valid = label != 255
    s, pos = score[valid].numpy(), (label[valid] == 1).numpy()
    return {
        "auroc": roc_auc_score(pos, s),
        "ap": average_precision_score(pos, s),
        "fpr95": numpy_fpr95(s, pos),
    }


def stream_anomaly(scores: dict, label: torch.Tensor, sizes: list[int], **settings) -> dict:
    m = AnomalySegmentationMetrics(**settings)
    start = 0
    for n in sizes:
        m.update({k: v[start : start + n] for k, v in scores.items()}, label[start : start + n])
        start += n
    return m.compute()


@pytest.mark.parametrize("sizes", BATCHINGS)
@pytest.mark.parametrize("ties", [False, True])
def test_exact_mode_equals_sklearn(sizes, ties):
    scores, label = anomaly_batch(seed=4, ties=ties)
    out = stream_anomaly(scores, label, sizes, exact=True)
    assert out["anomalous"] == int((label == 1).sum()) and out["pixels"] == int((label != 255).sum())
    for name, score in scores.items():
        want = exact_oracle(score, label)
        got = out["scores"][name]
        for key in ("auroc", "ap", "fpr95"):
            assert_close(got[key], want[key], atol=F64, what=f"{name} {key}")
        assert got["error_bound"] == {"auroc": 0.0, "ap": 0.0, "fpr95": 0.0}


SETTINGS = [
    {},  # default: float32 bits, 10 mantissa bits
    {"mantissa_bits": 2},  # coarse: the bound must hold when it is far from 0
    {"value_range": (-3.0, 3.0), "bins": 64},  # equal-width, with clipping at both ends
    {"value_range": (-1.0, 1.0), "bins": 5},
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("ties", [False, True])
def test_histograms_within_their_error_bound(settings, ties):
    scores, label = anomaly_batch(seed=5, h=32, w=32, ties=ties)
    out = stream_anomaly(scores, label, [1, 2, 1], **settings)
    loose = 0
    for name, score in scores.items():
        want = exact_oracle(score, label)
        got = out["scores"][name]
        for key in ("auroc", "ap", "fpr95"):
            err = abs(got[key] - want[key])
            assert_below(err, got["error_bound"][key] + F64, what=f"{name} {key} within its bound")
            loose += err > 1e-6
        # the binned FPR95 counts all of its bin's normal pixels: never below the exact value
        assert got["fpr95"] >= want["fpr95"] - F64
    if settings.get("bins") == 5:
        assert loose, "5 bins should move some metric off its exact value (else the bound is untested)"


def test_default_binning_is_fine_for_continuous_scores():
    # 10 mantissa bits: bins 0.1% wide relative to the score, so scores of unit spread centred on
    # −10 (the "negative" one) tie most; measured bounds 2e-5 to 1.9e-3 (AP of "negative"), and
    # 12 bits bring every bound under 5.7e-4
    scores, label = anomaly_batch(seed=6, h=32, w=32)
    for bits, limit in ((10, 5e-3), (12, 1e-3)):
        out = stream_anomaly(scores, label, [4], mantissa_bits=bits)
        for name in scores:
            for key, bound in out["scores"][name]["error_bound"].items():
                if key != "fpr95":  # one tied normal pixel at the threshold is 1/N whatever the bits
                    assert bound < limit, f"{bits} bits, {name} {key}: bound {bound} ≥ {limit}"


def test_float_bins_monotone_with_relative_resolution():
    g = torch.Generator().manual_seed(7)
    x = (
        torch.cat(
            [
                torch.randn(2000, generator=g, dtype=torch.float64)
                * torch.exp(torch.randn(2000, generator=g) * 20),
                torch.tensor(
                    [0.0, -0.0, math.inf, -math.inf, 1e-40, -1e-40, 3e38, -3e38], dtype=torch.float64
                ),
            ]
        )
        .sort()
        .values
    )
    for bits in (0, 4, 10, 23):
        b = float_bins(x, bits)
        assert bool((b[1:] >= b[:-1]).all()), f"{bits} bits: bins must not decrease with the score"
        assert int(b.min()) >= 0 and int(b.max()) < 1 << (9 + bits)
    assert int(float_bins(torch.tensor([0.0]))[0]) == int(float_bins(torch.tensor([-0.0]))[0])
    # each octave [2^e, 2^(e+1)) holds exactly 2^m bins: two scores a relative 2^-m apart never
    # share a bin; 2^-(m+3) apart usually do
    for bits in (0, 4, 10):
        octave = 1 + torch.arange(4 << bits, dtype=torch.float64) / (4 << bits)
        assert len(float_bins(octave, bits).unique()) == 1 << bits
        assert len(float_bins(-octave * 2.0**-70, bits).unique()) == 1 << bits
    m = 10
    v = torch.exp(torch.linspace(-60, 60, 500, dtype=torch.float64))
    for sign in (1.0, -1.0):
        assert bool((float_bins(sign * v, m) != float_bins(sign * v * (1 + 2.0**-m), m)).all())
    assert float((float_bins(v, m) == float_bins(v * (1 + 2.0 ** (-m - 3)), m)).double().mean()) > 0.7


def test_anomaly_scores_formulas_and_direction():
    g = torch.Generator().manual_seed(8)
    s, b, k, h, w = 6, 2, 4, 3, 5
    logits = torch.randn(b, k, h, w, generator=g, dtype=torch.float64) * 2
    logits[0, 0, 0, 0] = 200.0  # saturated: max p rounds to 1 in float64
    samples = (logits + torch.randn(s, b, k, h, w, generator=g, dtype=torch.float64)).log_softmax(2)
    out = anomaly_scores(logits=logits, sample_log_probs=samples)
    p = samples.exp().mean(0)  # the predictive is the samples' mean
    assert_close(out["max_prob"], 1 - p.max(1).values, atol=1e-12, what="1 - max p")
    ent = -(p * p.log()).sum(1)
    assert_close(out["entropy"], ent, atol=1e-12, what="entropy")
    each = -(samples.exp() * samples).sum(2).mean(0)
    assert_close(out["mutual_information"], ent - each, atol=1e-12, what="mutual information")
    assert_close(out["energy"], -torch.log(torch.exp(logits).sum(1)), rtol=1e-12, what="energy")
    # MI is the samples' own, whatever predictive log_probs comes with them
    other = anomaly_scores(logits.log_softmax(1), sample_log_probs=samples)["mutual_information"]
    assert_close(other, ent - each, atol=1e-12, what="mutual information beside another predictive")
    plain = anomaly_scores(logits=logits)
    assert set(plain) == {"max_prob", "entropy", "energy"}
    assert float(plain["max_prob"][0, 0, 0]) > 0.0  # the saturated pixel keeps its tiny 1 − max p
    rest = torch.exp(logits[0, 1:, 0, 0] - 200).sum()  # Σ_{j≠top} p_j up to a factor 1 + 1e-80
    assert_close(plain["max_prob"][0, 0, 0], rest, rtol=1e-12, what="saturated 1 - max p")

    # direction: flat (anomalous) pixels score higher than peaked ones on every score
    peaked = torch.tensor([8.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    flat = torch.tensor([0.5, 0.4, 0.3, 0.2], dtype=torch.float64)
    stack = torch.stack([peaked, flat]).T.reshape(1, k, 1, 2) * 3
    sc = anomaly_scores(logits=stack)
    for name in ("max_prob", "entropy"):
        assert float(sc[name][0, 0, 1]) > float(sc[name][0, 0, 0]), name
    assert float(sc["energy"][0, 0, 1]) > float(sc["energy"][0, 0, 0]), "energy"
    spread = torch.stack([torch.zeros(k), torch.randn(k, generator=g) * 3]).to(torch.float64)
    mi = anomaly_scores(sample_log_probs=spread.reshape(2, 1, k, 1, 1).log_softmax(2))["mutual_information"]
    same = anomaly_scores(sample_log_probs=torch.zeros(2, 1, k, 1, 1).log_softmax(2))["mutual_information"]
    assert float(mi) > float(same) >= -1e-15


def test_anomaly_metrics_rank_anomalies_high():
    scores, label = anomaly_batch(seed=9)
    out = stream_anomaly(scores, label, [4])
    for name in scores:
        assert out["scores"][name]["auroc"] > 0.7, name


def test_anomaly_bad_inputs_raise():
    scores, label = anomaly_batch()
    m = AnomalySegmentationMetrics()
    m.update(scores, label.masked_fill(label == 1, 2))
    with pytest.raises(BayescliError, match=r"found 2 \(\d+ pixels\)"):
        m.compute()
    m = AnomalySegmentationMetrics()
    m.update({"x": scores["normal"].masked_fill(label == 0, math.nan)}, label)
    with pytest.raises(BayescliError, match="NaN on"):
        m.compute()
    m = AnomalySegmentationMetrics()
    m.update({"x": scores["normal"][:0]}, label[:0])
    m.update({"x": scores["normal"]}, label.masked_fill(label == 1, 0))
    with pytest.raises(BayescliError, match="both anomalous and normal"):
        m.compute()
    with pytest.raises(BayescliError, match="anomaly mask is"):
        m.update({"x": scores["normal"][:, :3]}, label)


def test_boolean_anomaly_masks_have_no_void():
    scores, label = anomaly_batch(seed=11)
    as_int = stream_anomaly(scores, label.masked_fill(label == 255, 0), [4], exact=True)
    as_bool = stream_anomaly(scores, label == 1, [4], exact=True)
    assert as_bool["pixels"] == label.numel() == as_int["pixels"]
    for name in scores:
        for key in ("auroc", "ap", "fpr95"):
            assert_close(as_bool["scores"][name][key], as_int["scores"][name][key], atol=F64, what=key)
