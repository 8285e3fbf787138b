"""MNVI on real MNIST / notMNIST through library calls (VI-SPEC C-2, C-3).

* C-2: ``builtin:lenet`` trained on MNIST test[:5000] deterministically (the project trainer,
  ``bayescli.training.classifier.train_classifier``) and with MNVI from scratch ([002] LeNet settings:
  κ/N = 2e-7, σ² = 1e-3, ρ0 = −3, AMSGrad 1e-3, B = 64, clip 0.1, lr ×0.1 after half the
  epochs); both evaluated on test[5000:] (accuracy, NLL, ECE with 15 and 20 bins), MNVI through
  moment propagation and the MC predictive [002:(20)] with 1000 logit samples.
* C-3: last-layer MNVI post hoc on the deterministic LeNet (noise-only and mean-and-noise,
  default κ/N = 1/N and σ² = mean(W_MAP²), fitted on test[:5000]; and κ/N chosen on
  test[5000:6000] as validation (the default with validation data: a grid from 10/N down to the
  MAP limit), then evaluated on test[6000:]) vs MAP: NLL, ECE,
  notMNIST AUROC (max-probability score).

Run: ``PYTHONPATH=. python benchmarks/mnvi_real.py [--shared ../shared] [--epochs 20]`` (~1.5 min,
one core).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from bayescli.data import load_data
from bayescli.fitting.fit_source import FitSource
from bayescli.metrics import classification as metrics
from bayescli.models.specs import load_classifier
from bayescli.posterior.vi.mnvi import MNVIConfig, fit
from bayescli.predictive.links import monte_carlo
from bayescli.progress import set_enabled
from bayescli.training import mnvi as mnvi_training
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier

HERE = Path(__file__).resolve().parent
MC_SAMPLES = 1000


def predictive(post, clf, data, batch=1000) -> torch.Tensor:
    """MC predictive ``[N, K]`` of an MNVI posterior on ``data`` (pixel space)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    with torch.no_grad():
        for xb, _ in data.batches(batch):
            out.append(monte_carlo(post.logit_gaussian_inputs(clf, xb), MC_SAMPLES, gen).probs)
    return torch.cat(out)


def softmax(clf, data, batch=1000) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([clf(xb).softmax(-1) for xb, _ in data.batches(batch)])


def row(name: str, probs: torch.Tensor, y: torch.Tensor, ood: torch.Tensor | None = None) -> str:
    auroc = ""
    if ood is not None:
        auroc = f"{metrics.ood_metrics(probs.max(-1).values, ood.max(-1).values)['auroc']:8.4f}"
    return (
        f"{name:<34} {100 * (1 - metrics.accuracy(probs, y)):6.2f} {metrics.nll(probs, y):8.4f} "
        f"{metrics.ece(probs, y):8.4f} {metrics.ece(probs, y, 20):8.4f} {auroc}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=HERE.parent.parent / "shared")
    ap.add_argument("--epochs", type=int, default=20)
    args = ap.parse_args()
    set_enabled(False)
    root = args.shared / "data" / "mnist"
    notmnist = args.shared / "data" / "notmnist" / "raw"
    if not (root / "MNIST" / "raw").is_dir() or not notmnist.is_dir():
        sys.exit(f"real data not found under {args.shared / 'data'}; pass --shared DIR")
    cpu = torch.device("cpu")
    train = load_data("mnist:test[:5000]", root)
    test = load_data("mnist:test[5000:]", root)
    ood = load_data(f"idx:{notmnist}", limit=5000)
    head = f"{'':<34} {'err %':>6} {'NLL':>8} {'ECE15':>8} {'ECE20':>8} {'AUROC':>8}"
    times = {}

    start = time.perf_counter()
    det, det_meta = train_classifier("builtin:lenet", train, None, TrainConfig(epochs=args.epochs), cpu)
    times["deterministic"] = time.perf_counter() - start
    start = time.perf_counter()
    mn_clf, _, mn_post = mnvi_training.train(
        "builtin:lenet", train, None, MNVIConfig(epochs=args.epochs), cpu
    )
    times["mnvi-scratch"] = time.perf_counter() - start
    n_params = sum(p.numel() for p in det.net.parameters())
    n_noise = sum(r.numel() for r in mn_post.rho.values())

    print(f"C-2: LeNet on MNIST test[:5000], {args.epochs} epochs; evaluated on test[5000:]; OOD notMNIST")
    print(f"parameters {n_params:,} + {n_noise:,} noise units (+{100 * n_noise / n_params:.2f}%)")
    print(head)
    p_det = softmax(det, test)
    print(row("deterministic (train_classifier)", p_det, test.y, softmax(det, ood)))
    print(row("MNVI from scratch (moment prop.)", predictive(mn_post, mn_clf, test), test.y,
              predictive(mn_post, mn_clf, ood)))  # fmt: skip
    print(row("MNVI means, deterministic forward", softmax(mn_clf, test), test.y, softmax(mn_clf, ood)))
    print(f"MNVI noise a: mean {mn_post.summary()['noise_mean']:.4f}, range "
          f"[{mn_post.summary()['noise_min']:.4f}, {mn_post.summary()['noise_max']:.4f}]")  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lenet.safetensors"
        save_checkpoint(path, det, det_meta)
        model = load_classifier("builtin:lenet", path)
    clf = model.classifier
    print("\nC-3: post-hoc last-layer MNVI on the deterministic LeNet (fitted on test[:5000])")
    print(head)
    print(row("MAP", p_det, test.y, softmax(det, ood)))
    for variant in ("noise-only", "mean-and-noise"):
        start = time.perf_counter()
        post = fit(FitSource(model, train, device=cpu), MNVIConfig(variant=variant))
        times[f"post-hoc {variant}"] = time.perf_counter() - start
        label = f"MNVI last-layer {variant}"
        print(row(label, predictive(post, clf, test), test.y, predictive(post, clf, ood)))
        s = post.summary()
        print(f"    κ/N {s['kl_weight']:.3g}, σ² {s['prior_var']:.3g}, a mean {s['noise_mean']:.3f} "
              f"[{s['noise_min']:.3f}, {s['noise_max']:.3f}]")  # fmt: skip
    val, rest = test.subset(slice(0, 1000), rows="5000:6000"), test.subset(slice(1000, None), rows="6000:")
    start = time.perf_counter()
    post = fit(FitSource(model, train, val, device=cpu), MNVIConfig())
    times["post-hoc select"] = time.perf_counter() - start
    sel = post.selection.record()
    print(f"select (val test[5000:6000]): κ/N {sel['chosen']:.3g}, σ² {sel['fixed']['prior_var']:.3g}; "
          f"MAP val NLL {sel['map_validation']['nll']:.4f}; val NLL grid: "
          + ", ".join(f"{r['kl_weight']:.2g} {r['nll']:.4f}" for r in sel["curve"]))  # fmt: skip
    print("on test[6000:]:")
    print(row("MAP", softmax(det, rest), rest.y, softmax(det, ood)))
    print(
        row(
            "MNVI last-layer noise-only, chosen κ",
            predictive(post, clf, rest),
            rest.y,
            predictive(post, clf, ood),
        )
    )
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))


if __name__ == "__main__":
    main()
