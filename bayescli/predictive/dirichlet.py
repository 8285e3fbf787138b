"""The Laplace bridge and Dirichlet utilities, as the predictive layer's importers know them.

The maths lives on floor 1 in :mod:`bayescli.dirichlet` (posteriors need it too); this module
re-exports it so that ``from bayescli.predictive import dirichlet`` keeps working.
"""

from bayescli.dirichlet import (
    aggregate,
    beta_marginals,
    bridge_alpha,
    bridge_log_alpha,
    correct,
    dirichlet_entropy,
    dirichlet_from_samples,
    dirichlet_to_gaussian,
    dirichlet_to_gaussian_diag,
    entropy_of_mean,
    expected_entropy,
    fit_precision,
    laplace_bridge,
    log_density,
    mean,
    mutual_information,
    precision,
    smoothed,
    variance,
)

__all__ = [
    "aggregate",
    "beta_marginals",
    "bridge_alpha",
    "bridge_log_alpha",
    "correct",
    "dirichlet_entropy",
    "dirichlet_from_samples",
    "dirichlet_to_gaussian",
    "dirichlet_to_gaussian_diag",
    "entropy_of_mean",
    "expected_entropy",
    "fit_precision",
    "laplace_bridge",
    "log_density",
    "mean",
    "mutual_information",
    "precision",
    "smoothed",
    "variance",
]
