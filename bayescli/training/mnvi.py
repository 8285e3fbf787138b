"""MNVI from scratch: train a builtin network's variational means and noise together ([002]).

Every linear/conv layer of a freshly initialised builtin network gets multiplicative noise;
means (the network's weights), biases, BatchNorm and ρ are trained on the objective of
:mod:`bayescli.posterior.vi.mnvi_objective` with the [002] LeNet/MNIST defaults of
:class:`~bayescli.posterior.vi.mnvi.MNVIConfig`. Training several networks is costly, so κ/N and
σ² are chosen on validation data only with ``select=True``.

Multi-label data (labels ``[N, K]``) trains a sigmoid-per-label network (``likelihood
"bernoulli"``, recorded in the checkpoint and the posterior): the objective's expected NLL is the
Bernoulli one (:mod:`bayescli.posterior.vi.mnvi_objective`), validation scores are per label.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace

import torch

from bayescli.data import ArrayData
from bayescli.errors import BayescliError, require
from bayescli.models.specs import Classifier, ModelSpec, build_network, builtin_names, last_linear_name
from bayescli.options import Subset
from bayescli.posterior.selection import Scored, Selection, select_on_grid, unvalidated
from bayescli.posterior.vi.mnvi import MNVIConfig, check_select, network_predictive
from bayescli.posterior.vi.mnvi_objective import fit_network_once
from bayescli.posterior.vi.mnvi_posterior import MNVIPosterior
from bayescli.posterior.vi.moments import MomentPropagator
from bayescli.training.classifier import channel_stats, checkpoint_metadata

# The [002] grid's range (VI-SPEC C3): κ/N for LeNet/MNIST and its neighbours, σ² over 3 decades.
KL_WEIGHT_GRID = (2e-8, 5e-8, 2e-7)
PRIOR_VAR_GRID = (1e-4, 1e-3, 1e-2)
RULE = "[002] LeNet/MNIST kl_weight = 2e-7, prior_var = 1e-3 (select=True chooses them on validation data)"


def train(
    model_spec: str, train: ArrayData, val: ArrayData | None, settings: MNVIConfig, device: torch.device
) -> tuple[Classifier, dict, MNVIPosterior]:
    """Train a builtin network with MNVI from scratch ([002] setting; see :class:`MNVIConfig`).

    Returns the classifier (the variational means as its weights; BatchNorm statistics from the
    means), checkpoint metadata as :func:`bayescli.training.classifier.train_classifier` writes
    it, and the all-layer posterior (``mean-and-noise``). With ``select=True`` every κ/N of
    :data:`KL_WEIGHT_GRID` is trained for each σ² of :data:`PRIOR_VAR_GRID` (or the given σ²)
    and the lowest validation ``select_by`` wins; ``post.selection`` is the κ record of the
    winning σ² with ``prior_var`` (grid, chosen, each σ²'s best score) in its ``extra``.
    """
    s = replace(settings, subset="all", variant="mean-and-noise")
    check_select(s)
    spec = ModelSpec.parse(model_spec)
    if spec.kind != "builtin":
        raise BayescliError(f"MNVI trains builtin models only ({', '.join(builtin_names())}); got {spec}")
    require(train.y is not None, f"{train.spec} has no labels; training needs labelled data")
    require(val is None or val.y is not None, "the validation data (val) has no labels")
    require(
        not (s.select is True and val is None),
        "select=True chooses kl_weight and prior_var on validation data, but there is none; pass "
        "validation data (val) or leave select unset",
    )
    device = torch.device(device)
    start = time.perf_counter()
    k = train.num_classes
    # the labels say which: `bayescli train` checks them against --likelihood before training
    likelihood = "bernoulli" if train.multilabel else "categorical"
    mean, std = channel_stats(train)

    def build(c: MNVIConfig) -> MNVIPosterior:
        torch.manual_seed(c.seed)
        net = build_network(spec, k, train.input_shape, {})
        clf = Classifier(net, last_linear_name(net), mean, std).to(device)
        prop = MomentPropagator(net)
        rho, curve = fit_network_once(
            clf, prop, train, c, device, {}, list(net.parameters()), True, likelihood
        )
        means = {}
        for name in prop.layers:
            mod = prop.layer(name)
            means[f"{name}.weight"] = mod.weight.detach().clone()
            if mod.bias is not None:
                means[f"{name}.bias"] = mod.bias.detach().clone()
        post = MNVIPosterior(Subset.ALL, "mean-and-noise", rho, means, asdict(c), likelihood=likelihood)
        post.meta.update({"curve": curve, "n_data": len(train)})
        post._cache["clf"] = clf
        return post

    def predictive(post: MNVIPosterior) -> Scored:
        return network_predictive(post, post._cache["clf"], val, device, 256, s.seed)

    base = s.resolved(True, len(train), 0.0)
    if s.select:
        post = _select(base, s.prior_var is None, build, predictive, val.y.to(device))
    else:
        post = build(base)
        if val is not None:
            post.meta["val_nll"] = predictive(post).scores(val.y)["nll"]
        post.selection = (
            unvalidated("kl_weight", s.kl_weight, "given", fixed=True)
            if s.kl_weight is not None
            else unvalidated("kl_weight", base.kl_weight, RULE)
        )
    clf = post._cache.pop("clf")
    post.meta["fit_seconds"] = time.perf_counter() - start
    training = {"method": "mnvi", **post.config}
    loss = [c["objective"] for c in post.meta["curve"]]
    meta = checkpoint_metadata(
        spec, clf, train, val, device, (mean, std), training, loss, likelihood=likelihood
    )
    kept = ("curve", "fit_seconds", "val_nll")
    meta["mnvi"] = {k: post.meta[k] for k in kept if k in post.meta}
    meta["mnvi"]["selection"] = post.selection.record()
    return clf, meta, post


def _select(
    base: MNVIConfig,
    search_prior_var: bool,
    build: Callable[[MNVIConfig], MNVIPosterior],
    predictive: Callable[[MNVIPosterior], Scored],
    labels: torch.Tensor,
) -> MNVIPosterior:
    """κ/N on :data:`KL_WEIGHT_GRID` for each σ² (the grid, or the given one); no extension beyond
    the grid and no MAP limit (each candidate is a network trained from scratch)."""
    best: tuple[float, MNVIPosterior, Selection] | None = None
    per_prior_var = []
    for prior_var in PRIOR_VAR_GRID if search_prior_var else (base.prior_var,):

        def candidate(kappa: float, prior_var: float = prior_var) -> tuple[MNVIPosterior, Scored]:
            post = build(replace(base, kl_weight=kappa, prior_var=prior_var))
            return post, predictive(post)

        post, sel = select_on_grid(
            "kl_weight", list(KL_WEIGHT_GRID), candidate, labels, base.select_by,
            principled=2e-7, extensions=0,
        )  # fmt: skip
        score = next(r[sel.criterion.value] for r in sel.curve if r["kl_weight"] == sel.chosen)
        per_prior_var.append({"prior_var": prior_var, "kl_weight": sel.chosen, sel.criterion.value: score})
        if best is None or score < best[0]:
            best = (score, post, sel)
    _, post, sel = best
    sel.extra["prior_var"] = {
        "grid": [r["prior_var"] for r in per_prior_var],
        "chosen": post.config["prior_var"],
        "best": per_prior_var,
    }
    post.selection = sel
    post.meta["val_nll"] = next(r["nll"] for r in sel.curve if r["kl_weight"] == sel.chosen)
    return post
