"""Link fidelity: how far each analytic link is from the predictive it approximates.

On a seeded subset of inputs, the reference is the Monte Carlo predictive ``E[softmax(z)]``,
``z ~ N(μ, Σ)``, with many samples (2000 by default); each analytic link's probabilities are
compared to it by ``KL(MC ‖ link)`` per input (nats). The MC estimate's own noise biases the KL
upwards by about ``Σ_k Var[softmax_k] / (2 M p_k)`` (second-order expansion of the KL around the
exact predictive); that ``noise_floor`` is reported beside it so a small KL can be read.

A posterior whose native output is a Dirichlet (``lg.alpha`` set: Dirichlet fVI) is its own
predictive: the reference is then the Dirichlet mean ``α/α₀`` and every link, MC included, is
applied to the Gaussian image of that Dirichlet (the inverse Laplace bridge), an approximation
marked as such. That image is poor for ``α_k < 1``: ``Σ_kk ≈ 1/α_k`` and
``E[exp z_k] ∝ α_k exp(Σ_kk / 2)``, so the classes with the least mass carry the largest variance
and dominate ``E[softmax(z)]`` (MC through it can rank the Dirichlet's top class last).
"""

from __future__ import annotations

import torch

from bayescli import devices
from bayescli.options import BridgeCorrection
from bayescli.posterior.gaussian import LogitGaussian
from bayescli.predictive import dirichlet
from bayescli.predictive.links import bridge, monte_carlo, probit, sodpp

FIDELITY_SAMPLES = 2000
# A seeded subset of this many test inputs, and FIDELITY_SAMPLES draws, by default: the check runs
# on every evaluate, and its MC reference costs samples × inputs × K² multiply-adds (full
# covariances), which at 256 inputs × 10⁴ draws was most of an evaluate on digits. The mean KL over
# 32 inputs still tells a link off by more than KL_WARNING from one that is not, and the MC noise
# floor at 2000 draws, about (K − 1) / (2M) ≤ 2.5e-3 nats at K = 10, is 20× below KL_WARNING (the
# report gives it); ``--fidelity-inputs`` asks for more inputs.
FIDELITY_INPUTS = 32
KL_WARNING = 0.05
GAUSSIAN_IMAGE = "gaussian image of the Dirichlet (inverse Laplace bridge)"
MC_REFERENCE = "Monte Carlo E[softmax(z)], z ~ N(mu, Sigma)"
DIRICHLET_REFERENCE = "the posterior's Dirichlet mean alpha / alpha0 (its native predictive)"
# Sampling work (samples × inputs × per-draw cost) allowed before the subset, then the samples,
# are cut: ten times the default's 32 inputs × 2000 draws of a 10-class full covariance (6.4e6
# multiply-adds), so many classes cannot make the check cost minutes; 1000-class nets with full
# covariances keep 8 inputs and at least 1000 draws.
MAX_WORK = 6.4e7
MIN_INPUTS = 8
MIN_SAMPLES = 1000


def _per_draw(num_classes: int, kind: str) -> int:
    """Multiply-adds per draw: ``K`` for diagonal covariances, ``K²`` for eigen-form and full ones."""
    return num_classes if kind == "diag" else num_classes**2


