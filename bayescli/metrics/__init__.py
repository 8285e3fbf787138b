"""Metrics on predicted probabilities: :mod:`~bayescli.metrics.classification` (softmax
classifiers, ``probs [N, K]``, labels ``[N]``) and :mod:`~bayescli.metrics.multilabel` (a
probability per label, ``probs [N, K]``, labels ``[N, K]``)."""
