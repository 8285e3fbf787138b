"""The device-residency harness: run a CLI command on the (emulated) GPU and on the CPU, compare.

Used by every ``test_device_*`` module. ``run_cli(cli, *args, device="cuda")`` runs
``bayescli ARGS --device cuda`` inside :func:`emulated_cuda.emulated_cuda` and returns the result,
the number of host reads that are not an iterative solver's, and the events (for messages);
``same_tensors``/``same``/``results`` compare outputs to :data:`SAME`.

With ``BAYESCLI_REAL_GPU=1`` (``make gpu-check``, on a machine with CUDA) the same tests run on
the real device: ``run_cli`` runs ``--device cuda`` without emulation, host reads cannot be
counted (it returns ``None`` for them, so read-count comparisons hold trivially: the emulated run
checks them), and :data:`SAME` becomes :data:`DEVICE_TOL`, the tolerance for another device's
float32 kernels. Seeded draws differ between devices (other generators), so tests compare
stochastic outputs only where :data:`SAME_DRAWS` is true.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from emulated_cuda import emulated_cuda
from tolerance import assert_close

from bayescli.io import load_tensors

# Every op runs the CPU's kernel on the same values in the same process, so the two runs agree to
# the last bit here (observed difference 0). SAME leaves room for a BLAS call blocked differently
# should the allocator align a buffer differently; a device-dependent path (other random draws,
# a float32 detour) differs by 1e-7 or more.
EMULATED_SAME = 1e-9
# On a real GPU (TF32 off, see conftest.py) every float32 sum of n terms is computed in another
# order than on the CPU: each lies within γ_n·Σ|terms| of the exact sum (Higham §3.1, γ_n ≈ n·2⁻²⁴),
# so the two differ by ≤ 2γ_n relative to the terms' magnitude. The small CNN's float32 layers sum
# 9, 288, 1,024 and 128 terms (the curvature sums after them are float64); to first order their
# errors add: 2(γ_9 + γ_288 + γ_1024 + γ_128) ≈ 1.7e-4 of the outputs' scale, which the fit and the
# predictive carry on (well-conditioned here). Measured on an H200: probabilities within 8e-7.
DEVICE_TOL = 2e-4
REAL_GPU = os.environ.get("BAYESCLI_REAL_GPU", "") not in ("", "0")
SAME = DEVICE_TOL if REAL_GPU else EMULATED_SAME
# Whether seeded random draws (MC links, VI fits, BBB) are the CPU's: on the emulated device yes
# (CPU generators), on a real one no.
SAME_DRAWS = not REAL_GPU
BATCHES = (32, 128)  # digits:train (1,078 rows) → 34 vs 9 batches; digits:test (360) → 12 vs 3
# Where iterative solvers read a scalar per step: the marglik root (Brent), the temperature
# (bounded Brent), Minka's fixed point (its count of rows still moving).
SOLVERS = (
    "bayescli/posterior/prior.py:",
    "bayescli/evaluation/temperature.py:",
    " in fit_precision",
    " in _minka_iterate_masked",
)


def run_cli(cli, *args, device: str):
    """``bayescli ARGS --device DEVICE`` (emulated when cuda, unless ``BAYESCLI_REAL_GPU``);
    returns (result, host reads or None where they cannot be counted, events)."""
    if device == "cpu":
        return cli(*args, "--device", "cpu"), 0, ""
    if REAL_GPU:
        return cli(*args, "--device", "cuda"), None, "(host reads are counted on the emulated GPU only)"
    with emulated_cuda() as stats:
        res = cli(*args, "--device", "cuda")
    report = stats.report()
    reads = [line for line in report.splitlines() if not any(s in line for s in SOLVERS)]
    return res, len(reads), report


def same_tensors(a: Path, b: Path) -> tuple[dict, dict]:
    """Equal tensors in two safetensors files (to ``SAME``); returns both headers."""
    ta, ma = load_tensors(a)
    tb, mb = load_tensors(b)
    assert sorted(ta) == sorted(tb)
    for key in ta:
        assert ta[key].device.type == "cpu" and tb[key].device.type == "cpu"  # files are device-free
        scale = float(tb[key].double().abs().max()) if tb[key].numel() else 0.0
        assert_close(ta[key], tb[key], rtol=SAME, atol=SAME * scale + 1e-300, what=key)
    return ma, mb


def same(a, b, where: str = "") -> None:
    """Equal JSON-like structures; floats to ``SAME`` relative."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), where
        for key in a:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float) and math.isfinite(a):
        # report floats are O(1) metrics; near zero another device's rounding is absolute
        assert_close(a, b, rtol=SAME, atol=SAME if REAL_GPU else 1e-300, what=where)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, where


def results(path: Path) -> dict:
    """A JSON output without what legitimately differs between devices (device, timings)."""
    out = json.loads(path.read_text())
    for key in ("timings", "environment"):
        out.pop(key, None)
    return out
