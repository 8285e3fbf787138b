"""Metric values against hand-computed numbers and direct NumPy transcriptions of DESIGN §4.

Tolerances: the metrics are float64 sums of at most a few thousand terms, so the rounding
error is ≤ N·eps ≈ 1e-13 relative; 1e-10 leaves a margin above 1000×.
"""

import math

import numpy as np
import pytest
import torch
from tolerance import assert_close

from bayescli.metrics.classification import (
    accuracy,
    brier,
    classification_summary,
    ece,
    entropy,
    mmc,
    nll,
    ood_metrics,
)

F64 = 1e-10  # float64 rounding over ≤ 1e3 terms is ≤ 1e-13; see the module docstring

# A tiny table: four inputs, three classes; argmax classes 0, 1, 2, 1; labels 0, 2, 2, 0.
TABLE = torch.tensor(
    [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5], [0.3, 0.4, 0.3]], dtype=torch.float64
)
LABELS = torch.tensor([0, 2, 2, 0])


def test_metrics_on_hand_computed_table():
    assert_close(accuracy(TABLE, LABELS), 2 / 4, atol=F64, what="accuracy")
    expected_nll = -(math.log(0.7) + math.log(0.3) + math.log(0.5) + math.log(0.3)) / 4
    assert_close(nll(TABLE, LABELS), expected_nll, rtol=F64, what="nll")
    # (0.3² + 0.2² + 0.1²), (0.1² + 0.6² + 0.7²), (0.25² + 0.25² + 0.5²), (0.7² + 0.4² + 0.3²)
    expected_brier = (0.14 + 0.86 + 0.375 + 0.74) / 4
    assert_close(brier(TABLE, LABELS), expected_brier, rtol=F64, what="brier (sum over classes)")
    assert_close(mmc(TABLE), (0.7 + 0.6 + 0.5 + 0.4) / 4, rtol=F64, what="mmc")
    h = [-sum(p * math.log(p) for p in row) for row in TABLE.tolist()]
    assert_close(entropy(TABLE), h, rtol=F64, what="entropy per input")
    # each confidence (0.7, 0.6, 0.5, 0.4) falls into its own of the 15 bins
    expected_ece = (abs(1 - 0.7) + abs(0 - 0.6) + abs(1 - 0.5) + abs(0 - 0.4)) / 4
    assert_close(ece(TABLE, LABELS), expected_ece, rtol=F64, what="ece")
    summary = classification_summary(TABLE, LABELS)
    expected = {"accuracy": 0.5, "nll": expected_nll, "brier": expected_brier, "ece": expected_ece}
    expected |= {"mmc": 0.55, "entropy": float(np.mean(h))}
    assert set(summary) == set(expected)
    for key, value in expected.items():
        assert_close(summary[key], value, rtol=F64, atol=F64, what=f"summary {key}")


def _ece_oracle(p: np.ndarray, y: np.ndarray, bins: int) -> float:
    """Loop over right-closed bins ``(b/B, (b+1)/B]`` (bin 0 also holds confidence 0)."""
    conf, pred = p.max(1), p.argmax(1)
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = (conf > lo) & (conf <= hi) if b else (conf <= hi)
        if inside.any():
            total += inside.sum() / len(y) * abs((pred[inside] == y[inside]).mean() - conf[inside].mean())
    return total


def test_metrics_against_numpy_transcription():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(7, 0.6), size=500)
    y = rng.integers(0, 7, size=500)
    probs, labels = torch.from_numpy(p), torch.from_numpy(y)
    onehot = np.eye(7)[y]
    assert_close(accuracy(probs, labels), np.mean(p.argmax(1) == y), atol=F64, what="accuracy")
    assert_close(nll(probs, labels), -np.mean(np.log(p[np.arange(500), y])), rtol=F64, what="nll")
    assert_close(brier(probs, labels), np.mean(((p - onehot) ** 2).sum(1)), rtol=F64, what="brier")
    assert_close(mmc(probs), p.max(1).mean(), rtol=F64, what="mmc")
    assert_close(entropy(probs), -(p * np.log(p)).sum(1), rtol=F64, atol=F64, what="entropy")
    assert_close(ece(probs, labels), _ece_oracle(p, y, 15), rtol=F64, what="ece")


