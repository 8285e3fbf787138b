"""Timing helpers shared by the benchmark scripts."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable

import torch


def best_of(fn: Callable[[], object], repeat: int = 5, device: torch.device | str = "cpu") -> float:
    """Best wall time of ``repeat`` calls after one warm-up (seconds); on a GPU each call is timed
    from an idle queue to an idle queue."""
    from bayescli.devices import synchronize

    fn()
    times = []
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (GiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def setup_threads() -> str:
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads"
