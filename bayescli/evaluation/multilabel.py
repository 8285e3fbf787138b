"""``evaluate`` and ``conformal`` for multi-label (``bernoulli``) posteriors: a sigmoid per class.

The suites are those of the softmax report with multi-label metrics
(:mod:`bayescli.metrics.multilabel`) in place of the single-label ones:

* methods: ``map`` (the network's sigmoids) and ``glm-LINK`` with the sigmoid links ``none``,
  ``probit``, ``mc``, ``beta`` (:mod:`bayescli.predictive.sigmoid_links`); every posterior that
  yields per-label logit Gaussians serves, whatever its family;
* in-distribution and shifted sets: mAP, micro/macro F1, Hamming loss, subset accuracy and the
  per-label NLL / Brier / ECE with their means, per label keyed by class name (so that
  ``--fail-if`` can name one label); selective prediction in-distribution;
* OOD scores, higher = in-distribution: ``max_sigmoid``, ``neg_total_entropy`` and
  ``joint_energy`` for every method, ``neg_mi_sum`` / ``neg_mi_max`` for the links with a
  per-label mutual information (``mc``, ``beta``), ``knn`` on the MAP network's features.
  JointEnergy ``Σ_k softplus(g_k)`` reads each method's own logit ``g_k = logit(p_k)``: the MAP
  logits for ``map``, ``μ`` for ``none``, ``μ/√(1 + πσ²/8)`` for ``probit`` (exact), and
  ``log p − log(1 − p)`` of the float64 probabilities (``1 − p`` floored at 1e-12) for ``mc`` and
  ``beta``. Softmax detectors (MaxLogit, energy, Mahalanobis, ViM, ReAct, ODIN) assume class
  means or a softmax over the logits and are refused for multi-label posteriors;
* conformal: per-label split-conformal sets (LAC) with coverage per label
  (:mod:`bayescli.predictive.conformal_multilabel`); top-k sets have no multi-label meaning.

Temperature scaling (``temp``) and the link-fidelity check are softmax-only here.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from bayescli.data import Data
from bayescli.errors import BayescliError
from bayescli.evaluation.config import SCORES, EvalConfig, parse_ood_scores
from bayescli.evaluation.methods import Method, MethodOutput, parse_methods
from bayescli.metrics.classification import ood_metrics
from bayescli.metrics.multilabel import (
    PROTOCOL,
    max_sigmoid,
    multilabel_summary,
    ood_scores,
    selective,
)
from bayescli.models.features import Features
from bayescli.models.specs import Classifier
from bayescli.options import MULTILABEL_METHODS, MULTILABEL_OOD_SCORES, Link, Predictive
from bayescli.posterior.base import Posterior
from bayescli.predictive.conformal_multilabel import calibrate_per_label, per_label_sets, per_label_summary
from bayescli.predictive.glm import predict
from bayescli.predictive.sigmoid_links import SigmoidLink

# report keys of the multi-label OOD scores; knn reads only the features and serves both likelihoods
EVERY_METHOD = ("max_sigmoid", "neg_total_entropy", "joint_energy")
WITH_MI = ("neg_mi_sum", "neg_mi_max")  # links with a per-label mutual information
MULTILABEL_KEYS = (*EVERY_METHOD, *WITH_MI)
SHARED_KEYS = ("knn",)
SOFTMAX_ONLY_DETECTORS = "maxlogit, energy, mahalanobis, rel-mahalanobis, vim, react, odin"
CALIBRATION_FRACTION = 0.5  # as the softmax conformal suite


def likelihood_of(posteriors: dict[str, Posterior]) -> str:
    """The one likelihood the posteriors share; a mix is refused (one report, one kind of metrics)."""
    kinds = {tag: post.likelihood for tag, post in posteriors.items()}
    if len(set(kinds.values())) > 1:
        listed = ", ".join(f"{tag}: {kind}" for tag, kind in kinds.items())
        raise BayescliError(
            f"the posteriors mix likelihoods ({listed}); evaluate softmax and multi-label posteriors "
            "in separate calls"
        )
    return next(iter(kinds.values()))


def _option_name(key: str) -> str:
    return next(name for name, k in SCORES.items() if k == key)


def check_multilabel_methods(methods: list[Method]) -> None:
    """Refuse methods without a multi-label form: ``temp`` and non-glm or softmax links."""
    choices = "map and glm-LINK with LINK in " + ", ".join(v.value for v in SigmoidLink)
    for m in methods:
        if m.predictive is None and m.name != "map":
            raise BayescliError(
                f"method '{m.name}' (softmax temperature scaling) has no multi-label form; "
                f"multi-label (bernoulli) posteriors take {choices}"
            )
        if m.predictive is not None and (
            m.predictive is not Predictive.GLM or m.link.value not in {v.value for v in SigmoidLink}
        ):
            raise BayescliError(
                f"method '{m.name}' is a softmax method; multi-label (bernoulli) posteriors take {choices}"
            )


def for_likelihood(cfg: EvalConfig, likelihood: str) -> EvalConfig:
    """``cfg`` for posteriors of ``likelihood``: the defaults of methods and OOD scores that were
    not chosen become the likelihood's, chosen ones are checked against it."""
    bc = cfg.baselines
    if likelihood != "bernoulli":
        bad = [s for s in bc.ood_scores if s in MULTILABEL_KEYS]
        if bad:
            raise BayescliError(
                f"OOD score '{_option_name(bad[0])}' is for multi-label (bernoulli) posteriors; softmax "
                "posteriors take msp, entropy, alpha0, mi, maxlogit, energy, mahalanobis, rel-mahalanobis, "
                "knn, vim, react, odin"
            )
        return replace(cfg, likelihood=likelihood)
    methods = parse_methods(MULTILABEL_METHODS) if cfg.default_methods else cfg.methods
    check_multilabel_methods(methods)
    scores = parse_ood_scores(MULTILABEL_OOD_SCORES) if bc.default_scores else bc.ood_scores
    bad = [s for s in scores if s not in MULTILABEL_KEYS and s not in SHARED_KEYS]
    if bad:
        allowed = ", ".join(_option_name(k) for k in (*MULTILABEL_KEYS, *SHARED_KEYS))
        raise BayescliError(
            f"OOD score '{_option_name(bad[0])}' assumes a softmax classifier; multi-label (bernoulli) "
            f"posteriors take {allowed}"
        )
    return replace(cfg, likelihood=likelihood, methods=methods, baselines=replace(bc, ood_scores=scores))


