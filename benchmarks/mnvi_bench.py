"""MNVI speed and memory (issue 12 targets).

1. Last-layer fit, default schedule (noise-only: 10 epochs, B = 256, S = 16, lr 1e-2) on 20,000
   synthetic 2048-d features with K = 1000: wall time (target ≤ 60 s on 2 cores) and the
   process's peak RSS (target ≤ 3 GiB). ``--variant mean-and-noise`` times the other variant.
2. Last-layer predictive (exact logit Gaussian) over 10,000 inputs as a ratio to the plain
   head forward (target ≤ 3×).
3. Whole-network moment propagation on timm resnet18 (32×32, batch 16; 224×224, batch 2) as a
   ratio to the deterministic forward (target ≤ 3×), both in inference mode; times are the
   best of interleaved repeats, so background load hits both sides alike.

Run: ``PYTHONPATH=. python benchmarks/mnvi_bench.py [--threads 2]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_gib, setup_threads  # noqa: E402

from bayescli.posterior.vi.mnvi import MNVIConfig, fit_features  # noqa: E402
from bayescli.posterior.vi.moments import MomentPropagator  # noqa: E402
from bayescli.progress import set_enabled  # noqa: E402


def interleaved(fns: dict, rounds: int = 7) -> dict:
    """Best wall time of each callable over ``rounds`` alternating calls (after a warm-up)."""
    best = {k: float("inf") for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - start)
    return best


def synthetic(n: int, d: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, nn.Linear]:
    """ReLU features, a MAP-like head, labels from a noisy version of it (≈ 70% accuracy)."""
    gen = torch.Generator().manual_seed(seed)
    phi = torch.randn(n, d, generator=gen).relu_()
    head = nn.Linear(d, k)
    with torch.no_grad():
        head.weight.copy_(torch.randn(k, d, generator=gen) * 0.05)
        head.bias.zero_()
        logits = head(phi)
        labels = (logits + logits.std() * 0.7 * torch.randn(n, k, generator=gen)).argmax(1)
    return phi, labels, head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", default="noise-only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    set_enabled(False)
    print(setup_threads())

    n, d, k = 20_000, 2048, 1000
    phi, labels, head = synthetic(n, d, k)
    cfg = MNVIConfig(variant=args.variant)
    start, cpu = time.perf_counter(), time.process_time()
    post = fit_features(phi, labels, head, cfg)
    fit_s, fit_cpu = time.perf_counter() - start, time.process_time() - cpu
    curve = post.meta["curve"]
    print(f"1. last-layer fit ({args.variant}, N={n}, D={d}, K={k}, {post.config['epochs']} epochs, "
          f"B={post.config['batch_size']}, S={post.config['samples']}): {fit_s:.1f} s wall, "
          f"{fit_cpu:.1f} s CPU (all threads), "
          f"peak RSS {peak_rss_gib():.2f} GiB; objective {curve[0]['objective']:.4f} → "
          f"{curve[-1]['objective']:.4f}, noise a mean {post.summary()['noise_mean']:.4f}")  # fmt: skip

    x = phi[:10_000]
    with torch.inference_mode():
        post.logit_gaussian(x)  # caches a∘M∘M once
        t = interleaved({"head": lambda: head(x), "mnvi": lambda: post.logit_gaussian(x)})
    print(f"2. predictive over 10,000 inputs: head {1e3 * t['head']:.1f} ms, MNVI {1e3 * t['mnvi']:.1f} ms, "
          f"ratio {t['mnvi'] / t['head']:.2f}×")  # fmt: skip

    import timm

    torch.manual_seed(0)
    net = timm.create_model("resnet18", pretrained=False, num_classes=10).eval()
    prop = MomentPropagator(net)
    noise = {name: torch.full((units,), 0.05) for name, units in prop.layers.items()}
    for shape in ((16, 3, 32, 32), (2, 3, 224, 224)):
        xb = torch.randn(shape)
        with torch.inference_mode():
            t = interleaved({"det": lambda xb=xb: net(xb), "prop": lambda xb=xb: prop(xb, noise)})
        print(f"3. resnet18 {list(shape)}: forward {1e3 * t['det']:.1f} ms, moment propagation "
              f"{1e3 * t['prop']:.1f} ms, ratio {t['prop'] / t['det']:.2f}×")  # fmt: skip
    print(f"peak RSS at the end {peak_rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
