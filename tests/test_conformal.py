"""Split conformal sets: scores against a per-input loop, the finite-sample coverage band on
exchangeable data, the summaries against direct counting, top-k matching, and the CLI."""

import json
import math

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from tolerance import assert_close

from bayescli.errors import BayescliError
from bayescli.predictive import conformal as cp
from bayescli.predictive.topk import topk_sizes

F64 = 1e-12  # float64 sums of ≤ 10 probabilities: rounding ≤ 1e-15


def _probs(n: int, k: int, rng: np.random.Generator, scale: float = 2.0) -> np.ndarray:
    z = rng.normal(0, scale, (n, k))
    return np.exp(z - logsumexp(z, axis=1, keepdims=True))


def _score_loop(p: np.ndarray, y: int, score: str, u: float, lam: float, k_reg: int) -> float:
    """DESIGN §4 / the module docstring, one input and one label at a time."""
    if score == "lac":
        return 1 - p[y]
    order = sorted(range(len(p)), key=lambda j: (-p[j], j))
    rank = order.index(y) + 1
    before = sum(p[j] for j in order[: rank - 1])
    if score == "aps":
        return before + p[y]
    s = before + u * p[y]
    return s + (lam * max(0, rank - k_reg) if score == "raps" else 0.0)


def test_label_scores_against_loop():
    rng = np.random.default_rng(0)
    p = _probs(40, 7, rng)
    p[0, :3] = p[0, 0]  # ties are ranked by class index
    p[0] /= p[0].sum()
    u = rng.random(40)
    for score in cp.ConformalScore:
        cfg = cp.ConformalConfig(score, 0.1, lam=0.3, k_reg=2)
        ours = cp.label_scores(torch.from_numpy(p), cfg, torch.from_numpy(u)).numpy()
        loop = [[_score_loop(p[i], y, score.value, u[i], 0.3, 2) for y in range(7)] for i in range(40)]
        assert_close(ours, loop, atol=F64, what=f"{score.value} scores")
        labels = rng.integers(0, 7, 40)
        at_labels = cp.true_label_scores(
            torch.from_numpy(p), torch.from_numpy(labels), cfg, torch.from_numpy(u)
        )
        expected = [loop[i][labels[i]] for i in range(40)]
        assert_close(at_labels, expected, atol=F64, what=f"{score.value} scores at the labels (no sort)")


def test_threshold_rank_and_too_few_points():
    scores = torch.arange(1.0, 10.0)  # n = 9
    assert cp.threshold(scores, 0.1) == 9.0  # ⌈10·0.9⌉ = 9th smallest
    assert cp.threshold(scores, 0.35) == 7.0  # ⌈10·0.65⌉ = 7
    with pytest.raises(BayescliError, match="calibration points"):
        cp.threshold(scores[:8], 0.1)  # ⌈9·0.9⌉ = 9 > 8


def test_split_conformal_coverage_in_finite_sample_band():
    """Exchangeable data (labels drawn from the model's own probabilities, any model would do):
    over 200 seeded splits with n = 19 calibration points and α = 0.125, the expected coverage is
    exactly ⌈20·0.875⌉/20 = 0.9, the middle of the band [0.875, 0.925]. The split-to-split spread
    is Beta(18, 2)'s (sd 0.066) plus the 1000 test points' (sd 0.009): the mean over 200 splits
    has a standard error of 0.0047, so the band's half-width 0.025 is 5.3 standard errors."""
    rng = np.random.default_rng(0)
    n_cal, n_test, alpha, k = 19, 1000, 0.125, 5
    low, high = 1 - alpha, 1 - alpha + 1 / (n_cal + 1)
    coverage = {s: [] for s in cp.ConformalScore}
    for split in range(200):
        p = _probs(n_cal + n_test, k, rng)
        y = (p.cumsum(1) > rng.random((len(p), 1))).argmax(1)
        probs, labels = torch.from_numpy(p), torch.from_numpy(y)
        for score in cp.ConformalScore:
            cfg = cp.ConformalConfig(score, alpha)
            q = cp.calibrate(probs[:n_cal], labels[:n_cal], cfg, seed=split)
            sets = cp.prediction_sets(probs[n_cal:], q, cfg, seed=10_000 + split)
            coverage[score].append(cp.set_summary(sets, labels[n_cal:])["coverage"])
    for score, values in coverage.items():
        mean = float(np.mean(values))
        assert low <= mean <= high, f"{score.value}: mean coverage {mean:.4f} outside [{low}, {high:.4f}]"


def test_set_summary_against_counting():
    rng = np.random.default_rng(2)
    sets = rng.random((300, 4)) < 0.4
    y = rng.integers(0, 4, 300)
    out = cp.set_summary(torch.from_numpy(sets), torch.from_numpy(y))
    sizes = sets.sum(1)
    hit = sets[np.arange(300), y]
    assert_close(out["mean_size"], sizes.mean(), rtol=F64, what="mean size")
    assert out["size_histogram"] == {str(s): int((sizes == s).sum()) for s in range(5) if (sizes == s).any()}
    assert_close(out["coverage"], hit.mean(), atol=F64, what="coverage")
    for s, cov in out["coverage_by_size"].items():
        assert_close(cov, hit[sizes == int(s)].mean(), atol=F64, what=f"coverage at size {s}")
    for c, cov in out["coverage_by_class"].items():
        assert_close(cov, hit[y == int(c)].mean(), atol=F64, what=f"coverage of class {c}")


