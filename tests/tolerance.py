"""Tolerance-bearing assertions that can log how close each check came to failing.

Every numeric tolerance in the suite goes through :func:`assert_close` or :func:`assert_below`.
With ``BAYESCLI_TOL_LOG=FILE`` set, each call appends one JSON line
``{"test": node id, "what": label, "ratio": observed error / allowed error}`` to ``FILE``;
``scripts/tolerance_report.py`` merges such logs from runs under different thread counts and
BLAS code paths and prints the largest ratio per check (a ratio ≥ 0.1 means a margin under 10×).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch


def _array(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _record(what: str, ratio: float) -> None:
    path = os.environ.get("BAYESCLI_TOL_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"test": test, "what": what, "ratio": float(ratio)}) + "\n")


def assert_close(actual, expected, *, rtol: float = 0.0, atol: float = 0.0, what: str = "") -> float:
    """Assert ``|actual − expected| ≤ atol + rtol·|expected|`` elementwise; returns the worst ratio."""
    a, e = np.broadcast_arrays(_array(actual), _array(expected))
    if not (np.isfinite(a).all() and np.isfinite(e).all()):
        raise AssertionError(f"{what}: non-finite values")
    allowed = atol + rtol * np.abs(e)
    if (allowed <= 0).any():
        raise AssertionError(f"{what}: a tolerance of zero cannot be met reliably")
    ratio = float((np.abs(a - e) / allowed).max()) if a.size else 0.0
    _record(what, ratio)
    assert ratio <= 1.0, f"{what}: error is {ratio:.3g}× the allowed (rtol={rtol:g}, atol={atol:g})"
    return ratio


def assert_below(value, bound: float, *, what: str = "") -> float:
    """Assert a non-negative error measure ``value < bound``; returns ``value / bound``."""
    v = float(np.max(_array(value)))
    if not np.isfinite(v):
        raise AssertionError(f"{what}: non-finite value")
    ratio = v / bound
    _record(what, ratio)
    assert v < bound, f"{what}: {v:.3g} is not below {bound:g}"
    return ratio
