"""GLM VI and GGP VI speed on a large last layer: 20,000 synthetic 512-d features, K = 100.

* GLM VI (last layer, default schedule: 250 natural-gradient iterations, Monte-Carlo expectations
  with 16 draws): seconds and peak RSS for ``diag``; ``full`` has 100·513 = 51,300 > 20,000
  parameters and is refused (the Laplace limit), which is reported.
* GGP VI (M = 500 inducing points, minibatch 256): seconds per epoch (fits of 1 and 3 epochs;
  their difference over two).

Each part runs in a child process so its peak RSS is its own. Threads: 2 (``--threads``).

Run: ``python benchmarks/glm_vi_bench.py``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import peak_rss_gib  # noqa: E402

from bayescli.data import ArrayData  # noqa: E402
from bayescli.errors import BayescliError  # noqa: E402
from bayescli.fit_source import FitSource  # noqa: E402
from bayescli.models import Classifier, LoadedModel, ModelSpec  # noqa: E402
from bayescli.posterior.vi import ggp_vi, glm_vi  # noqa: E402

N, D, K = 20_000, 512, 100


def problem() -> tuple[LoadedModel, ArrayData]:
    """Features from a Gaussian, labels from a softmax of a random linear map; the "pretrained" head
    is that map (a head at a good but not optimal point, as after training)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=gen)
    w = torch.randn(K, D, generator=gen) * 0.15
    y = torch.multinomial((x @ w.T).softmax(-1), 1, generator=gen).squeeze(1)
    head = nn.Linear(D, K)
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.zero_()
    model = LoadedModel(Classifier(nn.Sequential(head), "0"), ModelSpec.parse("builtin:mlp"), Path(), "", {})
    return model, ArrayData(x, y, [str(k) for k in range(K)])


def cpu_seconds() -> float:
    """User + system CPU time of this process so far: on a shared machine, CPU/threads estimates the
    uncontended wall time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_part(part: str) -> dict:
    model, data = problem()
    cpu = torch.device("cpu")
    start, cpu0 = time.perf_counter(), cpu_seconds()
    if part.startswith("glm"):
        cov = part.split("-")[1]
        try:
            source = FitSource(model, data, device=cpu, batch_size=1024)
            post = glm_vi.fit(source, glm_vi.GLMVIConfig(covariance=cov))
        except BayescliError as exc:
            return {"part": part, "refused": str(exc)}
        vi = post.meta["vi"]
        return {
            "part": part,
            "seconds": time.perf_counter() - start,
            "cpu_seconds": cpu_seconds() - cpu0,
            "peak_rss_gib": peak_rss_gib(),
            "prior_precision": post.prior_precision,
            "elbo_first": vi["elbo_first"],
            "elbo_last": vi["elbo_last"],
            "residuals": vi["fixed_point_residuals"],
        }
    # one fit of 1 epoch and one of 3: the difference is two epochs (whitening and projections cancel)
    walls, cpus = [], []
    for epochs in (1, 3):
        t0, c0 = time.perf_counter(), cpu_seconds()
        settings = ggp_vi.GGPVIConfig(inducing_points=500, prior_precision=1.0, epochs=epochs)
        post = ggp_vi.fit(FitSource(model, data, device=cpu), settings)
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu_seconds() - c0)
    return {
        "part": part,
        "seconds_per_epoch": (walls[1] - walls[0]) / 2,
        "cpu_seconds_per_epoch": (cpus[1] - cpus[0]) / 2,
        "one_epoch_fit_seconds": walls[0],
        "rank": post.meta["vi"]["rank"],
        "peak_rss_gib": peak_rss_gib(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.part:
        print(json.dumps(run_part(args.part)))
        return
    print(f"N={N}, D={D}, K={K}; torch {torch.__version__}, {args.threads} threads")
    for part in ("glm-diag", "glm-full", "ggp"):
        cmd = [sys.executable, __file__, "--part", part, "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