def test_sets_are_prefixes_of_the_ranking():
    rng = np.random.default_rng(3)
    probs = torch.from_numpy(_probs(200, 6, rng))
    ranks = probs.argsort(-1, descending=True).argsort(-1)  # rank of each class, 0-based
    for score in cp.ConformalScore:
        cfg = cp.ConformalConfig(score, 0.2)
        sets = cp.prediction_sets(probs, 0.7, cfg, seed=0)
        size = sets.sum(-1, keepdim=True)
        assert torch.equal(sets, ranks < size), score.value


def test_topk_curve_matches_algorithm_1():
    rng = np.random.default_rng(4)
    alpha = torch.from_numpy(rng.gamma(1.0, 5.0, (150, 8)) + 0.05)
    labels = torch.from_numpy(rng.integers(0, 8, 150))
    curve = cp.TopkCurve(alpha, labels, max_k=8)
    for t in np.exp(np.linspace(math.log(1e-9), math.log(0.9), 25)):
        # levels within the bisection's resolution (2^-50 of the log range) of an input's
        # critical level are ambiguous; none of these 25 is that close
        assert np.array_equal(curve.sizes(t), topk_sizes(alpha, t, 8)[1]), t
    for target in (1.0, 1.7, 2.5, 4.0):
        got = curve.at_mean_size(target)
        order, k = topk_sizes(alpha, got["threshold"], 8)
        assert_close(got["mean_size"], k.mean(), atol=F64, what="matched mean size")
        # no level on a dense grid comes closer to the target than the matched one
        grid = [topk_sizes(alpha, t, 8)[1].mean() for t in np.exp(np.linspace(-28, -1e-9, 300))]
        assert abs(got["mean_size"] - target) <= min(abs(g - target) for g in grid) + 1e-12
        inside = [int(labels[i]) in order[i, : k[i]].tolist() for i in range(150)]
        assert_close(got["coverage"], np.mean(inside), atol=F64, what="top-k coverage")
    # Dirichlets so concentrated that no class ever overlaps the next: size 1 at every level
    sharp_alpha = torch.tensor([[1e9, 1.0, 1.0], [5.0, 1e9, 2.0]], dtype=torch.float64)
    sharp = cp.TopkCurve(sharp_alpha, None)
    assert sharp.at_mean_size(2.5)["mean_size"] == 1.0
    assert list(sharp.sizes(1e-12)) == list(topk_sizes(sharp_alpha, 1e-12, 3)[1]) == [1, 1]


def test_conformal_cli(cli, digits_posterior, tmp_path):
    out = tmp_path / "sets.json"
    base = ["conformal", "--posterior", digits_posterior, "--data", "digits:test", "--alpha", "0.1"]
    res = cli(*base, "--method", "temp", "--score", "raps", "--out", out, "--quiet")
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert report["method"] == "temp" and report["lambda"] == 0.01 and report["k_reg"] == 5
    assert report["temperature"]["data"].startswith("seeded half of digits:val")
    assert len(report["sets"]) == 359 == sum(summary["size_histogram"].values())  # digits:test size
    assert summary["coverage"] == np.mean([r["label"] in r["classes"] for r in report["sets"]])
    assert summary["topk_same_size"]["mean_size"] >= 1
    res = cli(*base, "--method", "glm-bridge-norm", "--score", "aps", "--json")
    assert res.code == 0, res.err
    assert json.loads(res.out)["score"] == "aps"
    for args, needle in (
        (["--score", "magic"], "unknown score"),
        (["--calibration-data", "digits:test"], "disjoint"),
        (["--method", "glm-nope"], "unknown method"),
        (["--alpha", "1.5"], "alpha"),
    ):
        res = cli(*base, *args)
        assert res.code == 2 and needle in res.err, (args, res.err)


def test_coverage_interval_is_clopper_pearson():
    """Issue 23: conformal coverage on a few hundred points comes with its exact binomial 95 %
    interval (scipy's binomtest is the independent reference), also at the ends 0 and n."""
    from scipy.stats import binomtest

    for hits, n in [(190, 216), (0, 216), (216, 216), (1, 3), (49, 50)]:
        ref = binomtest(hits, n).proportion_ci(confidence_level=0.95, method="exact")
        lo, hi = cp.coverage_interval(hits, n)
        assert_close(lo, ref.low, rtol=1e-9, atol=1e-12, what=f"lower bound {hits}/{n}")
        assert_close(hi, ref.high, rtol=1e-9, atol=1e-12, what=f"upper bound {hits}/{n}")
    sets = torch.zeros(216, 3, dtype=torch.bool)
    sets[:190, 0] = True
    out = cp.set_summary(sets, torch.zeros(216, dtype=torch.long))
    assert out["coverage_ci"] == cp.coverage_interval(190, 216)
    assert out["coverage_ci"][0] < out["coverage"] < out["coverage_ci"][1]