def run_multilabel_method(
    method: Method,
    posterior: Posterior | None,
    feats: Features,
    classifier: Classifier,
    data: Data,
    samples: int,
    seed: int,
) -> MethodOutput:
    """Per-label probabilities ``[N, K]`` of ``method`` and its OOD scores ``{name: [N]}``."""
    if method.predictive is None:  # map: the network's sigmoids
        start = time.perf_counter()
        probs = torch.sigmoid(feats.logits)
        scores = ood_scores(probs, logits=feats.logits)
        seconds = {"link": time.perf_counter() - start}
        return MethodOutput(probs, scores, seconds, log_odds=feats.logits.double())
    pred = predict(posterior, feats, Predictive.GLM, method.link, samples, seed, classifier, data)
    per_label = pred.per_label
    log_odds = None if per_label is None else per_label.log_odds  # each link's own: exact NLL
    own = pred.logits.mean if method.link is Link.NONE else log_odds
    mi = per_label.mutual_information if per_label is not None else None
    scores = ood_scores(pred.probs, logits=own, mutual_info=mi)
    seconds = {k: v for k, v in pred.timings.items() if k != "forward"}
    return MethodOutput(pred.probs, scores, seconds, log_odds=log_odds)


def _by_class(per_label: dict, names: list[str]) -> dict:
    """Per-label lists ``{metric: [K]}`` → ``{metric: {class name: value}}`` (gate-addressable)."""
    return {key: dict(zip(names, values, strict=True)) for key, values in per_label.items()}


def shift_summary(
    probs: torch.Tensor, y: torch.Tensor, names: list[str], log_odds: torch.Tensor | None = None
) -> dict:
    """The multi-label metrics of one method's ``probs [N, K]`` on one labelled set ``y [N, K]``,
    per label keyed by class; the NLL from the method's ``log_odds [N, K]`` where it has them."""
    out = multilabel_summary(probs, y, log_odds=log_odds)
    out["per_label"] = _by_class(out["per_label"], names)
    return out


def in_distribution(outs: dict[str, MethodOutput], y: torch.Tensor, names: list[str]) -> dict:
    """Each method's in-distribution block: :func:`shift_summary` and selective prediction."""
    return {
        name: {**shift_summary(o.probs, y, names, o.log_odds), **selective(o.probs, y)}
        for name, o in outs.items()
    }


def ood_row(clean: MethodOutput, shifted: MethodOutput) -> dict:
    """One method's OOD cell: mean max sigmoid on the OOD set and detection metrics per score
    (``None``: a detector that could not be fitted)."""
    row: dict = {"mean_max_sigmoid": max_sigmoid(shifted.probs).mean().item()}
    for score, s in shifted.scores.items():
        row[score] = None if s is None else ood_metrics(clean.scores[score], s)
    return row


