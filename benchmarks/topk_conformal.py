"""Top-k and the conformal top-k curve at any confidence: wall time on 10,000 × 10 Dirichlets.

Issue 37: scipy's Beta inverse takes ~10 ms per value at very large ``α`` (a confident net's bridge
reaches ``α = ∞``), so ``topk`` and ``conformal`` hung. Each regime here is timed: moderate ``α``
(the exact scipy path), ``α₀`` of 1e8–1e15 (the large-precision limits) and infinite ``α`` (point
masses), plus a mix of all three. Target: each under 1 s on 2 cores.

Run: ``python benchmarks/topk_conformal.py``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import setup_threads  # noqa: E402

from bayescli.predictive.conformal import TopkCurve  # noqa: E402
from bayescli.predictive.topk import uncertainty_topk  # noqa: E402


def alphas(n: int = 10_000, k: int = 10, seed: int = 0) -> dict[str, torch.Tensor]:
    """Dirichlets ``[n, k]`` of each regime."""
    rng = np.random.default_rng(seed)
    base = rng.gamma(1.0, 1.0, (n, k)) + 0.05
    moderate = base * np.exp(rng.uniform(-2, 5, (n, 1)))
    huge = base * np.exp(rng.uniform(np.log(1e8), np.log(1e15), (n, 1)))
    confident = np.full((n, k), 1e30)
    confident[np.arange(n), rng.integers(0, k, n)] = np.inf
    pick = rng.random((n, 1))
    mixed = np.where(pick < 1 / 3, moderate, np.where(pick < 2 / 3, huge, confident))
    return {
        key: torch.from_numpy(v)
        for key, v in (("moderate", moderate), ("huge", huge), ("infinite", confident), ("mixed", mixed))
    }


def main() -> None:
    setup_threads()
    labels = torch.zeros(10_000, dtype=torch.long)
    for name, alpha in alphas().items():
        t0 = time.perf_counter()
        sets = uncertainty_topk(alpha, 0.05, 10)
        t1 = time.perf_counter()
        TopkCurve(alpha, labels).at_mean_size(1.5)
        t2 = time.perf_counter()
        mean_k = np.mean([len(s) for s in sets])
        print(f"{name:>9}: topk {t1 - t0:.3f} s (mean k {mean_k:.2f}), conformal top-k curve {t2 - t1:.3f} s")


if __name__ == "__main__":
    main()
