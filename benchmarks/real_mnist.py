"""Real data end to end: genuine MNIST and notMNIST test files, through the CLI as a user runs it.

Trains ``builtin:small-cnn`` on MNIST test[:5000], fits a last-layer KFAC Laplace (marginal-
likelihood δ) on the same images, and evaluates on MNIST test[5000:] with notMNIST (``idx:``) as
the OOD set, rotations 0–180° and the 15 generated corruptions. Prints MAP vs Laplace probit and
bridge: accuracy, NLL, ECE, notMNIST AUROC (max-prob score) and MMC on notMNIST.

Run: ``python benchmarks/real_mnist.py [--shared ../shared] [--out DIR]`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
METHODS = ("map", "glm-probit", "glm-bridge")


def bayescli(*args: object) -> float:
    exe = shutil.which("bayescli") or str(Path(sys.executable).with_name("bayescli"))
    start = time.perf_counter()
    subprocess.run([exe, *map(str, args)], check=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=HERE.parent.parent / "shared")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reuse", action="store_true", help="keep outputs already in --out")
    args = ap.parse_args()
    mnist_root = args.shared / "data" / "mnist"
    notmnist = args.shared / "data" / "notmnist" / "raw"
    if not (mnist_root / "MNIST" / "raw").is_dir() or not notmnist.is_dir():
        sys.exit(f"real data not found under {args.shared / 'data'}; pass --shared DIR")
    out = args.out or Path(tempfile.mkdtemp(prefix="bayescli-real-mnist-"))
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
            out / "report.json",
            ["evaluate", "--posterior", out / "kfac.safetensors", "--data", "mnist:test[5000:]",
             "--methods", ",".join(METHODS), "--ood", f"idx:{notmnist}", "--rotation", "0:180:30",
             "--corruption", "all", "--severity", "3", "--out", out / "report.json", *common],
        ),
    }  # fmt: skip
    times = {
        name: bayescli(*cmd) for name, (target, cmd) in steps.items() if not (args.reuse and target.exists())
    }
    report = json.loads((out / "report.json").read_text())
    res = report["results"]
    ood = next(iter(res["ood"].values()))
    delta = report["posterior"]["prior_precision"]
    print(f"MNIST test[:5000] → test[5000:], notMNIST OOD; marglik δ = {delta:.4g}")
    print(f"{'method':<12} {'acc':>7} {'NLL':>7} {'ECE':>7} {'AUROC':>7} {'MMC-OOD':>8} {'corr.acc':>9}")
    for m in METHODS:
        ind = res["in_distribution"][m]
        corr = sum(sev[m]["accuracy"] for c in res["corruption"].values() for sev in c.values())
        corr /= sum(len(c) for c in res["corruption"].values())
        print(
            f"{m:<12} {ind['accuracy']:7.4f} {ind['nll']:7.4f} {ind['ece']:7.4f} "
            f"{ood[m]['max_prob']['auroc']:7.4f} {ood[m]['mmc']:8.4f} {corr:9.4f}"
        )
    print("rotation accuracy: " + ", ".join(
        f"{a}°: " + "/".join(f"{res['rotation'][a][m]['accuracy']:.3f}" for m in METHODS)
        for a in res["rotation"]
    ))  # fmt: skip
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + f"; files in {out}")


if __name__ == "__main__":
    main()
