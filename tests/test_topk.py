import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import beta

from bayescli.predictive.topk import topk_summary, uncertainty_topk


def algorithm_1(alpha: np.ndarray, threshold: float, max_k: int) -> list[int]:
    """Direct, unvectorised transcription of the seed's Algorithm 1 for one input."""
    order = np.argsort(-alpha, kind="stable")
    a_sorted = alpha[order]
    a0 = alpha.sum()
    chosen = [int(order[0])]
    for i in range(1, len(alpha)):
        if len(chosen) == max_k:
            break
        left_prev = beta(a_sorted[i - 1], a0 - a_sorted[i - 1]).ppf(threshold / 2)
        right_cur = beta(a_sorted[i], a0 - a_sorted[i]).ppf(1 - threshold / 2)
        if right_cur > left_prev:
            chosen.append(int(order[i]))
        else:
            break
    return chosen


@settings(max_examples=40, deadline=None)
@given(
    alpha=st.lists(st.floats(0.05, 300.0), min_size=2, max_size=12),
    threshold=st.sampled_from([0.01, 0.05, 0.2]),
    max_k=st.integers(1, 12),
)
def test_vectorised_topk_equals_algorithm_1(alpha, threshold, max_k):
    a = np.array(alpha)
    ours = uncertainty_topk(torch.tensor(a)[None], threshold, max_k)[0].tolist()
    assert ours == algorithm_1(a, threshold, max_k)


def test_batch_of_inputs():
    gen = torch.Generator().manual_seed(0)
    alpha = (
        torch.rand(200, 10, generator=gen, dtype=torch.float64)
        * torch.logspace(-1, 3, 200, dtype=torch.float64)[:, None]
    )
    sets = uncertainty_topk(alpha, 0.05, 10)
    for i in range(200):
        assert sets[i].tolist() == algorithm_1(alpha[i].numpy(), 0.05, 10)
    sizes = [len(s) for s in sets]
    assert min(sizes) == 1 and max(sizes) > 3  # confident rows get 1 class, flat rows many


def test_summary_counts():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]])
    sets = [torch.tensor([0]), torch.tensor([0, 1])]
    summary = topk_summary(sets, probs, torch.tensor([0, 1]), max_k=3)
    assert summary["mean_k"] == 1.5 and summary["set_accuracy"] == 1.0 and summary["top1_accuracy"] == 0.5
    assert summary["k_histogram"] == {"1": 1, "2": 1, "3": 0}
    assert summary["fixed_topk_accuracy"] == {"1": 0.5, "2": 1.0, "3": 1.0}


def test_set_accuracy_is_label_in_set_not_top1_or_fixed_k():
    # row 1: top-1 right; rows 2–3: top-1 wrong, label in the set (row 3 at the set's third
    # place); row 4: label outside both the set and the top-2. Each accuracy differs.
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.2, 0.5], [0.45, 0.5, 0.05]])
    sets = [torch.tensor([0]), torch.tensor([1, 2]), torch.tensor([2, 0, 1]), torch.tensor([1])]
    labels = torch.tensor([0, 2, 1, 2])
    direct = np.mean([int(labels[i]) in s.tolist() for i, s in enumerate(sets)])
    summary = topk_summary(sets, probs, labels, max_k=3)
    assert direct == 0.75 and summary["set_accuracy"] == direct
    assert summary["top1_accuracy"] == 0.25
    assert summary["fixed_topk_accuracy"] == {"1": 0.25, "2": 0.5, "3": 1.0}
    assert summary["mean_k"] == 1.75 and summary["k_histogram"] == {"1": 2, "2": 1, "3": 1}


