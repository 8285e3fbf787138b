"""Real data: every OOD detector and method on genuine MNIST → notMNIST, through the CLI.

Trains ``builtin:small-cnn`` on MNIST test[:5000] and fits a last-layer KFAC Laplace
(marginal-likelihood δ) on the same images (as ``real_mnist.py``); temperature on
test[5000:6000]; evaluation on test[6000:] (4,000 images) with the 10,000 notMNIST letters as
the OOD set, every OOD score, conformal sets at α = 0.1 and the link-fidelity check. Prints
AUROC / FPR@95 for every (method, score), conformal coverage and size, and link fidelity.

A second evaluate times the MC link where the issue measured it: MNIST test[5000:] (5,000),
notMNIST (10,000) and 13 rotations (0–180° by 15°), methods map and glm-mc (1,000 samples).

Run: ``python benchmarks/baselines_real.py [--shared ../shared] [--out DIR] [--reuse]``
(about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from real_mnist import HERE, bayescli

METHODS = "map,temp,glm-probit,glm-mc,glm-bridge,glm-bridge-norm"
SCORES = "msp,entropy,maxlogit,energy,mahalanobis,rel-mahalanobis,knn,vim,react,odin,alpha0,mi"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=HERE.parent.parent / "shared")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reuse", action="store_true", help="keep outputs already in --out")
    args = ap.parse_args()
    mnist_root = args.shared / "data" / "mnist"
    notmnist = args.shared / "data" / "notmnist" / "raw"
    out = args.out or Path(tempfile.mkdtemp(prefix="bayescli-baselines-real-"))
    out.mkdir(parents=True, exist_ok=True)
    common = ["--data-root", mnist_root, "--quiet"]
    steps = {
        "train": (
            out / "cnn.safetensors",
            ["train", "--model", "builtin:small-cnn", "--data", "mnist:test[:5000]", "--epochs", "15",
             "--out", out / "cnn.safetensors", *common],
        ),
        "fit": (
            out / "kfac.safetensors",
            ["fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", out / "cnn.safetensors",
             "--data", "mnist:test[:5000]", "--hessian", "kron", "--prior-precision", "auto",
             "--out", out / "kfac.safetensors", *common],
        ),
        "evaluate": (
            out / "baselines.json",
            ["evaluate", "--posterior", out / "kfac.safetensors", "--data", "mnist:test[6000:]",
             "--val-data", "mnist:test[5000:6000]", "--methods", METHODS, "--ood", f"idx:{notmnist}",
             "--ood-scores", SCORES, "--conformal", "0.1", "--out", out / "baselines.json", *common],
        ),
        "mc-timing": (
            out / "mc.json",
            ["evaluate", "--posterior", out / "kfac.safetensors", "--data", "mnist:test[5000:]",
             "--methods", "map,glm-mc", "--ood", f"idx:{notmnist}", "--rotation", "0:180:15",
             "--ood-scores", "msp", "--fidelity-inputs", "0", "--out", out / "mc.json", *common],
        ),
    }  # fmt: skip
    times = {
        name: bayescli(*cmd) for name, (target, cmd) in steps.items() if not (args.reuse and target.exists())
    }
    report = json.loads((out / "baselines.json").read_text())
    res, proto = report["results"], report["protocol"]
    ood = next(iter(res["ood"].values()))
    print(f"MNIST test[:5000] → test[6000:], notMNIST OOD; δ = {report['posterior']['prior_precision']:.4g}, "
          f"T = {proto['temperature']['temperature']:.3f}")  # fmt: skip
    methods = list(ood)
    scores = list(dict.fromkeys(s for per in ood.values() for s, r in per.items() if isinstance(r, dict)))
    print("AUROC / FPR@95 (in-distribution positive; — where a score does not apply)")
    print("| score | " + " | ".join(methods) + " |")
    print("|---|" + "---:|" * len(methods))
    for score in scores:
        cells = [
            f"{ood[m][score]['auroc']:.3f} / {ood[m][score]['fpr95']:.3f}" if score in ood[m] else "—"
            for m in methods
        ]
        print(f"| {score} | " + " | ".join(cells) + " |")
    print("\n| method | acc | NLL | ECE | adaptive ECE | classwise ECE | MCE |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m, r in res["in_distribution"].items():
        print(f"| {m} | {r['accuracy']:.4f} | {r['nll']:.4f} | {r['ece']:.4f} | {r['adaptive_ece']:.4f} | "
              f"{r['classwise_ece']:.4f} | {r['mce']:.4f} |")  # fmt: skip
    print("\n| method | score | coverage | mean size | top-k size | top-k coverage |")
    print("|---|---|---:|---:|---:|---:|")
    for m, per in res["conformal"].items():
        for score, r in per.items():
            t = r["topk_same_size"]
            print(f"| {m} | {score} | {r['coverage']:.4f} | {r['mean_size']:.3f} | {t['mean_size']:.3f} | "
                  f"{t['coverage']:.4f} |")  # fmt: skip
    print("\n| link | KL(MC ‖ link) mean | max | NLL |")
    print("|---|---:|---:|---:|")
    for link, r in res["link_fidelity"].items():
        if link != "mc":
            print(f"| {link} | {r['kl_mean']:.4f} | {r['kl_max']:.4f} | {r['nll']:.4f} |")
    print(f"MC reference NLL {res['link_fidelity']['mc']['nll']:.4f}; warnings: {report['warnings']}")
    timings = report["timings"]
    print("detector seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items() if "." in k and
                                            k.split(".")[0] in ("fit", "score")))  # fmt: skip
    mc = json.loads((out / "mc.json").read_text())["timings"]
    print(
        f"MC(1000) link {mc['glm-mc.link']:.2f} s vs forward {mc['forward']:.2f} s "
        f"({mc['glm-mc.link'] / mc['forward']:.2f}×) on {mc['forward_inputs']:,} inputs"
    )
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + f"; files in {out}")


if __name__ == "__main__":
    main()