def _auroc_pairs(s_in: np.ndarray, s_out: np.ndarray) -> float:
    """Mann–Whitney: P(s_in > s_out) + ½ P(s_in = s_out) over all pairs."""
    diff = s_in[:, None] - s_out[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def _average_precision(pos: np.ndarray, neg: np.ndarray) -> float:
    """Mean over positives of the precision at that positive's rank (scores without ties)."""
    scores = np.r_[pos, neg]
    is_pos = np.r_[np.ones(len(pos)), np.zeros(len(neg))][np.argsort(-scores)]
    precision_at = np.cumsum(is_pos) / np.arange(1, len(scores) + 1)
    return float(precision_at[is_pos == 1].mean())


def test_ood_metrics_against_pair_counting():
    rng = np.random.default_rng(1)
    s_in, s_out = rng.normal(1.0, 1.0, 300), rng.normal(0.0, 1.5, 200)
    m = ood_metrics(torch.from_numpy(s_in), torch.from_numpy(s_out))
    assert_close(m["auroc"], _auroc_pairs(s_in, s_out), atol=F64, what="auroc vs Mann-Whitney")
    assert_close(m["aupr_in"], _average_precision(s_in, s_out), atol=F64, what="aupr-in vs ranks")
    assert_close(m["aupr_out"], _average_precision(-s_out, -s_in), atol=F64, what="aupr-out vs ranks")
    # FPR at the threshold that keeps ⌈0.95·300⌉ = 285 in-distribution scores
    threshold = np.sort(s_in)[::-1][284]
    assert_close(m["fpr95"], np.mean(s_out >= threshold), atol=F64, what="fpr95 vs threshold count")
    # ties between the two sets count one half each
    tied_in, tied_out = np.round(s_in), np.round(s_out)
    tied = ood_metrics(torch.from_numpy(tied_in), torch.from_numpy(tied_out))["auroc"]
    assert_close(tied, _auroc_pairs(tied_in, tied_out), atol=F64, what="auroc with ties")


def test_ood_orientation_in_distribution_is_positive():
    m = ood_metrics(torch.tensor([3.0, 4.0, 5.0]), torch.tensor([0.0, 1.0, 3.5]))
    assert_close(m["auroc"], 8 / 9, atol=F64, what="auroc, 8 of 9 pairs ordered")
    flipped = ood_metrics(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0]))["auroc"]
    assert_close(flipped, 0.0, atol=F64, what="auroc, every pair reversed")


def _classwise_ece_oracle(p: np.ndarray, y: np.ndarray, bins: int) -> float:
    """Per class, the right-closed equal-width-bin ECE of p_k against 1[y = k]; mean over classes."""
    total = 0.0
    for k in range(p.shape[1]):
        conf, hit = p[:, k], (y == k).astype(float)
        for b in range(bins):
            lo, hi = b / bins, (b + 1) / bins
            inside = (conf > lo) & (conf <= hi) if b else (conf <= hi)
            if inside.any():
                total += inside.sum() / len(y) * abs(hit[inside].mean() - conf[inside].mean())
    return total / p.shape[1]


def _adaptive_and_max_oracle(p: np.ndarray, y: np.ndarray, bins: int) -> tuple[float, float]:
    """Equal-mass ECE (np.array_split of the confidence-sorted inputs) and the max gap of the
    equal-width bins."""
    conf, hit = p.max(1), (p.argmax(1) == y).astype(float)
    order = np.argsort(conf, kind="stable")
    adaptive = sum(
        len(idx) / len(y) * abs(hit[idx].mean() - conf[idx].mean())
        for idx in np.array_split(order, bins)
        if len(idx)
    )
    gaps = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = (conf > lo) & (conf <= hi) if b else (conf <= hi)
        if inside.any():
            gaps.append(abs(hit[inside].mean() - conf[inside].mean()))
    return adaptive, max(gaps)