def _conformal_row(
    probs_cal: torch.Tensor,
    y_cal: torch.Tensor,
    probs_test: torch.Tensor,
    y_test: torch.Tensor | None,
    alpha: float,
    names: list[str],
) -> tuple[dict, torch.Tensor]:
    """Thresholds from ``[n, K]`` calibration probabilities and labels, sets ``bool [N, K, 2]`` on
    the test probabilities, and their summary (with coverage when ``y_test`` is given)."""
    q = calibrate_per_label(probs_cal, y_cal, alpha)
    sets = per_label_sets(probs_test, q)
    row = per_label_summary(sets, y_test)
    per_label = row.pop("per_label")
    if "coverage" in per_label:
        row["min_label_coverage"] = min(per_label["coverage"])
    row["per_label"] = _by_class({**per_label, "threshold": q.tolist()}, names)
    return row, sets


def conformal_protocol(alpha: float, n_cal: int, n_test: int, calibration: str) -> dict:
    return {
        "alpha": alpha,
        "calibration": calibration,
        "calibration_points": n_cal,
        "test_points": n_test,
        "threshold": "per label: ceil((n+1)(1-alpha))-th smallest calibration score",
        "coverage_ci": "95% Clopper-Pearson interval per label over the test points",
        "scores": {
            "lac": "per label, s(x, v) = 1 - p(v) for v in {0, 1}; sets of values {}, {0}, {1} or {0, 1}; "
            "coverage holds per label, not for the whole label vector"
        },
        "topk": "none: top-k sets are a single-label notion",
    }


def conformal_suite(
    clean: dict[str, MethodOutput], y: torch.Tensor, names: list[str], alpha: float, seed: int
) -> tuple[dict, dict]:
    """Per-label split conformal sets of every method on a seeded half of the test set, calibrated
    on the other half (as the softmax suite). Returns ``(results, protocol)``."""
    n = len(y)
    n_cal = int(n * CALIBRATION_FRACTION)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    cal, ev = perm[:n_cal].sort().values, perm[n_cal:].sort().values
    results = {}
    for name, out in clean.items():
        probs = out.probs.cpu()
        row, _ = _conformal_row(probs[cal], y[cal], probs[ev], y[ev], alpha, names)
        results[name] = {"lac": row}
    calibration = (
        f"seeded {CALIBRATION_FRACTION:.0%} of the test set (seed {seed}); sets and coverage on the rest"
    )
    return results, conformal_protocol(alpha, n_cal, n - n_cal, calibration)


def standalone_conformal(
    posterior: Posterior,
    model_classifier: Classifier,
    names: list[str],
    method_name: str,
    test: Data,
    test_feats: Features,
    calibration: Data,
    cal_feats: Features,
    alpha: float,
    samples: int,
    seed: int,
) -> tuple[dict, torch.Tensor]:
    """``bayescli conformal`` on a multi-label posterior: per-label sets ``bool [N, K, 2]`` of
    ``method_name`` calibrated on ``calibration``; returns the summary and the sets."""
    methods = parse_methods(method_name)
    if len(methods) != 1:
        raise BayescliError(f"conformal sets take one method (`method`), got {method_name}")
    check_multilabel_methods(methods)
    if cal_feats.labels is None:
        raise BayescliError(f"{calibration.spec} has no labels; calibration needs labelled data")

    def probs(feats: Features, data: Data) -> torch.Tensor:
        out = run_multilabel_method(methods[0], posterior, feats, model_classifier, data, samples, seed)
        return out.probs.cpu()

    row, sets = _conformal_row(
        probs(cal_feats, calibration), cal_feats.labels.cpu(), probs(test_feats, test),
        None if test_feats.labels is None else test_feats.labels.cpu(), alpha, names,
    )  # fmt: skip
    info = {
        "method": methods[0].name,
        "score": "lac",
        "alpha": alpha,
        "likelihood": "bernoulli",
        "per_label_sets": "values {0, 1} of each label; coverage holds per label",
        "calibration_data": calibration.info,
    }
    return {**info, "summary": {"calibration_points": len(calibration), **row}}, sets


def protocol() -> dict:
    """What the multi-label report's numbers mean (beside the runner's common protocol)."""
    return {
        **PROTOCOL,
        "per_label": "keyed by class name; average_precision null for a label without positives",
        "joint_energy": "sum over labels of softplus of the method's own logit: MAP logits (map), mu "
        "(none), mu/sqrt(1+pi var/8) (probit), logit of the probability with 1-p floored at 1e-12 "
        "(mc, beta)",
        "not_run": {
            "temp": "softmax temperature scaling",
            "link_fidelity": "softmax links (sigmoid links are tested against 1e5-sample MC)",
            "detectors": f"{SOFTMAX_ONLY_DETECTORS}: they assume single-label class means or a softmax",
        },
    }
