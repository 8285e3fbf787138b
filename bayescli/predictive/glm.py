"""Predictives: from a posterior and inputs to logit Gaussians, then through a link.

* ``glm`` (default): the network linearised at ``θ*`` — ``N(f(x; θ*), J Σ Jᵀ)``. For last-layer
  posteriors ``J = I ⊗ φ̃ᵀ`` is never built (the structure does the work, see
  :mod:`bayescli.posterior.gaussian`); all-layer posteriors use batched Jacobians.
* ``bnn``: draw weights from the posterior and run the *network* (seed 003's BNN predictive);
  ``mc`` averages the softmax of the draws, other links see the draws' moment-matched Gaussian.
* ``ggp``: the same linearised model in function space, Laplace on ``M`` fitting points
  (:mod:`bayescli.predictive.ggp`); pass the fitted :class:`GGPPredictor` as ``ggp``.

A multi-label posterior (``likelihood == "bernoulli"``) has a sigmoid per class: its ``glm``
predictive reads only the per-label logit means and variances ``[N, K]`` (the diagonal of
``J Σ Jᵀ``: for last-layer posteriors the structures give it without a per-input Jacobian,
all-layer ones take the batched Jacobians the softmax all-layer predictive uses) and maps each
label through a sigmoid link (:mod:`bayescli.predictive.sigmoid_links`: ``none``, ``probit``,
``mc``, ``beta``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from bayescli import devices
from bayescli.data import Data
from bayescli.errors import BayescliError
from bayescli.metrics.classification import map_probabilities
from bayescli.models.features import Features
from bayescli.models.specs import Classifier
from bayescli.options import DEFAULT_CORRECTION, BridgeCorrection, Link, Predictive
from bayescli.posterior.base import Posterior
from bayescli.posterior.gaussian import LogitGaussian
from bayescli.predictive import dirichlet
from bayescli.predictive.ggp import GGPPredictor
from bayescli.predictive.links import LinkOutput, apply_link
from bayescli.predictive.sigmoid_links import SigmoidLink, SigmoidLinkOutput, apply_sigmoid_link

__all__ = ["Prediction", "logit_gaussian", "map_probabilities", "predict", "sigmoid_link"]


@dataclass
class Prediction:
    """Probabilities ``[N, K]`` and what produced them; ``per_label`` holds a multi-label
    posterior's per-label link output (Beta parameters, spread, mutual information ``[N, K]``);
    ``log_probs [N, K]`` the softmax link's own float64 log-probabilities (exact where ``probs``
    saturate; what the NLL and the OOD/selective scores use)."""

    probs: torch.Tensor
    logits: LogitGaussian | None
    alpha: torch.Tensor | None
    std: torch.Tensor | None
    predictive: str
    link: str
    timings: dict = field(default_factory=dict)
    expected_entropy: torch.Tensor | None = None
    per_label: SigmoidLinkOutput | None = None
    log_probs: torch.Tensor | None = None

    @property
    def logit_mean(self) -> torch.Tensor | None:
        """Mean of the logit Gaussian ``[N, K]`` (``None`` when the predictive has none)."""
        return None if self.logits is None else self.logits.mean

    @property
    def logit_var(self) -> torch.Tensor | None:
        """Per-class logit variances ``[N, K]`` (the covariance's diagonal)."""
        return None if self.logits is None else self.logits.var


def logit_gaussian(
    posterior: Posterior,
    feats: Features,
    classifier: Classifier | None = None,
    data: Data | None = None,
    batch_size: int = 256,
) -> LogitGaussian:
    """GLM logit Gaussians for every input (features for last-layer, inputs for all-layer)."""
    if not posterior.needs_inputs:
        return posterior.logit_gaussian(feats.phi)
    parts = [posterior.logit_gaussian_inputs(classifier, x) for x, _ in data.batches(batch_size)]
    return LogitGaussian.cat(parts)


def _bnn_logits(
    posterior: Posterior,
    feats: Features,
    classifier: Classifier | None,
    data: Data | None,
    samples: int,
    gen: torch.Generator,
    batch_size: int,
) -> torch.Tensor:
    if not posterior.needs_inputs:
        return posterior.sample_logits(samples, classifier, None, feats.phi, gen)
    dev = feats.phi.device
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device=dev))
    parts = []
    for x, _ in data.batches(batch_size):
        # Same weight draws for every batch: re-seed per batch.
        parts.append(posterior.sample_logits(samples, classifier, x, None, devices.generator(dev, seed)))
    return torch.cat(parts, dim=1)


