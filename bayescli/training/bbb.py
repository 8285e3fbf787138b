"""Bayes by Backprop from scratch on a builtin network (the seed's BBB row)."""

from __future__ import annotations

from dataclasses import asdict

import torch

from bayescli.data import ArrayData
from bayescli.errors import BayescliError, require
from bayescli.models.specs import Classifier, ModelSpec, build_network, builtin_names, last_linear_name
from bayescli.posterior.vi.bbb import (
    SCRATCH_PRIOR_PRECISION,
    BBBConfig,
    BBBPosterior,
    fit_mean_field,
    validation,
)
from bayescli.posterior.vi.prior_precision import SELECT_GRID, Default, Grid, require_validation
from bayescli.training.classifier import channel_stats, checkpoint_metadata

# The seed's grid, searched as is: every candidate is a full training run.
SCRATCH_GRID = Grid(SELECT_GRID, extensions=0, extend_by=0)


def train(
    model_spec: str, train: ArrayData, val: ArrayData | None, settings: BBBConfig, device: torch.device
) -> tuple[Classifier, dict, BBBPosterior]:
    """BBB from scratch on a builtin network; the returned classifier carries the means.

    δ: ``settings.prior_precision``; with ``select=True`` the best on ``val`` over the seed's grid
    (one training run per value); else :data:`SCRATCH_PRIOR_PRECISION`.
    """
    spec = ModelSpec.parse(model_spec)
    if spec.kind != "builtin":
        raise BayescliError(
            f"bbb trains builtin models from scratch ({', '.join(builtin_names())}); got {spec}"
        )
    require(train.y is not None, f"{train.spec} has no labels; training needs labelled data")
    require_validation(settings.select, val is not None)
    selecting = settings.select is True
    torch.manual_seed(settings.seed)
    net = build_network(spec, train.num_classes, train.input_shape, {})
    mean, std = channel_stats(train)
    clf = Classifier(net, last_linear_name(net), mean, std)
    held_out = None
    if selecting:
        held_out = validation(clf, val, settings.samples, settings.select_by, 256, None)

    def default() -> Default:
        return Default(
            SCRATCH_PRIOR_PRECISION, "default", "1.0, the from-scratch default (no trained weights)"
        )

    post = fit_mean_field(
        clf, train, settings, device, default, held_out, SCRATCH_GRID if selecting else None
    )
    post.meta["start"] = "scratch"
    offset = 0
    with torch.no_grad():
        for p in clf.net.parameters():
            p.copy_(post.mean[offset : offset + p.numel()].reshape(p.shape))
            offset += p.numel()
    clf.eval()
    training, loss = {"method": "bbb", **asdict(settings)}, post.meta["vi"]["objective"]
    meta = checkpoint_metadata(spec, clf, train, val, device, (mean, std), training, loss)
    return clf, meta, post
