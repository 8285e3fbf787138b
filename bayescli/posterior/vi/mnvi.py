"""MNVI: sampling-free VI with multiplicative Gaussian activation noise (VI-SPEC C, [002]).

Family [002:(5)]: every ``nn.Linear``/``nn.Conv*d`` weight ``w_ij ~ N(m_ij, a_j m_ij²)``
independently, ``a_j = softplus(ρ_j)`` one per input unit (conv: per input channel); biases and
BatchNorm are deterministic. Prior ``N(0, σ²)`` per weight, KL [002:(17)]
``Σ_ij ½[ln(σ²/(a_j m_ij² + 1e-10)) + (1+a_j) m_ij²/σ² − 1]``. Objective per datapoint
(VI-SPEC §0): ``ℓ = mean_batch E_{h~N(μ, diag v)}[−ln softmax(h)_y] + (κ/N)·KL``
(:mod:`bayescli.posterior.vi.mnvi_objective`; the posterior class is in
:mod:`bayescli.posterior.vi.mnvi_posterior`, the from-scratch trainer in
:mod:`bayescli.training.mnvi`).

* ``subset="last-layer"`` (post hoc, on cached features φ): the logits are exactly Gaussian,
  ``N(Mφ + b, diag((M∘M)(a∘φ²)))`` with independent classes (``exact=True``). Variants
  ``noise-only`` (ρ only; the means stay the MAP head, so the mean logits are the MAP logits)
  and ``mean-and-noise`` (M, b and ρ from the MAP).
* ``subset="all"``: every linear/conv layer, logits by moment propagation through the real
  forward pass (:mod:`bayescli.posterior.vi.moments`), an approximation (``exact=False``).

Choosing κ post hoc (:func:`fit`): with validation data and ``kl_weight`` unset, κ/N is chosen on
a log grid (:func:`bayescli.posterior.selection.select_on_grid`, ``select_by``) that runs from one
decade above the principled ``1/N`` down to the MAP limit. As κ → 0 the KL no longer pulls the
noise up, and the expected NLL alone is minimised by ``a = 0`` (``−ln softmax`` is convex in the
logits, so by Jensen noise around fixed mean logits only raises it): the noise-only posterior
becomes MAP (mean-and-noise: the MAP means fine-tuned on the fitting data without noise). A
post-hoc fit moves ρ by about ``lr`` per step, so from a common start ``a0 = softplus(ρ0)``
every small κ would keep ``a ≈ a0``; each candidate therefore starts at ``a0·κ/κ_p``
(``κ_p = 1/N``). At small ``a`` both the data and the KL gradients scale with κ, and AMSGrad is
invariant to a common gradient scale, so the fit at κ is the fit at ``κ_p`` with its noise
scaled by ``κ/κ_p``: the noise, and the logit variance with it, go to 0 linearly in κ. The grid's
MAP end is the first power-of-ten fraction of ``κ_p`` at which every validation logit variance at
the start is ≤ :data:`MAP_LIMIT_VARIANCE` (there the predictive is MAP's to ~1e-5 NLL); the gap
actually reached is recorded as ``map_limit_gap``. σ² stays at its value (given or
``mean(W_MAP²)``) and is recorded under ``fixed``.

Multi-label classifiers (``likelihood == "bernoulli"``, a sigmoid per label, labels ``[N, K]``):
the expected NLL is ``Σ_k E_{h~N(μ_k, v_k)}[BCE(h, y_k)]`` (by quadrature, exact:
:mod:`bayescli.posterior.vi.mnvi_objective`), last layer and all layers alike, since moment
propagation yields per-logit means and variances either way. The validation predictive is
``E[σ(h_k)]`` per label, scored by the means over labels of the per-label criteria
(:func:`bayescli.posterior.selection.scores`) against MAP's sigmoids; the κ → 0 argument above
holds as is (the BCE is convex in the logit too). The posterior records ``likelihood``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from bayescli.data import Data
from bayescli.devices import generator
from bayescli.errors import require
from bayescli.fitting.fit_source import FitSource
from bayescli.metrics.classification import map_probabilities
from bayescli.models.specs import Classifier
from bayescli.options import Subset
from bayescli.posterior.selection import Scored, select_on_grid, unvalidated
from bayescli.posterior.vi.mnvi_objective import (
    fit_head_once,
    fit_network_once,
    mean_square,
    validation_predictive,
)
from bayescli.posterior.vi.mnvi_posterior import MNVIPosterior
from bayescli.posterior.vi.mnvi_settings import MNVIConfig
from bayescli.posterior.vi.moments import MomentPropagator

# Logit samples of the validation predictive [002:(20)]: MC error of the mean NLL ≈ 1e-3
# relative at this size, well below the differences between grid points.
PREDICTIVE_SAMPLES = 256
# The grid's MAP end (module doc): start-noise logit variances ≤ this change the NLL by ~1e-5.
MAP_LIMIT_VARIANCE = 1e-4
# The κ grid: one decade above the principled κ, at least this many below it.
DECADES_ABOVE = 1
MIN_DECADES_BELOW = 3
PRINCIPLED_RULE = (
    "kl_weight = 1/N (kappa = 1, the plain ELBO) with prior_var = mean(W_MAP^2) of the noisy layers "
    "(VI-SPEC C4); pass validation data (val) to choose kl_weight on held-out data"
)


# ---------------------------------------------------------------------------------------------
# post-hoc fits
# ---------------------------------------------------------------------------------------------


def fit(source: FitSource, settings: MNVIConfig) -> MNVIPosterior:
    """Fit MNVI post hoc on ``source``'s checkpoint and choose κ (module doc).

    Last layer: on the fitting set's features (one backbone pass, shared through ``source``).
    All layers: the means start at the checkpoint's weights, BatchNorm stays in eval mode, and
    each step runs moment propagation on a batch of ``settings.batch_size`` inputs. The record of
    how κ was chosen is ``post.selection``; with validation data ``meta["val_nll"]`` is the
    chosen posterior's validation NLL.
    """
    start = time.perf_counter()
    likelihood = source.model.likelihood
    if settings.subset == "last-layer":
        feats, val = source.features(), source.val_features()
        post = fit_features(
            feats.phi, feats.labels, source.classifier.head, settings,
            None if val is None else val.phi, None if val is None else val.labels, source.device,
            likelihood,
        )  # fmt: skip
    else:
        post = _fit_network(source, settings, likelihood)
    post.meta["fit_seconds"] = time.perf_counter() - start
    return post


def fit_features(
    phi: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Linear,
    settings: MNVIConfig,
    phi_val: torch.Tensor | None = None,
    labels_val: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    likelihood: str = "categorical",
) -> MNVIPosterior:
    """Last-layer MNVI on features ``phi [N, D]`` with labels ``[N]`` (``[N, K]`` for
    ``likelihood="bernoulli"``) and the MAP ``head``.

    With validation features ``phi_val [M, D]`` and labels ``[M]`` (``[M, K]``), κ is chosen on
    them as :func:`fit` does (module doc).
    """
    s = settings
    require(s.subset == "last-layer", "fit_features fits the last layer; use fit for subset all")
    require(
        bool(torch.isfinite(phi).all()), "features contain NaN or inf; check the inputs and the checkpoint"
    )
    start = time.perf_counter()
    device = torch.device(device)
    phi, labels = phi.to(device=device, dtype=torch.float32), labels.to(device)
    weight = head.weight.detach().to(device=device, dtype=torch.float32)
    bias = None if head.bias is None else head.bias.detach().to(device=device, dtype=torch.float32)
    n = len(phi)

    def run(c: MNVIConfig) -> MNVIPosterior:
        rho, means, curve = fit_head_once(phi, labels, weight, bias, c, likelihood)
        post = MNVIPosterior(
            Subset.LAST_LAYER, c.variant, rho, means, asdict(c), likelihood=likelihood,
        )  # fmt: skip
        post.meta.update({"curve": curve, "n_data": n})
        return post

    val = None
    if phi_val is not None:
        require(labels_val is not None, "validation features need their labels (labels_val)")
        pv = phi_val.to(device=device, dtype=torch.float32)
        lv = labels_val.to(device)

        def predictive(post: MNVIPosterior) -> Scored:
            lg = post.logit_gaussian(pv)
            gen = generator(device, s.seed)
            return validation_predictive(lg.mean, lg.var, PREDICTIVE_SAMPLES, gen, likelihood)

        def start_variance(a0: float) -> float:
            return float((pv.square() @ (weight.square() * a0).T).max())

        map_logits = torch.nn.functional.linear(pv, weight, bias)
        map_probs = map_probabilities(map_logits, likelihood)
        val = _Validation(lv, predictive, map_probs, start_variance, map_logits)
    post = _choose(s, n, weight.square().mean().item(), run, val)
    post.meta["fit_seconds"] = time.perf_counter() - start
    return post


def _fit_network(source: FitSource, s: MNVIConfig, likelihood: str = "categorical") -> MNVIPosterior:
    """All-layer MNVI post hoc on ``source`` (κ chosen as in :func:`fit`)."""
    device = source.device
    clf = source.classifier.to(device).eval()
    for p in clf.parameters():
        p.requires_grad_(False)
    prop = MomentPropagator(clf.net)
    require(bool(prop.layers), f"{source.model.spec} has no nn.Linear/nn.Conv layer to put noise on")
    train = source.data

    def run(c: MNVIConfig) -> MNVIPosterior:
        means: dict[str, torch.Tensor] = {}
        if c.variant == "mean-and-noise":
            for name in prop.layers:
                mod = prop.layer(name)
                means[f"{name}.weight"] = mod.weight.detach().clone().requires_grad_(True)
                if mod.bias is not None:
                    means[f"{name}.bias"] = mod.bias.detach().clone().requires_grad_(True)
        rho, curve = fit_network_once(clf, prop, train, c, device, means, [], False, likelihood)
        post = MNVIPosterior(
            Subset.ALL,
            c.variant,
            rho,
            {k: v.detach() for k, v in means.items()},
            asdict(c),
            likelihood=likelihood,
        )
        post.meta.update({"curve": curve, "n_data": len(train)})
        return post

    val = None
    if source.val is not None:
        vfeats = source.val_features()

        def predictive(post: MNVIPosterior) -> Scored:
            return network_predictive(post, clf, source.val, device, source.batch_size, s.seed)

        def start_variance(a0: float) -> float:
            noise = {k: torch.full((u,), a0, device=device) for k, u in prop.layers.items()}
            with torch.no_grad():
                peaks = [
                    prop(clf.normalise(x.to(device)), noise).variance().max()
                    for x, _ in source.val.batches(source.batch_size)
                ]
            return float(torch.stack(peaks).max())  # one read, not one per batch

        map_probs = map_probabilities(vfeats.logits.to(device), likelihood)
        val = _Validation(vfeats.labels.to(device), predictive, map_probs, start_variance, vfeats.logits)
    return _choose(s, len(train), mean_square(prop), run, val)


def network_predictive(
    post: MNVIPosterior, clf: Classifier, data: Data, device: torch.device, batch_size: int, seed: int
) -> Scored:
    """The MC predictive [002:(20)] of an all-layer ``post`` on ``data``'s inputs → ``[N, K]``
    with its log-probabilities (logits by moment propagation through ``clf``; one seeded generator
    across batches); per-label ``E[σ(h_k)]`` and its log-odds for a bernoulli ``post``."""
    gen = generator(device, seed)
    parts = []
    with torch.no_grad():
        for xb, _ in data.batches(batch_size):
            lg = post.logit_gaussian_inputs(clf, xb.to(device))
            parts.append(validation_predictive(lg.mean, lg.var, PREDICTIVE_SAMPLES, gen, post.likelihood))
    return Scored.cat(parts)


# ---------------------------------------------------------------------------------------------
# choosing κ
# ---------------------------------------------------------------------------------------------


@dataclass
class _Validation:
    """What the κ selection needs of the validation set: ``labels [M]`` (``[M, K]`` multi-label),
    a posterior's predictive ``predictive(post)`` (``[M, K]``, with its logs), MAP's
    ``map_probs [M, K]``, the largest logit variance at a uniform start noise
    ``start_variance(a0)`` and MAP's ``map_logits [M, K]`` (its exact scores and the warning's
    calibration evidence)."""

    labels: torch.Tensor
    predictive: Callable[[MNVIPosterior], Scored]
    map_probs: torch.Tensor
    start_variance: Callable[[float], float]
    map_logits: torch.Tensor


def _choose(
    s: MNVIConfig,
    n: int,
    mean_sq: float,
    run: Callable[[MNVIConfig], MNVIPosterior],
    val: _Validation | None,
) -> MNVIPosterior:
    """Fit at the given or principled κ, or choose κ on validation data (module doc)."""
    check_select(s)
    require(
        not (s.select is True and val is None),
        "select=True chooses kl_weight on validation data, but there is none; pass validation "
        "data (val) or leave select unset",
    )
    base = s.resolved(False, n, mean_sq)
    if val is not None and s.select is not False and s.kl_weight is None:
        return _select_kl_weight(base, run, val)
    post = run(base)
    if s.kl_weight is not None:
        post.selection = unvalidated("kl_weight", s.kl_weight, "given", fixed=True)
    else:
        rule = PRINCIPLED_RULE if val is None else f"select=False: {PRINCIPLED_RULE.split(';')[0]}"
        post.selection = unvalidated("kl_weight", base.kl_weight, rule)
    if val is not None:
        post.meta["val_nll"] = val.predictive(post).scores(val.labels)["nll"]
    return post


def check_select(s: MNVIConfig) -> None:
    """Reject ``select=True`` with a given ``kl_weight`` (contradictory settings)."""
    # Not in __post_init__: resolved copies carry a kl_weight and keep select as given.
    require(
        not (s.select is True and s.kl_weight is not None),
        f"select=True chooses kl_weight on validation data, but kl_weight = {s.kl_weight} is given; "
        "unset kl_weight or set select=False",
    )


def start_rho(rho0: float, scale: float) -> float:
    """The ρ whose noise is ``scale · softplus(rho0)`` (the candidates' start, module doc)."""
    a = scale * torch.nn.functional.softplus(torch.tensor(rho0, dtype=torch.float64))
    return float(torch.log(torch.expm1(a)))


def _select_kl_weight(
    base: MNVIConfig, run: Callable[[MNVIConfig], MNVIPosterior], val: _Validation
) -> MNVIPosterior:
    principled = base.kl_weight
    a0 = float(torch.nn.functional.softplus(torch.tensor(base.rho0, dtype=torch.float64)))
    # The start noise scales with κ, and the logit variance with it (exactly for the last layer).
    ratio = val.start_variance(a0) / MAP_LIMIT_VARIANCE
    below = max(MIN_DECADES_BELOW, math.ceil(math.log10(ratio)) if ratio > 1 else 0)
    grid = [principled * 10.0**i for i in range(-below, DECADES_ABOVE + 1)]

    def candidate(kappa: float) -> tuple[MNVIPosterior, Scored]:
        c = (
            base
            if kappa == principled
            else replace(base, kl_weight=kappa, rho0=start_rho(base.rho0, kappa / principled))
        )
        post = run(c)
        return post, val.predictive(post)

    post, sel = select_on_grid(
        "kl_weight",
        grid,
        candidate,
        val.labels,
        base.select_by,
        map_probs=val.map_probs,
        map_logits=val.map_logits,
        principled=principled,
        map_side="low",
    )
    crit = sel.criterion.value
    sel.extra["map_limit_gap"] = sel.curve[0][crit] - sel.map_scores[crit]
    sel.extra["fixed"] = {"prior_var": base.prior_var}
    sel.extra["start"] = f"rho0 such that softplus(rho0) = {a0:.4g} * kl_weight / {principled:.4g}"
    post.selection = sel
    post.meta["val_nll"] = next(row["nll"] for row in sel.curve if row["kl_weight"] == sel.chosen)
    return post
