"""Post-hoc last-layer FSVI at ImageNet head scale: fit cost, peak memory, predictive cost.

Synthetic post-ReLU features, N = 20,000 training inputs, D = 2048 → K = 1000, a context pool of
2048 feature vectors, 64 context points per step, every other setting at its FSVIConfig default.
Reports seconds per epoch and in total (target ≤ 5 min on 2 cores), the process's peak RSS
(target ≤ 3 GiB), and the exact logit Gaussian over 10,000 inputs as a ratio to the plain head
forward (target ≤ 3×). The machine's load average is printed: the cores may be shared.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/fsvi_bench.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, peak_rss_gib, setup_threads  # noqa: E402

from bayescli.posterior.vi.fsvi import FSVIConfig, fit_last_layer  # noqa: E402

N_TRAIN, N_TEST, D, K, POOL = 20_000, 10_000, 2048, 1000, 2048


def synthetic(
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """Features ``relu(N(0, I))``, a head that labels them (plus noise), a context pool, test inputs."""
    head = torch.nn.Linear(D, K)
    with torch.no_grad():
        head.weight.copy_(torch.randn(K, D, generator=gen) * 3 / D**0.5)
        head.bias.zero_()
    phi = torch.randn(N_TRAIN, D, generator=gen).relu_()
    with torch.no_grad():
        labels = (head(phi) + torch.randn(N_TRAIN, K, generator=gen)).argmax(1)
    context = 0.5 * torch.randn(POOL, D, generator=gen).relu_()
    test = torch.randn(N_TEST, D, generator=gen).relu_()
    return phi, labels, head, context, test


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=None, help="override the default schedule")
    args = ap.parse_args()
    print(setup_threads(), f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    phi, labels, head, context, test = synthetic(torch.Generator().manual_seed(0))
    cfg = FSVIConfig(context_points=64, **({"epochs": args.epochs} if args.epochs else {}))
    wall, cpu = time.perf_counter(), time.process_time()
    post = fit_last_layer(phi, labels, head, context, cfg)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    curve = post.meta["training_curve"]
    per_epoch = [b["seconds"] - a["seconds"] for a, b in zip([{"seconds": 0.0}, *curve], curve, strict=False)]
    used = post.hyperparameters  # the defaults resolved for the last layer
    steps = -(-N_TRAIN // used["batch_size"])
    print(
        f"fit {N_TRAIN:,} × {D} → {K}: {used['epochs']} epochs × {steps} steps (batch {used['batch_size']}, "
        f"lr {used['lr']:g}, {used['context_points']} context points, log-dets of "
        f"{min(used['kl_classes'] or K, K)} classes/step)"
    )
    print(
        f"  seconds per epoch: median {sorted(per_epoch)[len(per_epoch) // 2]:.1f} "
        f"(min {min(per_epoch):.1f}, max {max(per_epoch):.1f}); total {wall:.1f} s wall, {cpu:.1f} s CPU "
        f"({'within' if wall <= 300 else 'OVER'} the 5 min target)"
    )
    print(
        f"  objective {curve[0]['objective']:.4f} → {curve[-1]['objective']:.4f}, "
        f"KL {curve[0]['kl']:.4g} → {curve[-1]['kl']:.4g}"
    )
    rss = peak_rss_gib()
    print(f"  peak RSS {rss:.2f} GiB ({'within' if rss <= 3 else 'OVER'} the 3 GiB target)")
    with torch.no_grad():
        plain = best_of(lambda: head(test))
        ours = best_of(lambda: post.logit_gaussian(test))
    ratio = ours / plain
    print(
        f"predictive over {N_TEST:,} inputs: head forward {1000 * plain:.1f} ms, exact logit Gaussian "
        f"{1000 * ours:.1f} ms = {ratio:.2f}× ({'within' if ratio <= 3 else 'OVER'} the 3× target)"
    )


if __name__ == "__main__":
    main()
