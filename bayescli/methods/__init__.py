"""The methods layer: what turns a trained classifier and data into a fitted posterior.

* :mod:`~bayescli.methods.registry` — one entry per post-hoc method (settings, ``fit``, posterior
  class, capabilities); every other list of methods is derived from it;
* :mod:`~bayescli.methods.fit_source` — what a method's ``fit`` receives (model, data, validation
  data, device; features computed once);
* :mod:`~bayescli.methods.laplace` — Laplace as a registered method (settings, δ selection);
* :mod:`~bayescli.methods.fitting` — load → features → fit → tune → provenance → save;
* :mod:`~bayescli.methods.select` — ``bayescli select``: fit several methods and rank them.
"""
