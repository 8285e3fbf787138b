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
from bayescli.fitting.fit_source import FitSource
from bayescli.fitting.laplace import LaplaceSettings
from bayescli.fitting.pipeline import ModelOptions, fit_from_specs
from bayescli.fitting.select import score_probs
from bayescli.io import load_tensors, save_tensors
from bayescli.metrics.classification import (
    classification_summary,
    map_log_probabilities,
    nll,
    ood_metrics,
    tied_fraction,
)
from bayescli.models.features import extract_features
from bayescli.models.specs import load_classifier
from bayescli.posterior.base import load_posterior
from bayescli.posterior.gaussian import LogitGaussian
from bayescli.posterior.selection import scores
from bayescli.posterior.temperature import fit_temperature
from bayescli.posterior.vi.bernoulli_expectations import sigmoid_predictive
from bayescli.posterior.vi.mnvi import MNVIConfig
from bayescli.posterior.vi.mnvi import fit as fit_mnvi
from bayescli.posterior.vi.softmax_expectations import log_mean_softmax
from bayescli.predictive.dirichlet import mean as dirichlet_mean
from bayescli.predictive.links import apply_link
from bayescli.predictive.sigmoid_links import apply_sigmoid_link

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


# ---------------------------------------------------------------------------------------------
# each link's own log-probabilities, against float64 NumPy oracles, where probabilities saturate
# ---------------------------------------------------------------------------------------------


def _saturated_gaussian(n: int = 40, k: int = 6, margin: float = 150.0) -> LogitGaussian:
    """Logit Gaussians whose arg-max leads by ``margin`` nats: float32 softmax of the rest is 0."""
    gen = torch.Generator().manual_seed(3)
    mean = torch.randn(n, k, generator=gen)
    mean[torch.arange(n), torch.arange(n) % k] += margin
    return LogitGaussian(mean, torch.rand(n, k, generator=gen) * 0.5 + 0.05)


def test_probit_and_none_log_probs_are_the_float64_log_softmax():
    lg = _saturated_gaussian()
    mu, var = lg.mean.double().numpy(), lg.var.double().numpy()
    scaled = (lg.var * (math.pi / 8) + 1).rsqrt() * lg.mean  # the link's float32 scaled mean
    for link, z in (("none", mu), ("probit", scaled.double().numpy())):
        out = apply_link(LogitGaussian(lg.mean.clone(), lg.var.clone()), link)
        oracle = z - logsumexp(z, axis=1, keepdims=True)
        assert (out.probs == 0).any() and np.isfinite(out.log_probs.numpy()).all()
        # float64 on both sides of the same float32 inputs: a few ulps of values ≲ 200
        np.testing.assert_allclose(out.log_probs.numpy(), oracle, rtol=1e-12, atol=1e-11, err_msg=link)
    del var


def test_mc_log_probs_are_the_logsumexp_of_the_draws():
    lg = _saturated_gaussian(n=8)
    samples = 300
    out = apply_link(lg, "mc", samples, torch.Generator().manual_seed(11))
    # the same draws (one chunk, the generator's first numbers), the mean in float64 by NumPy
    eps = torch.empty(8, lg.mean.shape[1], samples).normal_(generator=torch.Generator().manual_seed(11))
    z = (lg.mean.unsqueeze(-1) + eps * lg.var.sqrt().unsqueeze(-1)).double().numpy()
    log_soft = z - logsumexp(z, axis=1, keepdims=True)
    oracle = logsumexp(log_soft, axis=2) - math.log(samples)
    assert (out.probs == 0).any()
    # float32 draws of logits ≈ 150: the float32 log-softmax carries ~1e-5 absolute error
    np.testing.assert_allclose(out.log_probs.numpy(), oracle, rtol=1e-6, atol=1e-4)


