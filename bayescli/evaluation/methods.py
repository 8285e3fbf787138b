"""Methods compared by ``evaluate``: ``map``, ``temp`` (temperature-scaled MAP) and any
``PREDICTIVE-LINK`` (e.g. ``glm-probit``; ``glm-bridge-norm`` / ``glm-bridge-none`` pick a
bridge correction other than the default).

Every method runs on the same extracted features; each returns probabilities and the OOD
scores that fit it, all oriented so that *higher means in-distribution*:

* every method: ``max_prob`` and ``neg_entropy`` (−H[p]), both from the method's float64
  log-probabilities (``max_prob`` is the top class's log-odds, which ranks as the max probability
  does but keeps ranking inputs whose max probability saturated at exactly 1.0);
* ``*-bridge``: ``alpha0`` (Dirichlet precision) and ``neg_mutual_information``;
* ``*-mc`` and BNN sampling: ``neg_mutual_information`` (H[E p] − E H[p] over the samples).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bayescli.data import Data
from bayescli.errors import BayescliError
from bayescli.metrics.classification import entropy, entropy_of_log, map_log_probabilities, max_prob_logit
from bayescli.models.features import Features
from bayescli.models.specs import Classifier
from bayescli.options import DEFAULT_CORRECTION, BridgeCorrection, Link, Predictive
from bayescli.posterior.base import Posterior
from bayescli.predictive import dirichlet
from bayescli.predictive.ggp import GGPPredictor
from bayescli.predictive.glm import predict


@dataclass(frozen=True)
class Method:
    """A predictive-link pair; ``posterior`` tags the posterior file it uses (``None`` for MAP)."""

    name: str
    predictive: Predictive | None
    link: Link | None
    correction: BridgeCorrection = DEFAULT_CORRECTION
    posterior: str | None = None


BASELINES = ("map", "temp")  # the network's own softmax, and softmax(f / T) with T fitted


def expand_methods(methods: list[Method], tags: list[str], prefix: bool | None = None) -> list[Method]:
    """One method per posterior tag; names gain a ``TAG/`` prefix when there are several tags
    (or when ``prefix`` says so: one of several groups evaluated apart).

    ``map`` and ``temp`` need no posterior and are kept once.
    """
    prefix = len(tags) > 1 if prefix is None else prefix
    out = []
    for m in methods:
        if m.predictive is None:
            out.append(m)
            continue
        for tag in tags:
            name = f"{tag}/{m.name}" if prefix else m.name
            out.append(Method(name, m.predictive, m.link, m.correction, tag))
    return out


def parse_methods(text: str) -> list[Method]:
    """``map,temp,glm-probit,glm-bridge-norm`` → methods (unknown names are a usage error)."""
    out = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        if name in BASELINES:
            out.append(Method(name, None, None))
            continue
        pred, _, link = name.partition("-")
        link, _, correction = link.partition("-") if link.startswith("bridge-") else (link, "", "")
        try:
            out.append(
                Method(name, Predictive(pred), Link(link), BridgeCorrection(correction or DEFAULT_CORRECTION))
            )
        except ValueError:
            raise BayescliError(
                f"unknown method '{name}'; use map, temp or PREDICTIVE-LINK with PREDICTIVE in "
                f"{', '.join(p.value for p in Predictive)} and LINK in {', '.join(v.value for v in Link)}"
                f" (bridge-{'/bridge-'.join(c.value for c in BridgeCorrection)} choose a correction)"
            ) from None
    if not out:
        raise BayescliError("--methods is empty")
    return out


@dataclass
class MethodOutput:
    """Probabilities ``[N, K]``, OOD scores ``{name: [N]}``, seconds spent and the float64
    log-probabilities ``[N, K]`` (softmax methods; the NLL and selective scores use them) or
    per-label log-odds ``[N, K]`` (multi-label methods whose probabilities are their sigmoid:
    ``map``, ``glm-none``, ``glm-probit``; the per-label NLL uses them)."""

    probs: torch.Tensor
    scores: dict[str, torch.Tensor]
    seconds: dict[str, float]
    log_probs: torch.Tensor | None = None
    log_odds: torch.Tensor | None = None


def run_method(
    method: Method,
    posterior: Posterior | None,
    feats: Features,
    classifier: Classifier,
    data: Data,
    samples: int,
    seed: int,
    ggp: GGPPredictor | None = None,
    temperature: float | None = None,
) -> MethodOutput:
    """Apply ``method`` to the inputs whose features are ``feats`` (``posterior`` unused by ``map``
    and ``temp``; ``temp`` needs ``temperature``)."""
    if method.predictive is None:
        start = time.perf_counter()
        if method.name == "temp" and temperature is None:
            raise BayescliError("the temp method needs a fitted temperature (validation data)")
        logits = feats.logits if method.name == "map" else feats.logits / temperature
        probs, log_probs = logits.softmax(-1), map_log_probabilities(logits)
        seconds = {"link": time.perf_counter() - start}
        return MethodOutput(probs, _base_scores(probs, log_probs), seconds, log_probs)
    pred = predict(
        posterior,
        feats,
        method.predictive,
        method.link,
        samples,
        seed,
        classifier,
        data,
        method.correction,
        ggp=ggp,
    )
    scores = _base_scores(pred.probs, pred.log_probs)
    if pred.alpha is not None:
        scores["alpha0"] = dirichlet.precision(pred.alpha)
        scores["neg_mutual_information"] = -dirichlet.mutual_information(pred.alpha)
    elif pred.expected_entropy is not None:
        scores["neg_mutual_information"] = -(entropy(pred.probs) - pred.expected_entropy.double()).clamp_min(
            0
        )
    seconds = {k: v for k, v in pred.timings.items() if k != "forward"}
    return MethodOutput(pred.probs, scores, seconds, pred.log_probs)


def _base_scores(probs: torch.Tensor, log_probs: torch.Tensor | None) -> dict[str, torch.Tensor]:
    if log_probs is None:
        return {"max_prob": probs.max(-1).values.double(), "neg_entropy": -entropy(probs)}
    return {"max_prob": max_prob_logit(log_probs), "neg_entropy": -entropy_of_log(log_probs)}
