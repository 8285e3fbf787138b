"""Fitting: what turns a trained classifier and data into a fitted posterior.

* :mod:`~bayescli.fitting.registry` — one entry per post-hoc method (settings, ``fit``, posterior
  class, capabilities); every other list of methods is derived from it;
* :mod:`~bayescli.fitting.fit_source` — what a method's ``fit`` receives (model, data, validation
  data, device; features computed once);
* :mod:`~bayescli.fitting.laplace` — Laplace as a registered method (settings, δ selection);
* :mod:`~bayescli.fitting.pipeline` — load → features → fit → tune → provenance → save;
* :mod:`~bayescli.fitting.select` — ``bayescli select``: fit several methods and rank them.
"""
