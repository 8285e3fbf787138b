"""GLM VI from scratch: train the MAP network, then fit GLM VI on it post hoc (seed 003's recipe)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from bayescli.data import ArrayData
from bayescli.fit_source import FitSource
from bayescli.models import Classifier, LoadedModel, ModelSpec
from bayescli.options import TrainConfig
from bayescli.posterior.vi.glm_vi import GLMVIConfig, GLMVIPosterior, fit_over_grid
from bayescli.posterior.vi.prior_precision import TRAINER_GRID
from bayescli.training.classifier import train_classifier


def train(
    model_spec: str, train: ArrayData, val: ArrayData | None, settings: GLMVIConfig, device: torch.device
) -> tuple[Classifier, dict, GLMVIPosterior]:
    """Train the MAP network (the trainer's defaults, seeded with ``settings.seed``), then fit GLM VI.

    ``settings.epochs``/``settings.lr`` are the VI iteration's; the MAP run uses :class:`TrainConfig`.
    δ is chosen on ``val`` only with ``select=True`` (over the seed's grid); otherwise it is the given
    ``prior_precision`` or the Laplace marginal-likelihood optimum.
    """
    clf, meta = train_classifier(model_spec, train, val, TrainConfig(seed=settings.seed), device)
    loaded = LoadedModel(clf, ModelSpec.parse(model_spec), Path(), "", meta)
    selecting = settings.select is True
    source = FitSource(loaded, train, val if selecting else None, device)
    post = fit_over_grid(source, dataclasses.replace(settings, select=selecting), TRAINER_GRID)
    return clf, meta, post
