"""bayescli: post-hoc Bayesian uncertainty for pretrained classifiers.

The Python API (an ``nn.Module`` and a ``DataLoader`` in hand)::

    import bayescli
    post = bayescli.fit(net, train_loader, "laplace", val=val_loader)   # or "mnvi", "glm-vi", …
    pred = post.predict(test_loader)                                      # .probs [N, K]
    post.save("laplace.safetensors"); post = bayescli.load("laplace.safetensors", model=net)
    report = bayescli.evaluate([post], test_loader, ood=[ood_loader])
    bayescli.methods(); bayescli.settings("laplace")
    board, posteriors = bayescli.select(net, train_loader, val_loader, ood=[ood_loader])

Lower-level pieces are importable from the top level too::

    from bayescli import load_classifier, load_data, extract_features, fit_laplace, predict
    from bayescli import laplace_bridge, uncertainty_topk, dirichlet_from_samples
"""

from __future__ import annotations

import importlib

from bayescli._version import __version__

# Re-exports are resolved on first use, so ``import bayescli`` (and ``bayescli --help``) does not
# pay for torch, timm and matplotlib.
_EXPORTS = {
    "aggregate": "bayescli.predictive.dirichlet",
    "apply_link": "bayescli.predictive.links",
    "BayescliWarning": "bayescli.errors",
    "beta_marginals": "bayescli.predictive.dirichlet",
    "dirichlet_entropy": "bayescli.predictive.dirichlet",
    "dirichlet_from_samples": "bayescli.predictive.dirichlet",
    "dirichlet_to_gaussian": "bayescli.predictive.dirichlet",
    "entropy_of_mean": "bayescli.predictive.dirichlet",
    "expected_entropy": "bayescli.predictive.dirichlet",
    "evaluate": "bayescli.api",
    "extract_features": "bayescli.models.features",
    "fit": "bayescli.api",
    "FitSource": "bayescli.fitting.fit_source",
    "fit_laplace": "bayescli.posterior",
    "laplace_bridge": "bayescli.predictive.dirichlet",
    "LaplacePosterior": "bayescli.posterior",
    "load": "bayescli.api",
    "load_posterior": "bayescli.posterior.base",
    "load_classifier": "bayescli.models.specs",
    "load_data": "bayescli.data",
    "log_density": "bayescli.predictive.dirichlet",
    "LogitGaussian": "bayescli.posterior",
    "LowAccuracyWarning": "bayescli.errors",
    "mean": "bayescli.predictive.dirichlet",
    "methods": "bayescli.api",
    "Posterior": "bayescli.posterior.base",
    "mutual_information": "bayescli.predictive.dirichlet",
    "precision": "bayescli.predictive.dirichlet",
    "predict": "bayescli.predictive.glm",
    "ResizeWarning": "bayescli.errors",
    "select": "bayescli.api",
    "settings": "bayescli.api",
    "uncertainty_topk": "bayescli.predictive.topk",
    "variance": "bayescli.predictive.dirichlet",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str):
    if name in _EXPORTS:
        if _EXPORTS[name] != "bayescli.errors":
            # the API installs Posterior.predict: every posterior reached from here can predict
            importlib.import_module("bayescli.api")
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'bayescli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
