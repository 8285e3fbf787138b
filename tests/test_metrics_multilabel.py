"""Multi-label metrics against scikit-learn and direct loops.

Oracles are independent of the code under test: scikit-learn for mAP, F1, Hamming loss, subset
accuracy, per-label log loss and Brier; explicit Python loops for the binned ECE and the
selective curves; ``log(1 + exp(f))`` written out for JointEnergy.

Tolerances: every value is a float64 sum or mean of at most a few thousand terms (rounding
≤ N·eps ≈ 1e-13 relative); 1e-10 leaves a margin above 1000×. Counts (F1, Hamming, subset
accuracy) are ratios of integers and agree to rounding of one division.
"""

import math
import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    brier_score_loss,
    f1_score,
    hamming_loss,
    log_loss,
    roc_auc_score,
)
from tolerance import assert_close

from bayescli.errors import BayescliError
from bayescli.metrics import multilabel as mm
from bayescli.metrics.classification import ood_metrics

F64 = 1e-10  # float64 rounding over ≤ 1e4 terms is ≤ 1e-12; see the module docstring


def _tied_data(n: int = 300, k: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities on the grid {0.05, 0.10, …, 0.95} (many ties, 0.5 exactly among them) and
    labels drawn from them; label 3 never occurs, label 4 always does."""
    rng = np.random.default_rng(seed)
    p = np.clip(np.round(rng.random((n, k)) * 20) / 20, 0.05, 0.95)
    y = (rng.random((n, k)) < p).astype(np.int64)
    y[:, 3] = 0
    y[:, 4] = 1
    return p, y


def _t(*arrays: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(a) for a in arrays]


def test_ranking_and_threshold_metrics_against_sklearn():
    p, y = _tied_data()
    assert (p == 0.5).sum() > 10 and len(np.unique(p)) < 20  # the data really has ties and 0.5
    probs, labels = _t(p, y)
    pred = (p >= 0.5).astype(np.int64)  # the protocol: present when p ≥ 0.5
    has_pos = y.any(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scikit-learn warns on the label without positives
        ref_ap = average_precision_score(y[:, has_pos], p[:, has_pos], average="macro")
    got_map = mm.mean_average_precision(probs, labels)
    assert_close(got_map, ref_ap, rtol=F64, what="mAP (labels with a positive)")
    per_ap = mm.per_label_average_precision(probs, labels).numpy()
    assert np.isnan(per_ap[3]) and not np.isnan(per_ap[has_pos]).any()
    ref_per = average_precision_score(y[:, has_pos], p[:, has_pos], average=None)
    assert_close(per_ap[has_pos], ref_per, rtol=F64, what="per-label AP")
    ref_micro = f1_score(y, pred, average="micro", zero_division=0)
    ref_macro = f1_score(y, pred, average="macro", zero_division=0)
    assert_close(mm.micro_f1(probs, labels), ref_micro, rtol=F64, what="micro F1")
    assert_close(mm.macro_f1(probs, labels), ref_macro, rtol=F64, what="macro F1")
    assert_close(mm.hamming_loss(probs, labels), hamming_loss(y, pred), rtol=F64, what="Hamming loss")
    assert_close(mm.subset_accuracy(probs, labels), accuracy_score(y, pred), rtol=F64, what="subset accuracy")


def test_f1_of_a_label_without_true_or_predicted_positives_is_zero():
    p = np.array([[0.9, 0.1], [0.2, 0.3], [0.7, 0.4]])
    y = np.array([[1, 0], [0, 0], [1, 0]])
    got = mm.per_label_f1(*_t(p, y)).numpy()
    assert_close(got, f1_score(y, p >= 0.5, average=None, zero_division=0), atol=F64, what="per-label F1")
    assert got[1] == 0.0


def test_probabilistic_per_label_metrics_against_sklearn_and_a_loop():
    p, y = _tied_data(seed=1)
    probs, labels = _t(p, y)
    k = p.shape[1]
    ref_nll = [log_loss(y[:, j], p[:, j], labels=[0, 1]) for j in range(k)]
    ref_brier = [brier_score_loss(y[:, j], p[:, j], pos_label=1) for j in range(k)]
    assert_close(mm.per_label_nll(probs, labels), ref_nll, rtol=F64, what="per-label binary NLL")
    assert_close(mm.per_label_brier(probs, labels), ref_brier, rtol=F64, what="per-label Brier")
    ref_ece = [_binary_ece_loop(p[:, j], y[:, j], 15) for j in range(k)]
    assert_close(mm.per_label_ece(probs, labels), ref_ece, rtol=F64, atol=F64, what="per-label ECE")
    # continuous probabilities, a different bin count
    rng = np.random.default_rng(5)
    pc = rng.beta(0.5, 0.5, (400, 3))
    yc = (rng.random((400, 3)) < pc**1.5).astype(np.int64)  # miscalibrated, so the ECE is not tiny
    ref = [_binary_ece_loop(pc[:, j], yc[:, j], 10) for j in range(3)]
    assert_close(mm.per_label_ece(*_t(pc, yc), bins=10), ref, rtol=F64, what="per-label ECE, 10 bins")


def _binary_ece_loop(p: np.ndarray, y: np.ndarray, bins: int) -> float:
    """Right-closed bins ``(b/B, (b+1)/B]`` of the positive probability (bin 0 also holds 0):
    ``Σ_b (n_b/N) |mean_b(y) − mean_b(p)|``."""
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = (p > lo) & (p <= hi) if b else (p <= hi)
        if inside.any():
            total += inside.sum() / len(p) * abs(y[inside].mean() - p[inside].mean())
    return total


def test_nll_counts_an_underflowed_probability_like_the_single_label_nll():
    """A probability that is exactly 0 counts as the smallest positive float64 (708 nats), not 1e-12."""
    probs = torch.tensor([[0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    labels = torch.tensor([[1, 0], [1, 1]])
    expected = (-math.log(torch.finfo(torch.float64).tiny) - math.log(0.5)) / 2
    assert_close(mm.per_label_nll(probs, labels), [expected, expected], rtol=F64, what="floored NLL")


def test_nll_from_log_odds_is_exact_where_p_is_below_1e30():
    """Issue 37 part 1(b): labels whose probability is < 1e-30 (log-odds ±80, ±200, ±1000: float32
    and float64 sigmoids round to 0 or 1) score their analytic −log σ(±s) = log(1 + e^{∓s})."""
    s = torch.tensor([[80.0, -200.0], [-1000.0, 3.0], [0.0, 80.0]])
    labels = torch.tensor([[0, 1], [1, 1], [1, 0]])
    probs = s.sigmoid()  # float32: 1.0 or 0.0 at every saturated cell
    assert probs[0, 0] == 1 and probs[0, 1] == 0

    def neg_log_sigmoid(x: float) -> float:  # log(1 + e^{-x}), by hand
        return -x + math.log1p(math.exp(x)) if x < 0 else math.log1p(math.exp(-x))

    sign = labels.double() * 2 - 1
    cells = [[neg_log_sigmoid(float(sign[i, j] * s[i, j])) for j in range(2)] for i in range(3)]
    expected = [sum(row[j] for row in cells) / 3 for j in range(2)]
    assert expected[0] > 360 and expected[1] > 93  # 80 + 1000 + log 2 nats; 200 + 80 + …
    assert_close(mm.per_label_nll(probs, labels, s), expected, rtol=F64, what="log-odds NLL")
    summary = mm.multilabel_summary(probs, labels, log_odds=s)
    assert_close(summary["nll"], sum(expected) / 2, rtol=F64, what="summary NLL")
    # without the log-odds the float32 probabilities hit 0: 708 nats (the floor), not the truth
    assert (mm.per_label_nll(probs, labels) - torch.tensor(expected, dtype=torch.float64)).abs().min() > 10


def test_summary_collects_the_metrics():
    p, y = _tied_data(n=120, seed=2)
    probs, labels = _t(p, y)
    out = mm.multilabel_summary(probs, labels)
    expected = {
        "map": mm.mean_average_precision(probs, labels),
        "micro_f1": mm.micro_f1(probs, labels),
        "macro_f1": mm.macro_f1(probs, labels),
        "hamming_loss": mm.hamming_loss(probs, labels),
        "subset_accuracy": mm.subset_accuracy(probs, labels),
        "nll": mm.per_label_nll(probs, labels).mean().item(),
        "brier": mm.per_label_brier(probs, labels).mean().item(),
        "ece": mm.per_label_ece(probs, labels).mean().item(),
        "mean_entropy": float(np.mean(-(p * np.log(p) + (1 - p) * np.log(1 - p)))),
    }
    assert set(out) == set(expected) | {"per_label"}
    for key, value in expected.items():
        assert_close(out[key], value, rtol=F64, atol=F64, what=f"summary {key}")
    per = out["per_label"]
    assert per["positives"] == y.sum(0).tolist()
    assert [a is None for a in per["average_precision"]] == [j == 3 for j in range(p.shape[1])]
    assert all(len(v) == p.shape[1] for v in per.values())


def _selective_loop(p: np.ndarray, y: np.ndarray, conf: np.ndarray, m: int) -> tuple[float, float]:
    """Hamming loss and subset accuracy of the ``m`` most confident inputs (ties by input order)."""
    order = sorted(range(len(p)), key=lambda i: (-conf[i], i))[:m]
    wrong = (p[order] >= 0.5) != y[order].astype(bool)
    return float(wrong.mean()), float((~wrong.any(1)).mean())


def test_selective_against_a_loop():
    rng = np.random.default_rng(3)
    p = rng.random((200, 6))  # continuous: the default confidences have no ties
    y = (rng.random((200, 6)) < p).astype(np.int64)
    probs, labels = _t(p, y)
    conf = np.maximum(p, 1 - p).mean(1)  # the documented default confidence
    out = mm.selective(probs, labels, coverages=(0.25, 0.5, 0.9))
    for c in (0.25, 0.5, 0.9):
        ham, sub = _selective_loop(p, y, conf, math.ceil(c * len(p)))
        assert_close(out[f"hamming_loss_at_{int(100 * c)}"], ham, rtol=F64, what=f"Hamming at {c}")
        assert_close(out[f"subset_accuracy_at_{int(100 * c)}"], sub, rtol=F64, atol=F64, what=f"subset {c}")
    curve = [_selective_loop(p, y, conf, m) for m in range(1, len(p) + 1)]
    assert_close(out["aurc_hamming"], np.mean([h for h, _ in curve]), rtol=F64, what="AURC Hamming")
    assert_close(out["aurc_subset"], np.mean([1 - s for _, s in curve]), rtol=F64, what="AURC subset")
    with pytest.raises(BayescliError, match="confidence"):
        mm.selective(probs, labels, confidence=torch.zeros(3))


def test_selective_with_a_given_tied_confidence_keeps_input_order():
    p, y = _tied_data(n=200, seed=3)
    probs, labels = _t(p, y)
    conf = np.random.default_rng(4).integers(0, 5, len(p)).astype(np.float64)  # exact ties
    got = mm.selective(probs, labels, coverages=(0.3, 0.5), confidence=torch.from_numpy(conf))
    for c in (0.3, 0.5):
        ham, sub = _selective_loop(p, y, conf, math.ceil(c * len(p)))
        assert_close(got[f"hamming_loss_at_{int(100 * c)}"], ham, rtol=F64, what=f"tied Hamming at {c}")
        key = f"subset_accuracy_at_{int(100 * c)}"
        assert_close(got[key], sub, rtol=F64, atol=F64, what=f"tied subset accuracy at {c}")


def test_joint_energy_matches_its_definition_and_is_stable():
    rng = np.random.default_rng(6)
    f = rng.normal(0, 8, (50, 9)).clip(-30, 30)
    direct = np.log(1 + np.exp(f)).sum(1)  # fine in float64 at |f| ≤ 30
    assert_close(mm.joint_energy(torch.from_numpy(f)), direct, rtol=F64, what="JointEnergy, moderate logits")
    # float32 input: e^100 overflows float32, e^1000 overflows float64
    extreme = torch.tensor([[100.0, -100.0, 100.0], [-100.0, -100.0, -100.0], [1000.0, -1000.0, 0.0]])
    got = mm.joint_energy(extreme)
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    # log(1 + e^100) = 100 + log1p(e^-100) and log(1 + e^-100) = e^-100 (to float64 precision)
    expected = [200 + 3 * math.exp(-100), 3 * math.exp(-100), 1000 + math.log(2)]
    assert_close(got, expected, rtol=F64, what="JointEnergy at ±100 and ±1000")
    assert got[1] > 0  # the tail is not lost: e^-100 is representable


def test_ood_scores_are_oriented_for_ood_metrics():
    """In-distribution inputs fire one label confidently and reject the others confidently, with
    little epistemic MI; OOD inputs fire none, are unsure of all, and carry more MI. Every score
    must give ``ood_metrics`` an AUROC equal to scikit-learn's with in-distribution as the
    positive class, and well above 1/2."""
    rng = np.random.default_rng(7)
    logits_in = rng.normal(-3, 1, (150, 5))
    logits_in[np.arange(150), rng.integers(0, 5, 150)] += 6
    logits_out = rng.normal(-1, 1, (120, 5))
    mi_in, mi_out = rng.gamma(2, 0.01, (150, 5)), rng.gamma(2, 0.03, (120, 5))

    def scores(f: np.ndarray, mi: np.ndarray) -> dict:
        logits = torch.from_numpy(f)
        return mm.ood_scores(torch.sigmoid(logits), logits, torch.from_numpy(mi))

    s_in, s_out = scores(logits_in, mi_in), scores(logits_out, mi_out)
    p_in, p_out = 1 / (1 + np.exp(-logits_in)), 1 / (1 + np.exp(-logits_out))

    def h(p: np.ndarray) -> np.ndarray:
        return -(p * np.log(p) + (1 - p) * np.log(1 - p))

    direct = {
        "max_sigmoid": (p_in.max(1), p_out.max(1)),
        "neg_total_entropy": (-h(p_in).sum(1), -h(p_out).sum(1)),
        "joint_energy": (np.log1p(np.exp(logits_in)).sum(1), np.log1p(np.exp(logits_out)).sum(1)),
        "neg_mi_sum": (-mi_in.sum(1), -mi_out.sum(1)),
        "neg_mi_max": (-mi_in.max(1), -mi_out.max(1)),
    }
    assert set(s_in) == set(direct)
    truth = np.r_[np.ones(150), np.zeros(120)]
    for name, (d_in, d_out) in direct.items():
        assert_close(s_in[name], d_in, rtol=F64, atol=F64, what=f"{name} in")
        assert_close(s_out[name], d_out, rtol=F64, atol=F64, what=f"{name} out")
        auroc = ood_metrics(s_in[name], s_out[name])["auroc"]
        assert_close(auroc, roc_auc_score(truth, np.r_[d_in, d_out]), atol=F64, what=f"{name} AUROC")
        assert auroc > 0.75, f"{name}: AUROC {auroc:.3f}, the orientation is wrong"


def test_bad_shapes_and_values_raise_one_line():
    probs = torch.full((4, 3), 0.5)
    cases = [
        (lambda: mm.multilabel_summary(probs[0], torch.zeros(3)), "must be \\[N, K\\]"),
        (lambda: mm.multilabel_summary(probs, torch.zeros(4, 2)), "shape"),
        (lambda: mm.multilabel_summary(probs, torch.full((4, 3), 2)), "0 or 1"),
        (lambda: mm.multilabel_summary(probs + 1, torch.zeros(4, 3)), "\\[0, 1\\]"),
        (lambda: mm.multilabel_summary(probs * math.nan, torch.zeros(4, 3)), "\\[0, 1\\]"),
        (lambda: mm.ood_scores(probs, logits=torch.zeros(4, 2)), "logits"),
        (lambda: mm.mean_average_precision(probs, torch.zeros(4, 3)), "positive"),
    ]
    for call, pattern in cases:
        with pytest.raises(BayescliError, match=pattern) as info:
            call()
        assert "\n" not in str(info.value)


def test_map_accuracy_of_a_multilabel_net_is_per_label_and_its_warning_uses_a_coin_flip():
    from bayescli.metrics.classification import low_accuracy_warning, map_correct

    logits = torch.tensor([[2.0, -1.0, -3.0, 0.5], [-1.0, -2.0, 1.0, 1.0], [1.0, 1.0, 1.0, -1.0]])
    y = torch.tensor([[1, 0, 0, 0], [0, 0, 1, 1], [0, 1, 1, 0]])
    # labels right per input: 3/4, 4/4, 3/4 (a loop over the definition)
    expected = [sum((float(logits[i, k]) > 0) == bool(y[i, k]) for k in range(4)) / 4 for i in range(3)]
    assert map_correct(logits, y).tolist() == pytest.approx(expected, abs=0)
    assert map_correct(logits, y).mean().item() == pytest.approx(10 / 12)
    # a well-fed net: 83% of labels right though only one input has every label right (subset 33%)
    assert low_accuracy_warning(10 / 12, 4, "the data", multilabel=True) is None
    # the softmax rule would call 33% (subset accuracy) fed wrongly; below a coin flip per label is
    message = low_accuracy_warning(0.45, 4, "the data", multilabel=True)
    assert message is not None and "per-label MAP accuracy on the data is 45.0% (chance 50.0%)" in message
    assert low_accuracy_warning(0.45, 4, "the data") is not None


def test_low_accuracy_warning_for_two_classes_warns_only_below_chance():
    from bayescli.metrics.classification import low_accuracy_warning

    # 2× chance is 100% for K = 2: a 99.7%-accurate binary classifier is not fed wrongly
    assert low_accuracy_warning(0.997, 2, "the data") is None
    assert low_accuracy_warning(0.55, 2, "the data") is None
    assert "MAP accuracy on the data is 45.0% (chance 50.0%)" in low_accuracy_warning(0.45, 2, "the data")
    # K > 2 keeps the 2×-chance rule
    assert low_accuracy_warning(0.6, 3, "the data") is not None
    assert low_accuracy_warning(0.7, 3, "the data") is None
