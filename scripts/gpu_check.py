"""``make gpu-check``: the device checks that need a real GPU, in one run, one table at the end.

1. the device-residency tests (``tests/test_device_*.py``) on the real CUDA device, without the
   emulation (``BAYESCLI_REAL_GPU=1``: ``--device cuda`` for real, TF32 off, results compared to
   the CPU's within the tolerance for another device's float32 kernels; host reads are counted
   only by the emulated run, seeded draws are compared only there);
2. ``benchmarks/scale.py`` with ``--precision fp32`` and ``bf16`` (10,000 fit / 5,000 predict
   images of resnet50, so that both fit in the budget);
3. ``benchmarks/heads.py --device cuda``;
4. ``benchmarks/bridge.py --device cuda``.

Target: under 5 minutes on one H100/H200. Each step streams its output and has its own time
limit; the table lists each step's status, wall time and last line (the benchmarks print their
ratios there and above). Without a CUDA device it says so and exits 2, running nothing.

Run: ``python scripts/gpu_check.py`` (``--dry-run`` prints the command lines only).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCALE = ("--device", "cuda", "--images", "10000", "--predict-images", "5000")


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    env: dict[str, str]


def steps(python: str) -> list[Step]:
    """The checks, in order, with their time limits (seconds; 280 in all)."""
    device_tests = sorted(glob.glob(str(ROOT / "tests" / "test_device_*.py")))
    pytest = [python, "-m", "pytest", "-q", "--no-header", "-rfs", "-p", "no:cacheprovider", *device_tests]
    bench = ROOT / "benchmarks"
    return [
        Step("device tests, real GPU", pytest, 120, {"BAYESCLI_REAL_GPU": "1"}),
        Step("scale.py fp32", [python, str(bench / "scale.py"), *SCALE, "--precision", "fp32"], 50, {}),
        Step("scale.py bf16", [python, str(bench / "scale.py"), *SCALE, "--precision", "bf16"], 50, {}),
        Step("heads.py", [python, str(bench / "heads.py"), "--device", "cuda"], 30, {}),
        Step("bridge.py", [python, str(bench / "bridge.py"), "--device", "cuda"], 30, {}),
    ]


def run(step: Step) -> tuple[str, float, str]:
    """Run one step, streaming its output; returns (status, wall seconds, last output line)."""
    print(f"\n=== {step.name}: {' '.join(step.argv)}", flush=True)
    start = time.perf_counter()
    last = ""
    with subprocess.Popen(
        step.argv,
        cwd=ROOT,
        env=os.environ | step.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        # Killed at its limit even when it prints nothing (the read below would wait forever).
        timer = threading.Timer(step.timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                print(line, end="", flush=True)
                if line.strip():
                    last = line.strip()
            proc.wait()
        finally:
            timer.cancel()
    wall = time.perf_counter() - start
    if wall > step.timeout_s:
        status = f"timed out ({step.timeout_s} s)"
    else:
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    return status, wall, last


def table(rows: list[tuple[str, str, float, str]]) -> str:
    head = ("step", "status", "wall s", "last line")
    cells = [head, *[(n, s, f"{w:.1f}", line[:90]) for n, s, w, line in rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = [" | ".join([*(c[i].ljust(widths[i]) for i in range(3)), c[3]]) for c in cells]
    lines.insert(1, "-+-".join("-" * w for w in [*widths, 9]))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    args = parser.parse_args()
    plan = steps(sys.executable)
    if args.dry_run:
        for step in plan:
            env = " ".join(f"{k}={v}" for k, v in step.env.items())
            print(f"{step.name} (≤ {step.timeout_s} s): {env + ' ' if env else ''}{' '.join(step.argv)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
            "this check runs on a machine with an NVIDIA GPU; nothing was run. "
            "Without one, `make test-gpu` runs the whole suite on an emulated GPU.",
            file=sys.stderr,
        )
        return 2
    print(f"gpu-check on {torch.cuda.get_device_name()} (torch {torch.__version__})", flush=True)
    rows = []
    start = time.perf_counter()
    for step in plan:
        status, wall, last = run(step)
        rows.append((step.name, status, wall, last))
    rows.append(("total", "", time.perf_counter() - start, "target: under 300 s"))
    print("\n" + table(rows))
    return 0 if all(r[1] == "ok" for r in rows[:-1]) else 1


if __name__ == "__main__":
    sys.exit(main())
