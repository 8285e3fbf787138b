"""bayescli: post-hoc Bayesian uncertainty for pretrained classifiers.

The most used pieces are importable from the top level::

    from bayescli import load_classifier, load_data, extract_features, fit_laplace, predict
    from bayescli import laplace_bridge, uncertainty_topk, dirichlet_from_samples
"""

__version__ = "0.1.0"

from bayescli.data import load_data  # noqa: E402
from bayescli.features import extract_features  # noqa: E402
from bayescli.models import load_classifier  # noqa: E402
from bayescli.posterior import LaplacePosterior, LogitGaussian, fit_laplace  # noqa: E402
from bayescli.predictive.dirichlet import (  # noqa: E402
    aggregate,
    beta_marginals,
    dirichlet_entropy,
    dirichlet_from_samples,
    dirichlet_to_gaussian,
    entropy_of_mean,
    expected_entropy,
    laplace_bridge,
    log_density,
    mean,
    mutual_information,
    precision,
    variance,
)
from bayescli.predictive.glm import predict  # noqa: E402
from bayescli.predictive.links import apply_link  # noqa: E402
from bayescli.predictive.topk import uncertainty_topk  # noqa: E402

__all__ = [
    "LaplacePosterior",
    "LogitGaussian",
    "aggregate",
    "apply_link",
    "beta_marginals",
    "dirichlet_entropy",
    "dirichlet_from_samples",
    "dirichlet_to_gaussian",
    "entropy_of_mean",
    "expected_entropy",
    "extract_features",
    "fit_laplace",
    "laplace_bridge",
    "load_classifier",
    "load_data",
    "log_density",
    "mean",
    "mutual_information",
    "precision",
    "predict",
    "uncertainty_topk",
    "variance",
]
