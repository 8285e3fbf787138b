"""The device-residency harness: run a CLI command on the (emulated) GPU and on the CPU, compare.

Used by every ``test_device_*`` module. ``run_cli(cli, *args, device="cuda")`` runs
``bayescli ARGS --device cuda`` inside :func:`emulated_cuda.emulated_cuda` and returns the result,
the number of host reads that are not an iterative solver's, and the events (for messages);
``same_tensors``/``same``/``results`` compare outputs to :data:`SAME`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from emulated_cuda import emulated_cuda
from tolerance import assert_close

from bayescli.io import load_tensors

# Every op runs the CPU's kernel on the same values in the same process, so the two runs agree to
# the last bit here (observed difference 0). SAME leaves room for a BLAS call blocked differently
# should the allocator align a buffer differently; a device-dependent path (other random draws,
# a float32 detour) differs by 1e-7 or more.
SAME = 1e-9
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
    """``bayescli ARGS --device DEVICE`` (emulated when cuda); returns (result, host reads, events)."""
    if device == "cpu":
        return cli(*args, "--device", "cpu"), 0, ""
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
        assert_close(a, b, rtol=SAME, atol=1e-300, what=where)
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
