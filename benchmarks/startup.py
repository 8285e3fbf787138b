"""Start-up cost of the CLI: ``bayescli --help`` / ``--version`` and a subcommand's help.

Each is run as a fresh process (the way a user or a CI job calls it) after one warm-up run, so the
disk cache is warm; the table shows the median and the best of the runs against the 0.5 s target,
and the time of ``python -c pass`` as the floor no CLI can go below.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET = 0.5
RUNS = 7


def wall(cmd: list[str]) -> list[float]:
    subprocess.run(cmd, capture_output=True, check=True)
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    exe = shutil.which("bayescli") or str(Path(sys.executable).with_name("bayescli"))
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "bayescli --version": [exe, "--version"],
        "bayescli --help": [exe, "--help"],
        "bayescli evaluate --help": [exe, "evaluate", "--help"],
        "import bayescli (lazy top level)": [sys.executable, "-c", "import bayescli"],
    }
    print(f"{'command':<34} {'median s':>9} {'best s':>8}  target ≤ {TARGET} s")
    for name, cmd in cases.items():
        t = wall(cmd)
        print(f"{name:<34} {statistics.median(t):9.3f} {min(t):8.3f}")


if __name__ == "__main__":
    main()
