"""Seed 003's recipe for the linearised-model methods from scratch: train the MAP network, then fit
the method post hoc on it (GLM VI, GGP VI)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bayescli.data import ArrayData
from bayescli.fitting.fit_source import FitSource
from bayescli.models.specs import Classifier, LoadedModel, ModelSpec
from bayescli.options import TrainConfig
from bayescli.posterior.base import Posterior
from bayescli.posterior.vi.prior_precision import TRAINER_GRID
from bayescli.training.classifier import train_classifier


def train_map_then_fit(
    model_spec: str,
    train: ArrayData,
    val: ArrayData | None,
    settings: Any,
    device: torch.device,
    fit_over_grid: Callable[[FitSource, Any, list[float]], Posterior],
) -> tuple[Classifier, dict, Posterior]:
    """Train the MAP network (the trainer's defaults, seeded with ``settings.seed``), then fit the
    method with ``fit_over_grid``.

    ``settings.epochs``/``settings.lr`` are the method's optimiser's; the MAP run uses
    :class:`TrainConfig`. δ is chosen on ``val`` only with ``select=True`` (over the seed's grid);
    otherwise it is the given ``prior_precision`` or the Laplace marginal-likelihood optimum.
    """
    clf, meta = train_classifier(model_spec, train, val, TrainConfig(seed=settings.seed), device)
    loaded = LoadedModel(clf, ModelSpec.parse(model_spec), Path(), "", meta)
    selecting = settings.select is True
    source = FitSource(loaded, train, val if selecting else None, device)
    post = fit_over_grid(source, dataclasses.replace(settings, select=selecting), TRAINER_GRID)
    return clf, meta, post
