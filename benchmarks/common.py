"""Timing helpers shared by the benchmark scripts."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from pathlib import Path

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


def cpu_seconds() -> float:
    """User + system CPU time of this process so far: on a shared machine, CPU/threads estimates the
    uncontended wall time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def linear_head_problem(rows: int, dim: int, classes: int) -> tuple[object, torch.Tensor, torch.Tensor]:
    """``(model, x [rows, dim], y [rows])``: Gaussian features labelled by a softmax of a random
    linear map ``W [classes, dim]`` (scale 0.15), and a "pretrained" model whose head is that map (a
    good but not optimal point, as after training)."""
    from torch import nn

    from bayescli.models.specs import Classifier, LoadedModel, ModelSpec

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, dim, generator=gen)
    w = torch.randn(classes, dim, generator=gen) * 0.15
    y = torch.multinomial((x @ w.T).softmax(-1), 1, generator=gen).squeeze(1)
    head = nn.Linear(dim, classes)
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.zero_()
    spec = ModelSpec.parse("builtin:mlp")
    return LoadedModel(Classifier(nn.Sequential(head), "0"), spec, Path(), "", {}), x, y


def setup_threads() -> str:
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads"
