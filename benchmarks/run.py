"""Run every benchmark in one go (``make bench``) and print their tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent

if __name__ == "__main__":
    for script in ("startup.py", "heads.py", "bridge.py", "pipeline.py", "ggp.py"):
        print(f"\n=== {script}", flush=True)
        subprocess.run([sys.executable, str(HERE / script)], check=False)
