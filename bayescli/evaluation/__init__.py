"""Evaluation suites (in-distribution, OOD, rotation, corruption, FGSM), reports and CI gates.

:func:`evaluate` runs them as a library call and returns the report ``bayescli evaluate`` writes.
"""

from bayescli.evaluation.evaluate import evaluate

__all__ = ["evaluate"]
