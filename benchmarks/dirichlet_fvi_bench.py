"""Post-hoc Dirichlet fVI at ImageNet head size: fit time, memory and predictive cost.

Head ensemble (M = 10, the default family) over 20,000 synthetic post-ReLU 2048-d features,
K = 1000, the default schedule (``DirichletFVIConfig()``: 10 epochs, B = 256, Adam 1e-3; τ = 10/K).
Reports seconds per epoch and in total (target ≤ 5 min on 2 cores), peak RSS (target ≤ 3 GiB), and
the predictive (Dirichlet + Laplace-bridge logit Gaussian) over 10,000 inputs as a ratio to the
plain head forward (target ≤ 12× for M = 10; the M heads alone are 10× its FLOPs).

Run: ``OMP_NUM_THREADS=2 python benchmarks/dirichlet_fvi_bench.py``
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, peak_rss_gib, setup_threads  # noqa: E402

from bayescli.data import ArrayData  # noqa: E402
from bayescli.models import Classifier, LoadedModel, ModelSpec  # noqa: E402
from bayescli.posterior.vi.dirichlet_fvi import DirichletFVIConfig, fit_dirichlet_fvi  # noqa: E402

D, K, N_TRAIN, N_TEST = 2048, 1000, 20_000, 10_000


def problem(seed: int = 0) -> tuple[LoadedModel, ArrayData, torch.Tensor]:
    """A linear 'network' whose features are its inputs, so fit_dirichlet_fvi runs unchanged."""
    gen = torch.Generator().manual_seed(seed)
    phi = torch.randn(N_TRAIN + N_TEST, D, generator=gen).relu()
    net = nn.Sequential(nn.Linear(D, K))
    with torch.no_grad():
        net[0].weight.copy_(torch.randn(K, D, generator=gen) * 3 / D**0.5)
        net[0].bias.zero_()
        labels = net(phi[:N_TRAIN]).softmax(-1).multinomial(1, generator=gen).squeeze(1)
    clf = Classifier(net, "0").eval()
    model = LoadedModel(clf, ModelSpec("py", "synthetic:head"), Path("synthetic"), "0" * 64)
    train = ArrayData(phi[:N_TRAIN], labels, [str(k) for k in range(K)], {"spec": "synthetic"})
    return model, train, phi[N_TRAIN:]


def main() -> None:
    print(f"post-hoc Dirichlet fVI, {D}→{K}, N_train={N_TRAIN}, N_test={N_TEST}; {setup_threads()}")
    model, train, test = problem()
    cfg = DirichletFVIConfig()
    load = os.getloadavg()[0]
    start, cpu = time.perf_counter(), time.process_time()
    post = fit_dirichlet_fvi(model, train, None, cfg, torch.device("cpu"), batch_size=1024)
    total, cpu = time.perf_counter() - start, time.process_time() - cpu
    hist = post.meta["history"]
    epochs = [h["seconds"] for h in hist]
    print(
        f"family {post.family}, M={post.members}, tau={post.tau:g}, {cfg.epochs} epochs, B={cfg.batch_size}"
    )
    print(f"epoch seconds: {', '.join(f'{s:.1f}' for s in epochs)} (mean {sum(epochs) / len(epochs):.1f})")
    print(
        f"fit total {total:.1f} s wall, {cpu:.1f} s CPU (target ≤ 300 s on 2 cores); "
        f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after (the machine is shared)"
    )
    print(
        "loss/nll/kl/z per epoch: "
        + "; ".join(f"{h['loss']:.3f}/{h['nll']:.3f}/{h['kl']:.1f}/{h['z']:.0f}" for h in hist)
    )
    print(f"Minka iterations (max per epoch): {[h['minka_iterations'] for h in hist]}")
    head = model.classifier.head
    with torch.no_grad():
        t_head = best_of(lambda: head(test), repeat=3)
    t_pred = best_of(lambda: post.logit_gaussian(test), repeat=3)
    lg = post.logit_gaussian(test)
    print(
        f"predictive over {N_TEST}: head forward {t_head:.3f} s, Dirichlet + bridge {t_pred:.3f} s, "
        f"ratio {t_pred / t_head:.1f}× (target ≤ 12×); z median {float(lg.alpha.sum(-1).median()):.0f}"
    )
    print(f"peak RSS {peak_rss_gib():.2f} GiB (target ≤ 3 GiB)")


if __name__ == "__main__":
    main()