def test_set_accuracy_uses_the_sets_not_the_probability_ranking():
    # sets from α need not be the top-|set| classes of probs (another link's probabilities, or
    # ties): here each set skips the most probable class, so label-in-set differs from top-|set|
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.2, 0.7, 0.1]])
    sets = [torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([0])]
    labels = torch.tensor([2, 2, 1])
    direct = np.mean([int(labels[i]) in s.tolist() for i, s in enumerate(sets)])
    ranked = probs.argsort(-1, descending=True)
    top_size = np.mean([int(labels[i]) in ranked[i, : len(s)].tolist() for i, s in enumerate(sets)])
    assert direct == 2 / 3 and top_size == 1 / 3  # the two readings differ on this table
    assert topk_summary(sets, probs, labels, max_k=3)["set_accuracy"] == direct


def test_beta_marginals_match_scipy_below_and_their_limits_above_the_exact_range():
    from scipy.stats import norm

    from bayescli.predictive import topk

    a = np.array([0.3, 5.0, 150.0, 2e3])
    b = np.array([40.0, 900.0, 4e4, 9e4])
    got = topk.BetaMarginals(a, b).ppf(0.975)
    assert np.allclose(got, beta(a, b).ppf(0.975), rtol=1e-12, atol=0)
    # α₀ = 1e12: both sides large → normal with the Beta's mean and variance; a small side → the
    # Gamma limit G/(G + b); an infinite side → a point mass
    big_a, big_b = np.array([3e11, 2.0, 1e12, np.inf, 7.0]), np.array([7e11, 1e12, 4.0, 5.0, np.inf])
    marg = topk.BetaMarginals(big_a, big_b)
    assert not marg.exact.any()
    q = marg.ppf(0.025)
    m = 0.3
    assert np.isclose(q[0], m + norm.ppf(0.025) * np.sqrt(m * (1 - m) / (1e12 + 1)), rtol=1e-12)
    # where scipy is still usable (slowly) the limits agree with it to a part in 1e6 of the spread
    exact = beta(big_a[:3], big_b[:3]).ppf(0.025)
    spread = beta(big_a[:3], big_b[:3]).std()
    assert np.all(np.abs(q[:3] - exact) <= 1e-3 * spread), (q[:3] - exact) / spread
    assert q[3] == 1.0 and q[4] == 0.0


def test_confident_dirichlets_take_no_slow_scipy_path_and_warn_nothing(monkeypatch):
    import warnings

    from bayescli.predictive import conformal, topk

    def slow(a, b, q):
        assert not np.size(a), f"scipy's exact Beta at α₀ = {np.add(a, b).max():.3g}"
        return np.zeros(0)

    gen = torch.Generator().manual_seed(1)
    alpha = torch.rand(300, 10, generator=gen, dtype=torch.float64) * 1e12 + 1e9
    alpha[:100, 3] = torch.inf  # a point-mass bridge: α overflowed on the top class
    alpha[100:150] = torch.inf  # every class infinite: a uniform point mass
    monkeypatch.setattr(topk, "betaincinv", slow)
    monkeypatch.setattr(topk, "betainc", slow)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        order, k = topk.topk_sizes(alpha, 0.05, 10)
        curve = conformal.TopkCurve(alpha, None)
    assert (order[:100, 0] == 3).all() and (k[:100] == 1).all()
    # a uniform point mass: equal values never overlap strictly (Algorithm 1's ">")
    assert (k[100:150] == 1).all() and (curve.sizes(1e-9)[:150] == 1).all()
    # the finite rows: the limits' sizes (normal marginals) by the direct comparison
    m = alpha[150:].numpy() / alpha[150:].numpy().sum(1, keepdims=True)
    a0 = alpha[150:].numpy().sum(1, keepdims=True)
    s = np.sqrt(m * (1 - m) / (a0 + 1))
    srt = np.argsort(-m, axis=1, kind="stable")
    ms, ss = np.take_along_axis(m, srt, 1), np.take_along_axis(s, srt, 1)
    z = 1.959963984540054
    overlap = ms[:, 1:] + z * ss[:, 1:] > ms[:, :-1] - z * ss[:, :-1]
    assert np.array_equal(k[150:], 1 + np.cumprod(overlap, axis=1).sum(1))
    assert np.array_equal(curve.sizes(0.05)[150:], k[150:])
