"""One process against two (``torchrun``, Gloo) on the same CPU machine: same posterior, wall times.

An ImageFolder of generated JPEGs (see ``streaming.py``), timm ``resnet18`` with random weights at
224 px, ``--hessian kron`` over its 512→10 head:

* ``fit-laplace`` with 1 process (all cores) and with ``torchrun --nproc_per_node 2`` (one core
  each): wall time of each, and the largest relative difference of the posterior tensors and of
  the marglik prior precision (issue target 1e-6);
* ``evaluate`` (map, glm-probit; the test set plus a rotated copy) the same way: wall time and the
  largest difference over the report's metrics (target 1e-5).

On a machine with as many cores as processes the two runs do the same arithmetic, so the wall
time shows the price of the process group (start-up, all-reduce, gathers), not a speed-up.

Run: ``python benchmarks/distributed.py [--images 400]`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from streaming import make_checkpoint, make_folder  # noqa: E402

from bayescli.io import load_tensors  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: list, processes: int) -> float:
    """Wall seconds of ``bayescli ARGS`` on ``processes`` processes sharing the machine's cores."""
    cores = os.cpu_count() or 1
    env = {**os.environ, "OMP_NUM_THREADS": str(max(cores // processes, 1))}
    launcher = []
    if processes > 1:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
        launcher += ["--master_addr", "127.0.0.1", "--master_port", str(_port())]
    start = time.perf_counter()
    cmd = [sys.executable, *launcher, "-m", "bayescli", *map(str, args)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(res.stderr)
    return time.perf_counter() - start


def leaves(tree: object, path: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{path}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{path}[{i}]")
    elif isinstance(tree, float):
        yield path, tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = make_folder(work / "imgs", opts.images)
        ckpt = make_checkpoint(work / "r18.safetensors")
        common = ["--model", "timm:resnet18", "--checkpoint", ckpt, "--resize", "256", "--crop", "224"]
        common += ["--device", "cpu", "--batch-size", "32", "--quiet"]
        fit = ["fit-laplace", *common, "--data", f"imagefolder:{folder}", "--hessian", "kron"]
        rows = []
        posts = {}
        for procs in (1, 2):
            posts[procs] = work / f"post{procs}.safetensors"
            rows.append(("fit-laplace", procs, run([*fit, "--out", posts[procs]], procs)))
        t1, m1 = load_tensors(posts[1])
        t2, m2 = load_tensors(posts[2])
        fit_diff = max(
            float((t1[k].double() - t2[k].double()).abs().max() / t1[k].double().abs().max()) for k in t1
        )
        delta_diff = abs(m1["prior_precision"] - m2["prior_precision"]) / m1["prior_precision"]

        evaluate = ["evaluate", "--posterior", posts[1], "--checkpoint", ckpt]
        evaluate += ["--data", f"imagefolder:{folder}"]
        evaluate += ["--methods", "map,glm-probit", "--rotation", "30", "--device", "cpu"]
        evaluate += ["--batch-size", "32", "--quiet"]
        reports = {}
        for procs in (1, 2):
            reports[procs] = work / f"report{procs}.json"
            rows.append(("evaluate", procs, run([*evaluate, "--out", reports[procs]], procs)))
        r1 = dict(leaves(json.loads(reports[1].read_text())["results"]))
        r2 = dict(leaves(json.loads(reports[2].read_text())["results"]))
        eval_diff, worst = max((abs(r1[k] - r2[k]) / max(abs(r1[k]), 1e-12), k) for k in r1)

    print(f"{opts.images} JPEGs, resnet18 224 px, kron; torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'command':<12} {'processes':>9} {'wall s':>8} {'vs 1 process':>13}")
    base = {cmd: sec for cmd, procs, sec in rows if procs == 1}
    for cmd, procs, sec in rows:
        print(f"{cmd:<12} {procs:>9} {sec:>8.1f} {sec / base[cmd]:>12.2f}x")
    print(f"posterior tensors: max relative difference {fit_diff:.1e} (target 1e-6)")
    print(f"prior precision: {m1['prior_precision']:.6g} vs {m2['prior_precision']:.6g} ({delta_diff:.1e})")
    print(f"evaluate metrics: max relative difference {eval_diff:.1e} at {worst} (target 1e-5)")
    print(f"  {worst}: {r1[worst]!r} vs {r2[worst]!r}")


if __name__ == "__main__":
    main()