def fidelity_inputs(n: int, num_classes: int, kind: str, inputs: int, samples: int) -> int:
    """How many of ``n`` inputs to use: ``inputs`` unless the draws would exceed ``MAX_WORK``,
    never fewer than ``MIN_INPUTS`` (or ``n``)."""
    affordable = int(MAX_WORK // (samples * _per_draw(num_classes, kind)))
    return max(1, min(n, inputs, max(MIN_INPUTS, affordable)))


def fidelity_samples(inputs: int, num_classes: int, kind: str, samples: int) -> int:
    """MC draws for ``inputs`` inputs: ``samples`` unless that exceeds ``MAX_WORK`` (large ``K``
    after :func:`fidelity_inputs` has cut the inputs), never fewer than ``MIN_SAMPLES``; the
    report's ``noise_floor`` says what the fewer draws cost in precision."""
    affordable = int(MAX_WORK // (max(1, inputs) * _per_draw(num_classes, kind)))
    return max(min(samples, MIN_SAMPLES), min(samples, affordable))


def subset_index(n: int, size: int, seed: int) -> torch.Tensor:
    """A seeded random subset of ``size`` of ``n`` rows (sorted)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:size].sort().values


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    p, q = p.double(), q.double().clamp_min(1e-30)
    return (p * (p.clamp_min(1e-30).log() - q.log())).sum(-1)


def _nll(p: torch.Tensor, labels: torch.Tensor) -> float:
    return -p.double().gather(1, labels.to(p.device).view(-1, 1)).clamp_min(1e-12).log().mean().item()


def undefined_reason(link: str, bad: int, n: int) -> str:
    """Why a link's fidelity is not a number (its probabilities are not finite on ``bad`` of
    ``n`` inputs)."""
    where = f"on {bad} of {n} inputs"
    if link.startswith("bridge"):
        return (
            f"undefined {where}: their logit variances ≈ 0 next to the logit margins, so the "
            "Dirichlet degenerates there (α₀ → ∞, its mean is 0/0)"
        )
    return f"undefined {where}: the link's probabilities are not finite"


def reference_name(lg: LogitGaussian) -> str:
    """What :func:`link_fidelity` compares the links with, for ``lg``."""
    return MC_REFERENCE if lg.alpha is None else DIRICHLET_REFERENCE


def link_fidelity(
    lg: LogitGaussian,
    labels: torch.Tensor | None = None,
    samples: int = FIDELITY_SAMPLES,
    seed: int = 0,
    threshold: float = KL_WARNING,
    warn_for: set[str] | None = None,
) -> tuple[dict, list[str]]:
    """``KL(reference ‖ link)`` for probit, SODPP and the bridge mean (each correction) on ``lg``.

    The reference is MC (``E[softmax(z)]``) or, when ``lg`` is the Gaussian image of a native
    Dirichlet (``lg.alpha``), that Dirichlet's mean: then ``mc`` is a link like the others,
    a ``dirichlet`` row holds the reference's ``nll``, and every link's row says it is an
    ``approximation`` (through the Gaussian image).

    Returns ``(results, warnings)``: per link (and for ``map`` = ``softmax(μ)``, as context)
    ``kl_mean``, ``kl_max`` and, with ``labels [N]``, ``nll``; the MC reference's ``nll`` and
    ``noise_floor``; one warning line per link (of ``warn_for``, default all) whose mean KL
    exceeds ``threshold``. A link whose probabilities are not finite (the bridge at logit
    variances ≈ 0) gets null values and an ``undefined`` reason, never NaN.
    """
    mc = monte_carlo(lg, samples, devices.generator(lg.mean.device, seed))
    floor = (mc.std.double().square() / (2 * samples * mc.probs.double().clamp_min(1e-30))).sum(-1)
    native = lg.alpha is not None
    links = {"map": lg.mean.softmax(-1), "probit": probit(lg), "sodpp": sodpp(lg)}
    if native:
        links["mc"] = mc.probs
    for corr in BridgeCorrection:
        name = "bridge" if corr is BridgeCorrection.ZERO_SUM else f"bridge-{corr.value}"
        alpha = bridge(lg, corr)
        # an overflowed α has no mean to compare here (its point-mass stand-in says nothing about
        # the link): such rows are reported undefined, with the reason
        overflowed = ~torch.isfinite(alpha).all(-1, keepdim=True)
        links[name] = dirichlet.mean(alpha).masked_fill(overflowed, float("nan"))
    ref = dirichlet.mean(lg.alpha.double()) if native else mc.probs
    out: dict = {}
    if native:
        out["dirichlet"] = {"reference": True}
        if labels is not None:
            out["dirichlet"]["nll"] = _nll(ref, labels)
    else:
        out["mc"] = {"noise_floor": floor.mean().item()}
        if labels is not None:
            out["mc"]["nll"] = _nll(mc.probs, labels)
    warnings = []
    for name, probs in links.items():
        kl = _kl(ref, probs)
        bad = int((~(torch.isfinite(probs).all(-1) & torch.isfinite(kl))).sum())
        if bad:
            # never NaN in a report: null, and why
            row = {"kl_mean": None, "kl_max": None, "undefined": undefined_reason(name, bad, len(lg))}
            if labels is not None:
                row["nll"] = None
            out[name] = row
            if name != "map" and (warn_for is None or name in warn_for):
                warnings.append(f"link fidelity of {name}: {row['undefined']}")
            continue
        row = {"kl_mean": kl.mean().item(), "kl_max": kl.max().item()}
        if labels is not None:
            row["nll"] = _nll(probs, labels)
        if native and not name.startswith("bridge"):
            row["approximation"] = GAUSSIAN_IMAGE
        if native and name == "mc":
            row["noise_floor"] = floor.mean().item()
        out[name] = row
        # softmax(μ) ignores Σ by design: its distance is context, not a link's error
        if name != "map" and (warn_for is None or name in warn_for) and row["kl_mean"] > threshold:
            if native:
                warnings.append(
                    f"the {name} link is {row['kl_mean']:.3g} nats (mean KL) from the posterior's "
                    f"Dirichlet predictive on {len(lg)} test inputs (> {threshold:g}): it is applied "
                    f"to the {GAUSSIAN_IMAGE}, an approximation; the Dirichlet mean (link bridge) "
                    "is that posterior's predictive"
                )
            else:
                warnings.append(
                    f"the {name} link is {row['kl_mean']:.3g} nats (mean KL) from the Monte Carlo "
                    f"predictive of its own Gaussian on {len(lg)} test inputs (> {threshold:g}): its "
                    "probabilities are not that posterior's predictive (glm-mc is)"
                )
    return out, warnings
