"""Head scaling: fit and predictive cost of last-layer Laplace as ratios to the plain head forward.

Synthetic post-ReLU features, N_train = 20,000 and N_test = 10,000, for D→K in
{256→100, 512→1000, 2048→1000}. Each configuration runs in its own process so that its peak
memory is its own. At 256→100 the predictive is also timed against laplace-torch's last-layer
kron GLM predictive (installed only for this benchmark, see ``laplace_torch_env``).

Run: ``python benchmarks/heads.py [--device cpu|cuda] [--configs 2048x1000,...] [--n-train N]
[--n-test N]`` (or ``make bench``). On a GPU every tensor, the fit and the predictive live on the
device (peak memory is then the device's) and each timing starts and ends with an idle queue.
The table is labelled with the device; its last columns are the GLM + bridge predictive against
the GLM + probit one and the head forward (target at 2048→1000 on an H100/H200: bridge ≤ 2× probit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, peak_rss_gib, setup_threads  # noqa: E402

from bayescli import devices  # noqa: E402
from bayescli.errors import BayescliError  # noqa: E402
from bayescli.posterior.laplace import LaplacePosterior  # noqa: E402
from bayescli.predictive.links import bridge, probit  # noqa: E402

CONFIGS = [(256, 100), (512, 1000), (2048, 1000)]
N_TRAIN, N_TEST = 20_000, 10_000
LT_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bayescli" / "bench-laplace-torch"
LT_PACKAGES = [
    "laplace-torch==0.3",
    "asdfghjkl==0.1a4",
    "curvlinops-for-pytorch",
    "opt-einsum",
    "torchmetrics",
    "tqdm",
    "lightning-utilities",
    "einconv",
    "linear_operator",
    "jaxtyping",
    "wadler-lindig",
]


def problem(
    d: int, k: int, seed: int = 0, n_train: int | None = None, n_test: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.nn.Linear]:
    n_train = N_TRAIN if n_train is None else n_train
    n_test = N_TEST if n_test is None else n_test
    gen = torch.Generator().manual_seed(seed)
    phi = torch.randn(n_train + n_test, d, generator=gen).relu()
    head = torch.nn.Linear(d, k)
    with torch.no_grad():
        head.weight.copy_(torch.randn(k, d, generator=gen) * 3 / d**0.5)
        head.bias.zero_()
        labels = head(phi[:n_train]).softmax(-1).multinomial(1, generator=gen).squeeze(1)
    return phi[:n_train], phi[n_train:], labels, head


def run_config(
    d: int, k: int, device: str = "cpu", n_train: int | None = None, n_test: int | None = None
) -> dict:
    dev = torch.device(device)
    train, test, labels, head = (t.to(dev) for t in problem(d, k, n_train=n_train, n_test=n_test))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with torch.no_grad():
        fwd_train = best_of(lambda: head(train), device=dev)
        fwd_test = best_of(lambda: head(test), device=dev)
    out = {"D": d, "K": k, "forward_train_s": fwd_train, "forward_test_s": fwd_test}
    for structure in ("diag", "kron"):

        def fit(structure=structure) -> LaplacePosterior:
            post = LaplacePosterior.fit_last_layer(train, labels, head, structure)
            post.optimise_prior_marglik()
            return post

        out[f"fit_{structure}_s"] = best_of(fit, repeat=2, device=dev)
        post = fit()
        out[f"glm_probit_{structure}_s"] = best_of(
            lambda post=post: probit(post.logit_gaussian(test)), device=dev
        )
        out[f"glm_bridge_{structure}_s"] = best_of(
            lambda post=post: bridge(post.logit_gaussian(test)), device=dev
        )
    out["peak_rss_gib"] = (
        torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else peak_rss_gib()
    )
    return out


def run_laplace_torch(n_pred: int = 500) -> dict:
    """laplace-torch last-layer kron, GLM + probit on ``n_pred`` inputs of the 256→100 problem."""
    import warnings

    from laplace import Laplace

    warnings.filterwarnings("ignore")
    train, test, labels, head = problem(256, 100)
    model = torch.nn.Sequential(torch.nn.Identity(), head)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(train, labels), batch_size=1000)
    la = Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure="kron")
    la.fit(loader)
    x = test[:n_pred]
    seconds = best_of(lambda: la(x, pred_type="glm", link_approx="probit"), repeat=1)
    ours = LaplacePosterior.fit_last_layer(train, labels, head, "kron")
    ours.set_prior_precision(1.0)
    ours_s = best_of(lambda: probit(ours.logit_gaussian(x)), repeat=5)
    return {"laplace_torch_glm_probit_s": seconds, "bayescli_glm_probit_s": ours_s, "inputs": n_pred}


def laplace_torch_env() -> Path | None:
    """Install laplace-torch into a folder of its own (not our environment); None if impossible."""
    probe = [sys.executable, "-W", "ignore", "-c", "import laplace"]
    env = {**os.environ, "PYTHONPATH": str(LT_DIR)}
    if subprocess.run(probe, env=env, capture_output=True).returncode == 0:
        return LT_DIR
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(LT_DIR), *LT_PACKAGES]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        return None
    return LT_DIR if subprocess.run(probe, env=env, capture_output=True).returncode == 0 else None


def child(args: list[str], pythonpath: Path | None = None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    res = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(
    device: str = "cpu",
    configs: list[tuple[int, int]] = CONFIGS,
    n_train: int = N_TRAIN,
    n_test: int = N_TEST,
) -> None:
    where = f"on {device}" if device != "cpu" else setup_threads()
    print(f"# head scaling: N_train={n_train}, N_test={n_test}, {where}")
    header = (
        "device",
        "D→K",
        "fwd(test) ms",
        "fit diag ×",
        "fit kron ×",
        "probit diag ×",
        "probit kron ×",
        "bridge kron ×",
        "bridge / probit (kron)",
        "peak GiB",
    )
    print(" | ".join(header))
    for d, k in configs:
        r = child(["--config", str(d), str(k), device, str(n_train), str(n_test)])
        if "error" in r:
            print(f"{device} | {d}→{k} | error: {r['error']}")
            continue
        print(
            " | ".join(
                [
                    device,
                    f"{d}→{k}",
                    f"{1e3 * r['forward_test_s']:.2f}",
                    f"{r['fit_diag_s'] / r['forward_train_s']:.1f} ({r['fit_diag_s']:.2f}s)",
                    f"{r['fit_kron_s'] / r['forward_train_s']:.1f} ({r['fit_kron_s']:.2f}s)",
                    f"{r['glm_probit_diag_s'] / r['forward_test_s']:.2f}",
                    f"{r['glm_probit_kron_s'] / r['forward_test_s']:.2f}",
                    f"{r['glm_bridge_kron_s'] / r['forward_test_s']:.2f}",
                    f"{r['glm_bridge_kron_s'] / r['glm_probit_kron_s']:.2f}",
                    f"{r['peak_rss_gib']:.2f}",
                ]
            )
        )
    print(
        "targets (2048→1000): fit kron ≤ 15×, predictive ≤ 6×, peak ≤ 3 GiB; on an H100/H200 "
        "GLM + bridge ≤ 2× GLM + probit"
    )
    if device != "cpu" or (256, 100) not in configs:
        return  # the laplace-torch comparison is a CPU measurement at 256→100
    lt = laplace_torch_env()
    if lt is None:
        print("laplace-torch: could not be installed here; comparison skipped")
        return
    r = child(["--laplace-torch"], lt)
    if "error" in r:
        print(f"laplace-torch: {r['error']}")
        return
    lt_s, us_s = r["laplace_torch_glm_probit_s"], r["bayescli_glm_probit_s"]
    print(
        f"256→100 kron GLM+probit on {r['inputs']} inputs: laplace-torch {lt_s:.2f}s, "
        f"bayescli {1e3 * us_s:.2f}ms → {lt_s / us_s:,.0f}× faster (target ≥ 1,000×)"
    )


def parse_configs(text: str) -> list[tuple[int, int]]:
    """``"2048x1000,256x100"`` → ``[(2048, 1000), (256, 100)]``."""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Last-layer Laplace cost as ratios to the head forward.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--configs", type=parse_configs, default=CONFIGS, help="D×K list, e.g. 2048x1000")
    parser.add_argument("--n-train", type=int, default=N_TRAIN)
    parser.add_argument("--n-test", type=int, default=N_TEST)
    args = parser.parse_args(argv)
    try:
        devices.resolve_device(args.device)
    except BayescliError as err:
        print(f"heads.py: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    main(args.device, args.configs, args.n_train, args.n_test)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--config":
        d, k, device, *sizes = sys.argv[2:]
        print(json.dumps(run_config(int(d), int(k), device, *(int(v) for v in sizes))))
    elif len(sys.argv) > 1 and sys.argv[1] == "--laplace-torch":
        print(json.dumps(run_laplace_torch()))
    else:
        cli()