def test_calibration_extras_against_numpy_loops():
    from bayescli.metrics.classification import adaptive_ece, classwise_ece, mce

    rng = np.random.default_rng(5)
    # labels drawn from p make the bin gaps change sign, so the binning matters (with random
    # labels every bin is over-confident and any binning gives the same adaptive ECE);
    # 7 < 15 bins: equal-mass bins of one input and empty ones
    for n, drawn in ((500, True), (500, False), (7, True)):
        p = rng.dirichlet(np.full(6, 0.5), size=n)
        y = (p.cumsum(1) > rng.random((n, 1))).argmax(1) if drawn else rng.integers(0, 6, size=n)
        probs, labels = torch.from_numpy(p), torch.from_numpy(y)
        expected = _classwise_ece_oracle(p, y, 15)
        assert_close(classwise_ece(probs, labels), expected, rtol=F64, what="classwise ece")
        adaptive, maximum = _adaptive_and_max_oracle(p, y, 15)
        assert_close(adaptive_ece(probs, labels), adaptive, rtol=F64, what=f"adaptive ece n={n}")
        assert_close(mce(probs, labels), maximum, rtol=F64, what=f"mce n={n}")


def test_calibration_extras_on_hand_table():
    from bayescli.metrics.classification import adaptive_ece, classwise_ece, mce

    # top-label gaps of TABLE's four inputs (each alone in its 15-bin): 0.3, 0.6, 0.5, 0.4
    assert_close(mce(TABLE, LABELS), 0.6, rtol=F64, what="mce")
    # 4 inputs in 15 equal-mass bins: one input per bin, the same as the 15-bin ECE here
    assert_close(adaptive_ece(TABLE, LABELS), (0.3 + 0.6 + 0.5 + 0.4) / 4, rtol=F64, what="adaptive ece")
    # class 0: p = .7 (label), .1, .25, .3 (label); class 1: .2, .6, .25, .4 (never the label);
    # class 2: .1, .3 (label), .5 (label), .3. Within a class every p sits in its own 1/15-wide
    # bin, except class 2's two 0.3s, which share one: |(1 + 0)/2 − 0.3| · 2/4
    c0 = (0.3 + 0.1 + 0.25 + 0.7) / 4
    c1 = (0.2 + 0.6 + 0.25 + 0.4) / 4
    c2 = (0.1 + 0.5 + 2 * abs(0.5 - 0.3)) / 4
    assert_close(classwise_ece(TABLE, LABELS), (c0 + c1 + c2) / 3, rtol=F64, what="classwise ece")


def test_ood_metrics_equal_scikit_learn_with_ties_and_the_roc_points():
    # The metrics run in torch on the scores' device; scikit-learn is the reference definition
    # (roc_curve with drop_intermediate, roc_auc_score, average_precision_score). Integer-valued
    # scores make many ties inside and across the two sets.
    from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

    rng = np.random.default_rng(4)
    cases = [
        (rng.integers(0, 7, 400).astype(float), rng.integers(-2, 5, 250).astype(float)),
        (rng.normal(1.0, 1.0, 300), rng.normal(0.0, 1.5, 500)),
        (np.r_[np.full(5, 2.0), 1.0], np.r_[2.0, 0.0, 0.0]),
    ]
    for s_in, s_out in cases:
        m = ood_metrics(torch.from_numpy(s_in), torch.from_numpy(s_out))
        s, label = np.r_[s_in, s_out], np.r_[np.ones(len(s_in)), np.zeros(len(s_out))]
        fpr, tpr, _ = roc_curve(label, s)
        keep = sorted({int(round(i)) for i in np.linspace(0, len(fpr) - 1, min(101, len(fpr)))})
        assert_close(m["auroc"], roc_auc_score(label, s), atol=F64, what="auroc vs sklearn")
        assert_close(m["aupr_in"], average_precision_score(label, s), atol=F64, what="aupr-in vs sklearn")
        assert_close(
            m["aupr_out"], average_precision_score(1 - label, -s), atol=F64, what="aupr-out vs sklearn"
        )
        assert_close(m["fpr95"], fpr[(tpr >= 0.95).argmax()], atol=F64, what="fpr95 vs sklearn")
        assert len(m["roc"]["fpr"]) == len(keep)
        assert_close(m["roc"]["fpr"], fpr[keep], atol=F64, what="roc fpr points")
        assert_close(m["roc"]["tpr"], tpr[keep], atol=F64, what="roc tpr points")
    with pytest.raises(ValueError, match="both sets"):  # scikit-learn refuses one class too
        ood_metrics(torch.ones(3), torch.ones(0))
