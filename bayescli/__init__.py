"""bayescli: post-hoc Bayesian uncertainty for pretrained classifiers."""

__version__ = "0.1.0"
