"""GLM VI from scratch: train the MAP network, then fit GLM VI on it post hoc (seed 003's recipe)."""

from __future__ import annotations

import torch

from bayescli.data import ArrayData
from bayescli.models.specs import Classifier
from bayescli.posterior.vi.glm_vi import GLMVIConfig, GLMVIPosterior, fit_over_grid
from bayescli.training.map_then_fit import train_map_then_fit


def train(
    model_spec: str, train: ArrayData, val: ArrayData | None, settings: GLMVIConfig, device: torch.device
) -> tuple[Classifier, dict, GLMVIPosterior]:
    """See :func:`~bayescli.training.map_then_fit.train_map_then_fit`."""
    return train_map_then_fit(model_spec, train, val, settings, device, fit_over_grid)
