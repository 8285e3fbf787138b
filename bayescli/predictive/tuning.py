"""Prior precision by validation NLL (``--prior-precision val-nll``)."""

from __future__ import annotations

import numpy as np

from bayescli.data import Data
from bayescli.errors import BayescliError
from bayescli.features import Features
from bayescli.metrics import nll
from bayescli.models import Classifier
from bayescli.options import Link, Predictive
from bayescli.posterior.laplace import LaplacePosterior
from bayescli.posterior.prior import grid_search
from bayescli.predictive.glm import predict

DEFAULT_GRID = [float(v) for v in np.logspace(-4, 4, 33)]


def tune_prior_val_nll(
    posterior: LaplacePosterior,
    val: Features,
    predictive: Predictive | str = Predictive.GLM,
    link: Link | str = Link.PROBIT,
    grid: list[float] | None = None,
    samples: int = 100,
    seed: int = 0,
    classifier: Classifier | None = None,
    val_data: Data | None = None,
) -> float:
    """Set ``δ`` to the grid value with the lowest validation NLL under (predictive, link)."""
    if val.labels is None:
        raise BayescliError("--prior-precision val-nll needs labelled validation data")

    def objective(delta: float) -> float:
        posterior.gaussian.with_delta(delta)
        pred = predict(posterior, val, predictive, link, samples, seed, classifier, val_data)
        return nll(pred.probs, val.labels)

    best, curve = grid_search(objective, grid or DEFAULT_GRID)
    posterior.set_prior_precision(best, "val-nll", curve)
    posterior.meta["prior"]["objective"] = (
        f"validation NLL ({Predictive(predictive).value}, {Link(link).value})"
    )
    return best