def test_bridge_log_probs_where_alpha_overflows_float64():
    k = 5
    mean = torch.zeros(4, k, dtype=torch.float64)
    mean[:, 0] = torch.tensor([900.0, 2.0, 760.0, 0.5])
    var = torch.full((4, k), 1e-3, dtype=torch.float64)
    var[2] = 1e-20  # α ≈ e^760 / 1e-20: beyond float64
    out = apply_link(LogitGaussian(mean, var), "bridge", correction="none")
    assert torch.isinf(out.alpha).any()  # the case: α overflowed
    assert torch.isfinite(out.probs).all() and torch.isfinite(out.log_probs).all()
    # oracle: eq. 7 in log space with NumPy, log α_k = log(e^{t_k} + 1 − 2/K) − log Σ_kk
    m, v = mean.numpy(), var.numpy()
    t = m + logsumexp(-m, axis=1, keepdims=True) - 2 * math.log(k)
    log_alpha = np.logaddexp(t, math.log(1 - 2 / k)) - np.log(v)
    oracle = log_alpha - logsumexp(log_alpha, axis=1, keepdims=True)
    np.testing.assert_allclose(out.log_probs.numpy(), oracle, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(out.probs.double().numpy(), np.exp(oracle), rtol=1e-12, atol=1e-15)
    assert not torch.isnan(dirichlet_mean(out.alpha)).any()  # α = ∞: its mean is a point mass, not NaN


def test_sodpp_log_probs_match_its_probabilities_and_stay_finite():
    lg = _saturated_gaussian()
    out = apply_link(lg, "sodpp")
    assert torch.isfinite(out.log_probs).all() and (out.log_probs < -100).any()
    big = out.probs > 1e-6  # where float32 holds the probability, the two agree to its rounding
    torch.testing.assert_close(out.log_probs[big].exp(), out.probs[big].double(), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# OOD on a saturated net: ties reported, the log-space score not the artefact
# ---------------------------------------------------------------------------------------------


def test_ood_reports_ties_and_ranks_max_prob_in_log_space():
    from bayescli.evaluation.methods import MethodOutput, _base_scores
    from bayescli.evaluation.runner import _tie_notes

    gen = torch.Generator().manual_seed(0)
    n, k = 400, 10
    # in-distribution margins 60–140 nats, OOD 30–90: ≥ 50% of both saturate at 1.0 in float32
    z_in = torch.zeros(n, k)
    z_in[:, 0] = 60 + 80 * torch.rand(n, generator=gen)
    z_out = torch.zeros(n, k)
    z_out[:, 0] = 30 + 60 * torch.rand(n, generator=gen)
    outs = {}
    for name, z in (("in", z_in), ("out", z_out)):
        logp = map_log_probabilities(z)
        outs[name] = MethodOutput(z.softmax(-1), _base_scores(z.softmax(-1), logp), {}, logp)
    p_out = outs["out"].probs.max(-1).values
    assert (p_out == 1.0).double().mean() >= 0.5
    float32_auroc = ood_metrics(outs["in"].probs.max(-1).values, p_out)["auroc"]
    log_auroc = ood_metrics(outs["in"].scores["max_prob"], outs["out"].scores["max_prob"])["auroc"]
    # oracle: the margins themselves rank the inputs (max-prob is monotone in the margin)
    exact = ood_metrics(z_in[:, 0], z_out[:, 0])["auroc"]
    assert abs(log_auroc - exact) < 1e-12 and abs(float32_auroc - exact) > 0.05
    rows = {
        "map": {
            "mmc": 1.0,
            "max_prob": ood_metrics(outs["in"].scores["max_prob"], outs["out"].scores["max_prob"]),
        }
    }
    notes = _tie_notes("noise", {"map": outs["in"]}, {"map": outs["out"]}, rows)
    share = tied_fraction(torch.cat([outs["in"].probs.max(-1).values, p_out]))
    assert rows["map"]["max_prob"]["float32_tied_fraction"] == share > 0.5
    assert len(notes) == 1 and f"saturated at 1.0 in float32 (map {share:.1%}" in notes[0], notes
    # the opposite: unsaturated scores, nothing reported
    calm = {"map": MethodOutput((z_in / 40).softmax(-1), {}, {}, None)}
    calm_out = {"map": MethodOutput((z_out / 40).softmax(-1), {}, {}, None)}
    rows = {"map": {"mmc": 0.5, "max_prob": {"tied_fraction": 0.0}}}
    assert (
        _tie_notes("noise", calm, calm_out, rows) == []
        and rows["map"]["max_prob"]["float32_tied_fraction"] == 0
    )


def test_tied_fraction_counts_every_member_of_a_tie():
    assert tied_fraction(torch.tensor([1.0, 1.0, 0.5, 0.2, 0.2, 0.1])) == 4 / 6
    assert tied_fraction(torch.tensor([0.3, 0.2, 0.1])) == 0.0
    assert ood_metrics(torch.tensor([0.9, 0.8]), torch.tensor([0.1, 0.2]))["tied_fraction"] == 0.0
    assert ood_metrics(torch.ones(3), torch.ones(3))["tied_fraction"] == 1.0


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_topk_and_conformal_on_a_confident_net_raise_no_numpy_warnings(cli, confident_posterior, tmp_path):
    """Issue 37, part 2: on a net whose Dirichlet α reach float64's range (the bridge of margins
    in the hundreds), top-k, conformal and evaluate's conformal section finish without a raw
    NumPy RuntimeWarning (overflow in exp, invalid value in subtract, ...) reaching the user; a
    RuntimeWarning anywhere in-process is an error here."""
    common = ["--posterior", confident_posterior, "--data", "digits:test", "--device", "cpu", "-q"]
    runs = {
        "topk": ["topk", *common, "--out", tmp_path / "topk.json"],
        "conformal": ["conformal", *common, "--method", "glm-bridge", "--score", "aps",
                      "--out", tmp_path / "c.json"],
        "conformal-probit": ["conformal", *common, "--out", tmp_path / "cp.json"],
        "evaluate": ["evaluate", *common, "--methods", "map,glm-probit,glm-bridge,glm-mc", "--samples", "20",
                     "--conformal", "0.1", "--fidelity-inputs", "0", "--out", tmp_path / "e.json"],
    }  # fmt: skip
    for name, args in runs.items():
        res = cli(*args)
        assert res.code == 0, (name, res.err)
        for needle in ("RuntimeWarning", "overflow", "invalid value", "divide by zero"):
            assert needle not in res.err, (name, res.err)
    assert json.loads((tmp_path / "topk.json").read_text())["summary"]
    assert "conformal" in json.loads((tmp_path / "e.json").read_text())["results"]


# ---------------------------------------------------------------------------------------------
# held-out selection scores each candidate from its own log-probabilities
# ---------------------------------------------------------------------------------------------


def test_log_mean_softmax_is_exact_where_the_mean_underflows():
    gen = torch.Generator().manual_seed(5)
    draws = torch.randn(50, 30, 6, generator=gen) * 2
    draws[:, torch.arange(30), torch.arange(30) % 6] += 200.0  # float32 softmax of the rest: 0
    got = log_mean_softmax(draws)
    z = draws.double().numpy()
    oracle = logsumexp(z - logsumexp(z, axis=2, keepdims=True), axis=0) - math.log(50)
    assert draws.softmax(-1).mean(0).min() == 0.0  # the probabilities alone have lost these
    # float32 log-softmax values ~200, summed in float32: relative 2^-23 per term is 5e-5 nats here
    np.testing.assert_allclose(got.numpy(), oracle, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("mu", [-300.0, -60.0, 0.7, 60.0, 300.0])
@pytest.mark.parametrize("sigma", [0.5, 3.0])
def test_sigmoid_predictive_log_odds_match_quadrature_at_any_margin(mu, sigma):
    from scipy.integrate import quad
    from scipy.special import log_expit

    def log_mean(sign: float) -> float:
        # log E[σ(±f)], f ~ N(mu, σ²): the integrand scaled by its peak so quad keeps its digits
        def log_f(t: float) -> float:
            return log_expit(sign * t) - 0.5 * ((t - mu) / sigma) ** 2

        peak = max(log_f(t) for t in np.linspace(mu - 10 * sigma - 50, mu + 10 * sigma + 50, 4001))
        val, _ = quad(lambda t: math.exp(log_f(t) - peak), mu - 40 * sigma - 60, mu + 40 * sigma + 60,
                      points=[0.0, mu], limit=400, epsabs=0, epsrel=1e-12)  # fmt: skip
        return peak + math.log(val) - math.log(sigma * math.sqrt(2 * math.pi))

    mean, var = torch.tensor([[mu]], dtype=torch.float64), torch.tensor([[sigma**2]], dtype=torch.float64)
    got = float(sigmoid_predictive(mean, var).log_odds)
    oracle = log_mean(1.0) - log_mean(-1.0)
    # the Laguerre rule keeps ~5 significant digits of a tail probability (module docs): 1e-4 of it
    assert abs(got - oracle) <= 1e-4 * max(1.0, abs(oracle)), (got, oracle)


def test_sigmoid_links_give_log_odds_where_probabilities_saturate():
    mean = torch.tensor([[200.0, -200.0, 0.5, -300.0]])
    mc = apply_sigmoid_link(mean, torch.zeros_like(mean), "mc", samples=8)
    assert mc.probs[0, 0] == 1.0 and mc.probs[0, 1] == 0.0  # what 1 − p and p alone would lose
    # no variance: every draw is the mean, so the MC predictive's log-odds are the mean itself
    np.testing.assert_allclose(mc.log_odds.numpy(), mean.double().numpy(), rtol=1e-6)
    # where nothing saturates, the MC log-odds are the logit of the MC probabilities (float64)
    mid = torch.linspace(-4, 4, 9, dtype=torch.float64)[None]
    out = apply_sigmoid_link(mid, torch.full_like(mid, 2.0), "mc", samples=500)
    np.testing.assert_allclose(out.log_odds.numpy(), torch.logit(out.probs).numpy(), rtol=1e-10, atol=1e-12)
    var = torch.tensor([[0.3, 0.3, 0.3, 9.0]])
    beta = apply_sigmoid_link(mean, var, "beta")
    # the moment-matched Beta's mean is E[σ(f)]: its log-odds are the quadrature's
    expected = sigmoid_predictive(mean.double(), var.double()).log_odds
    np.testing.assert_allclose(beta.log_odds.numpy(), expected.numpy(), rtol=1e-9)
    assert beta.log_odds[0, 0] > 150 and beta.log_odds[0, 1] < -150
    # σ = 3 at μ = −300: E[σ(f)] ≈ e^{μ + σ²/2}, far below where a float64 probability underflows
    assert abs(beta.log_odds[0, 3].item() - (-300 + 4.5)) < 1e-6


def test_laplace_selection_scores_each_candidate_exactly_on_a_confident_net(confident_ckpt):
    model = load_classifier("builtin:small-cnn", confident_ckpt)
    post = bayescli.fit(model, "digits:train", "laplace", val="digits:val",
                        settings=LaplaceSettings(hessian="diag"))  # fmt: skip
    sel = post.metadata()["selection"]
    assert sel["validated"] and "probit" in post.metadata()["prior"]["objective"]
    val = load_data("digits:val")
    phi = extract_features(model, val).phi
    y = val.y.numpy()
    gaps = []
    for row in sel["curve"]:
        # the oracle: the GLM probit predictive's log-softmax in float64 NumPy at this δ
        post.gaussian.with_delta(row["prior_precision"])
        lg = post.logit_gaussian(phi)
        z = (lg.mean.double() / torch.sqrt(1 + math.pi / 8 * lg.var.double())).numpy()
        logp = z - logsumexp(z, axis=1, keepdims=True)
        exact = float(-logp[np.arange(len(y)), y].mean())
        gaps.append(abs(row["nll"] - exact) / exact)
    # float32 logit moments in the hundreds through one float64 log-softmax: 1e-6 relative is > 100×
    assert max(gaps) <= 1e-6, gaps
    assert abs(sel["map_validation"]["nll"] - _oracle_nll(confident_ckpt, "digits:val")[0]) <= 1e-6 * 5


def test_vi_selection_reaches_map_exactly_on_a_confident_net(confident_ckpt):
    model = load_classifier("builtin:small-cnn", confident_ckpt)
    source = FitSource(model, load_data("digits:train"), load_data("digits:val"))
    post = fit_mnvi(source, MNVIConfig(epochs=2))
    sel = post.metadata()["selection"]
    val_nll = _oracle_nll(confident_ckpt, "digits:val")[0]
    assert abs(sel["map_validation"]["nll"] - val_nll) <= 1e-6 * val_nll
    # the grid's MAP end (start logit variances v ≤ 1e-4, 256 draws) scores MAP's exact NLL: a row's
    # log p moves by ~v from Jensen plus MC noise √(2v/256) ≈ 1e-3 (measured: 1.2e-6 in the mean);
    # the probabilities alone count each underflowed wrong answer at 708 nats (a gap of 2.7 here)
    assert abs(sel["map_limit_gap"]) <= 1e-2, (sel["map_limit_gap"], val_nll)
