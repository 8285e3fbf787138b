"""Issue 37, part 1: NLL is exact on a net whose wrong answers have p < 1e-30 (no 1e-12 cap), and
every path that scores MAP (metrics, selection's criteria, select's leaderboard, temperature)
gives the same MAP NLL; temperature chosen on the exact score cools such a net (T > 1)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

import bayescli
from bayescli.data import load_data
from bayescli.features import extract_features
from bayescli.fitting import ModelOptions, fit_from_specs
from bayescli.io import load_tensors, save_tensors
from bayescli.laplace_fit import LaplaceSettings
from bayescli.metrics import classification_summary, map_log_probabilities, nll
from bayescli.model_selection import score_probs
from bayescli.models import load_classifier
from bayescli.posterior.base import load_posterior
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


# ---------------------------------------------------------------------------------------------
# every path on a confident net: predict CLI, evaluate CLI, select, temperature, the API
# ---------------------------------------------------------------------------------------------

# The digits CNN's head scaled by this: margins of hundreds of nats, so its wrong answers have
# p < 1e-30 (most underflow to 0 in float32) and most float32 max-probabilities are exactly 1.0.
HEAD_SCALE = 60.0


@pytest.fixture(scope="module")
def confident_ckpt(digits_ckpt, tmp_path_factory) -> Path:
    """The digits CNN with its head (the last Linear: weight ``[10, D]`` and bias) scaled by
    ``HEAD_SCALE``, saved as a builtin checkpoint like ``bayescli train`` writes."""
    tensors, meta = load_tensors(digits_ckpt)
    head = [k for k, v in tensors.items() if k.endswith(".weight") and v.dim() == 2 and v.shape[0] == 10][-1]
    prefix = head[: -len("weight")]
    for key in (head, prefix + "bias"):
        tensors[key] = tensors[key] * HEAD_SCALE
    path = tmp_path_factory.mktemp("confident") / "cnn.safetensors"
    save_tensors(path, tensors, meta)
    return path


def _oracle_nll(ckpt: Path, spec: str) -> tuple[float, torch.Tensor]:
    """−mean log p(y) of the net on ``spec`` from its float32 logits, by a float64 NumPy
    log-sum-exp (independent of bayescli's metrics); and the logits."""
    feats = extract_features(load_classifier("builtin:small-cnn", ckpt), load_data(spec))
    z, y = feats.logits.double().numpy(), feats.labels.numpy()
    logp = z - logsumexp(z, axis=1, keepdims=True)
    return float(-logp[np.arange(len(y)), y].mean()), feats.logits


@pytest.fixture(scope="module")
def confident_posterior(confident_ckpt, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("confident_post") / "post.safetensors"
    model = ModelOptions("builtin:small-cnn", confident_ckpt)
    fit_from_specs("laplace", model, "digits:train", settings=LaplaceSettings(hessian="diag"), out=path)
    return path


def test_every_path_gives_the_exact_map_nll_on_a_confident_net(
    cli, confident_ckpt, confident_posterior, tmp_path
):
    test_nll, logits = _oracle_nll(confident_ckpt, "digits:test")
    probs32 = logits.softmax(-1)
    wrong = logits.argmax(-1) != load_data("digits:test").y
    assert wrong.any() and (probs32[wrong].min(-1).values < 1e-30).all()
    assert (probs32.max(-1).values == 1.0).double().mean() > 0.5  # saturated
    # the 1e-12 cap would have counted each wrong input at most 27.6 nats: far below the truth
    capped = -probs32.double().clamp_min(1e-12).gather(1, load_data("digits:test").y[:, None]).log().mean()
    assert test_nll > 2 * capped.item()
    # float32 logits in the hundreds, one float64 log-softmax each side: relative 1e-6 is > 100×
    tol = 1e-6 * test_nll

    out = tmp_path / "pred.json"
    res = cli("predict", "--posterior", confident_posterior, "--data", "digits:test", "--link", "none",
              "--out", out, "-q")  # fmt: skip
    assert res.code == 0, res.err
    rows = json.loads(out.read_text())["results"]
    assert abs(rows["map"]["nll"] - test_nll) <= tol, rows["map"]
    assert abs(rows["glm-none"]["nll"] - test_nll) <= tol, rows["glm-none"]  # GLM mean = MAP logits

    report = tmp_path / "eval.json"
    res = cli("evaluate", "--posterior", confident_posterior, "--data", "digits:test", "--methods",
              "map,glm-probit,glm-bridge,glm-mc", "--samples", "50", "--fidelity-inputs", "0",
              "--out", report, "-q")  # fmt: skip
    assert res.code == 0, res.err
    in_dist = json.loads(report.read_text())["results"]["in_distribution"]
    assert abs(in_dist["map"]["nll"] - test_nll) <= tol, in_dist["map"]
    for name in ("glm-probit", "glm-bridge", "glm-mc"):  # each link's own log-probabilities: finite
        assert math.isfinite(in_dist[name]["nll"]), (name, in_dist[name])

    val_nll, val_logits = _oracle_nll(confident_ckpt, "digits:val")
    t, sel = fit_temperature(val_logits, load_data("digits:val").y)
    assert abs(sel.map_scores["nll"] - val_nll) <= 1e-6 * val_nll

    board, _ = bayescli.select(
        load_classifier("builtin:small-cnn", confident_ckpt),
        "digits:train",
        "digits:val",
        methods=["temperature"],
    )
    assert abs(board["map"]["nll"] - val_nll) <= 1e-6 * val_nll, board["map"]
    # select's temperature is evaluate's: the exact score cools the net, and beats MAP on validation
    assert board["methods"]["temperature"]["nll"] < board["map"]["nll"]

    post = load_posterior(confident_posterior)
    pred = post.predict("digits:test", link="none")  # the API: the posterior remembers its model
    assert abs(nll(pred.probs, load_data("digits:test").y, pred.log_probs) - test_nll) <= tol
    api_report = bayescli.evaluate(post, "digits:test", methods="map", fidelity_inputs=0)
    assert abs(api_report["results"]["in_distribution"]["map"]["nll"] - test_nll) <= tol
