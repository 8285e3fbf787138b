"""Weight posteriors: curvature (BackPACK and closed form), Gaussian families, prior tuning."""

from bayescli.posterior.gaussian import (
    DiagGaussian,
    FullGaussian,
    KronGaussian,
    LogitGaussian,
    WeightGaussian,
)
from bayescli.posterior.laplace import (
    CurvatureType,
    HessianStructure,
    LaplacePosterior,
    Subset,
    fit_laplace,
)

__all__ = [
    "CurvatureType",
    "DiagGaussian",
    "FullGaussian",
    "HessianStructure",
    "KronGaussian",
    "LaplacePosterior",
    "LogitGaussian",
    "Subset",
    "WeightGaussian",
    "fit_laplace",
]