def sigmoid_link(link: Link, predictive: Predictive, fit_dirichlet: bool = False) -> SigmoidLink:
    """The per-label link of a multi-label posterior for ``link``; softmax-only choices are refused."""
    if predictive is not Predictive.GLM:
        raise BayescliError(
            f"predictive '{predictive.value}' serves softmax posteriors only; multi-label (bernoulli) "
            "posteriors use the glm predictive"
        )
    if fit_dirichlet:
        raise BayescliError(
            "a fitted Dirichlet is a softmax output; multi-label posteriors get a Beta per label "
            "from link 'beta'"
        )
    try:
        return SigmoidLink(link.value)
    except ValueError:
        choices = ", ".join(v.value for v in SigmoidLink)
        raise BayescliError(
            f"link '{link.value}' is a softmax link; multi-label (bernoulli) posteriors take {choices}"
        ) from None


def predict(
    posterior: Posterior,
    feats: Features,
    predictive: Predictive | str = Predictive.GLM,
    link: Link | str = Link.PROBIT,
    samples: int = 1000,
    seed: int = 0,
    classifier: Classifier | None = None,
    data: Data | None = None,
    correction: BridgeCorrection | str = DEFAULT_CORRECTION,
    fit_dirichlet: bool = False,
    batch_size: int = 256,
    ggp: GGPPredictor | None = None,
) -> Prediction:
    """Predictive probabilities for the inputs whose features are ``feats``.

    All-layer posteriors and the all-layer BNN predictive also need ``classifier`` and ``data``.
    Everything runs on the device of ``feats`` (random draws from a generator seeded there).
    Timings (seconds) of the forward pass, the predictive and the link are recorded separately
    (on a GPU each is synchronised first, so it counts its own kernels). A multi-label posterior
    takes the glm predictive with the links ``none``, ``probit``, ``mc`` or ``beta`` (module docs).
    """
    predictive, link = Predictive(predictive), Link(link)
    bernoulli = posterior.likelihood == "bernoulli"
    label_link = sigmoid_link(link, predictive, fit_dirichlet) if bernoulli else None
    per_label = None
    dev = feats.phi.device
    gen = devices.generator(dev, seed)
    timings = {"forward": feats.seconds}
    start = time.perf_counter()
    if predictive is not Predictive.BNN:
        if predictive is Predictive.GGP:
            if ggp is None:
                raise BayescliError(
                    "the GGP predictive needs its fitting points: pass ggp, the predictor fit_ggp fitted"
                )
            lg = ggp.logit_gaussian(feats, data, batch_size)
        else:
            lg = logit_gaussian(posterior, feats, classifier, data, batch_size)
        devices.synchronize(dev)
        timings["predictive"] = time.perf_counter() - start
        start = time.perf_counter()
        if label_link is not None:
            per_label = apply_sigmoid_link(lg.mean, lg.var, label_link, samples, seed)
            out = LinkOutput(per_label.probs, std=per_label.std)
        else:
            out = apply_link(lg, link, samples, gen, correction, fit_dirichlet)
    else:
        draws = _bnn_logits(posterior, feats, classifier, data, samples, gen, batch_size)
        centred = draws - draws.mean(0)
        cov = torch.einsum("mnk,mnl->nkl", centred, centred) / max(1, samples - 1)
        lg = LogitGaussian(draws.mean(0), cov.diagonal(dim1=1, dim2=2).clone(), cov)
        devices.synchronize(dev)
        timings["predictive"] = time.perf_counter() - start
        start = time.perf_counter()
        if link is Link.MC:
            probs = draws.softmax(-1)
            alpha = dirichlet.dirichlet_from_samples(probs) if fit_dirichlet else None
            ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean(0)
            # log (1/M) Σ_m softmax(z_m), exact where the mean saturates (in the draws' dtype: a
            # float64 copy of every draw would double the memory)
            log_probs = draws.log_softmax(-1).logsumexp(0).double() - math.log(samples)
            out = LinkOutput(probs.mean(0), alpha, probs.std(0), ent, log_probs)
        else:
            out = apply_link(lg, link, samples, gen, correction, fit_dirichlet)
    devices.synchronize(dev)
    timings["link"] = time.perf_counter() - start
    return Prediction(
        out.probs,
        lg,
        out.alpha,
        out.std,
        predictive.value,
        link.value,
        timings,
        out.expected_entropy,
        per_label,
        out.log_probs,
    )
