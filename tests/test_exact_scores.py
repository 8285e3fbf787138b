"""Issue 37, part 1: NLL is exact on a net whose wrong answers have p < 1e-30 (no 1e-12 cap), and
every path that scores MAP (metrics, selection's criteria, select's leaderboard, temperature)
gives the same MAP NLL; temperature chosen on the exact score cools such a net (T > 1)."""

from __future__ import annotations

import math

import torch

from bayescli.metrics import classification_summary, map_log_probabilities, nll
from bayescli.model_selection import score_probs
from bayescli.posterior.selection import scores
from bayescli.posterior.temperature import fit_temperature

MARGIN = 80.0  # nats between the predicted class and every other: p(wrong) = e^-80 / (1 + 9 e^-80)


def overconfident(n: int = 200, k: int = 10, wrong_every: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[n, k]`` with the arg-max ``MARGIN`` above every other class, and labels ``[n]``:
    every ``wrong_every``-th label is a non-arg-max class."""
    pred = torch.arange(n) % k
    logits = torch.zeros(n, k)
    logits[torch.arange(n), pred] = MARGIN
    labels = pred.clone()
    wrong = torch.arange(0, n, wrong_every)
    labels[wrong] = (pred[wrong] + 1) % k
    return logits, labels


def analytic_nll(n: int, k: int, wrong_every: int) -> float:
    """The mean −log p(y) of :func:`overconfident`, from the logits by hand."""
    log_z = MARGIN + math.log1p((k - 1) * math.exp(-MARGIN))
    wrong = len(range(0, n, wrong_every))
    return (wrong * (log_z - 0.0) + (n - wrong) * (log_z - MARGIN)) / n


def test_nll_is_exact_where_wrong_answers_have_p_below_1e30():
    logits, labels = overconfident()
    expected = analytic_nll(200, 10, 10)
    assert abs(expected - MARGIN / 10) < 1e-12  # ≈ 8 nats a row: 80 per wrong row, not 27.6
    probs32 = logits.softmax(-1)
    assert probs32[0, 1].item() < 1e-30
    # every path: float32 probabilities, float64 log-softmax, the selection criteria, the
    # leaderboard's scores, the summary and the temperature curve at T = 1
    logp = map_log_probabilities(logits)
    paths = {
        "nll(probs32)": nll(probs32, labels),
        "nll(log_probs)": nll(probs32, labels, logp),
        "summary": classification_summary(probs32, labels, logp)["nll"],
        "selection": scores(probs32, labels, logp)["nll"],
        "selection(probs)": scores(probs32, labels)["nll"],
        "leaderboard": score_probs(probs32, labels, logp)["nll"],
        "temperature T=1": fit_temperature(logits, labels)[1].map_scores["nll"],
    }
    for name, value in paths.items():
        # float32 probabilities carry a relative rounding of 2^-24 in p: |Δ log p| ≤ 1.2e-7
        assert abs(value - expected) <= 2e-7 * expected, (name, value, expected)


def test_log_probabilities_stay_exact_beyond_float32_underflow():
    logits, labels = overconfident()
    logits = logits * 20  # margin 1600: softmax underflows to exactly 0 in float32 and float64
    probs = logits.softmax(-1)
    assert probs[0, 1].item() == 0.0
    got = nll(probs, labels, map_log_probabilities(logits))
    assert abs(got - 20 * analytic_nll(200, 10, 10)) <= 1e-12 * got


def test_temperature_on_exact_scores_cools_an_overconfident_net():
    logits, labels = overconfident()
    t, sel = fit_temperature(logits, labels)
    assert t > 1, t
    assert sel.curve and min(r["nll"] for r in sel.curve) < sel.map_scores["nll"]
