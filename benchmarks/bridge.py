"""Laplace bridge vs Monte Carlo: speed on the same logit Gaussians, and quality on the simplex.

(a) Speed: 10,000 inputs, K in {10, 100, 1000}, diagonal logit covariances; the bridge
    (eq. 7, zero-sum correction) against MC with 1,000 samples (mean of softmax).
(b) Quality: the three 3-class Gaussians of the seed's App. A (mu = (-1, 2, -1), Sigma = 10 I,
    I, 0.1 I), plus I + 10 11^T (a common logit shift: the same softmax distribution as I).
    p_true is a histogram of 10^5 softmax draws on a simplex grid; KL(p_true || p_LB) uses the
    bridge Dirichlet's probability of each cell, KL(p_true || p_MC(M)) the histogram of M draws
    (half a count added to every cell so that the KL is finite). Prints the M at which sampling
    first matches the bridge.

Run: ``python benchmarks/bridge.py [--device cpu|cuda] [--inputs N] [--speed-only]`` (the speed
table is labelled with the device; on CUDA every tensor and draw lives on the device and each
timing starts and ends with an idle queue).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.stats import dirichlet as sp_dirichlet

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, setup_threads  # noqa: E402

from bayescli import devices  # noqa: E402
from bayescli.errors import BayescliError  # noqa: E402
from bayescli.posterior.gaussian import LogitGaussian  # noqa: E402
from bayescli.predictive.dirichlet import laplace_bridge  # noqa: E402
from bayescli.predictive.links import bridge, monte_carlo  # noqa: E402

GRID = 60  # cells per simplex edge
SUB = 4  # sub-points per cell edge for integrating the Dirichlet density


def speed_ratios(
    ks: tuple[int, ...] = (10, 100, 1000), inputs: int = 10_000, device: str = "cpu"
) -> list[dict[str, float]]:
    """Bridge vs MC(1000) wall time on ``inputs`` diagonal logit Gaussians per K on ``device``:
    ``{k, bridge_s, mc_s, ratio}``; on the CPU at K = 1000 MC is timed on a tenth of the inputs and
    scaled (linear in N)."""
    dev = torch.device(device)
    out = []
    for k in ks:
        gen = torch.Generator().manual_seed(k)
        lg = LogitGaussian(
            (3 * torch.randn(inputs, k, generator=gen)).to(dev),
            (torch.rand(inputs, k, generator=gen) + 0.1).to(dev),
        )
        t_lb = best_of(lambda lg=lg: bridge(lg), repeat=5, device=dev)
        # MC cost is linear in the inputs: at K=1000 on a CPU time a tenth of them and scale (saves ~2.5 min).
        n_mc = inputs if k < 1000 or dev.type == "cuda" else inputs // 10
        part = lg.slice(slice(0, n_mc))
        t_mc = best_of(
            lambda part=part: monte_carlo(part, 1000, devices.generator(dev, 0)), repeat=1, device=dev
        )
        t_mc *= inputs / n_mc
        out.append({"k": k, "bridge_s": t_lb, "mc_s": t_mc, "ratio": t_mc / t_lb, "mc_inputs": n_mc})
    return out


def speed(device: str = "cpu", inputs: int = 10_000) -> None:
    where = f"on {device}" + (
        f" ({torch.cuda.get_device_name()})" if device == "cuda" else f", {setup_threads()}"
    )
    print(f"# (a) speed, {inputs:,} inputs, {where}")
    print("device | K | bridge ms | MC(1000) s | MC / bridge")
    for r in speed_ratios(inputs=inputs, device=device):
        note = "" if r["mc_inputs"] == inputs else f" (timed on {r['mc_inputs']:,} inputs, scaled)"
        print(f"{device} | {r['k']} | {1e3 * r['bridge_s']:.2f} | {r['mc_s']:.3f}{note} | {r['ratio']:,.0f}×")
    print("target: ≥ 400× at every K on an H100/H200 (the seed's GPU figure)")


def cell_index(p: np.ndarray) -> np.ndarray:
    """Map simplex points [M, 3] to triangular-grid cells (upward and downward triangles)."""
    x, y = p[:, 0] * GRID, p[:, 1] * GRID
    i, j = np.minimum(np.floor(x), GRID - 1).astype(int), np.minimum(np.floor(y), GRID - 1).astype(int)
    up = (x - i) + (y - j) < 1
    i, j = np.minimum(i, GRID - 1), np.minimum(j, GRID - 1 - i)
    return (i * GRID + j) * 2 + (~up).astype(int)


def histogram(p: np.ndarray, pseudo: float = 0.0) -> np.ndarray:
    counts = np.bincount(cell_index(p), minlength=2 * GRID * GRID).astype(float)
    valid = valid_cells()
    counts = counts[valid] + pseudo
    return counts / counts.sum()


def valid_cells() -> np.ndarray:
    cells = np.zeros(2 * GRID * GRID, dtype=bool)
    for i in range(GRID):
        for j in range(GRID - i):
            cells[(i * GRID + j) * 2] = True
            if i + j < GRID - 1:
                cells[(i * GRID + j) * 2 + 1] = True
    return cells


def dirichlet_cells(alpha: np.ndarray) -> np.ndarray:
    """Probability of each cell under Dir(α), by averaging the density on a sub-grid."""
    n = GRID * SUB
    ii, jj = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    keep = ii + jj < n - 1
    x, y = (ii[keep] + 0.5) / n, (jj[keep] + 0.5) / n
    pts = np.stack([x, y, 1 - x - y], 1)
    pts = pts[pts[:, 2] > 0]
    dens = np.exp(sp_dirichlet.logpdf(pts.T, alpha))
    mass = np.bincount(cell_index(pts), weights=dens, minlength=2 * GRID * GRID)[valid_cells()]
    return mass / mass.sum()


def kl(p: np.ndarray, q: np.ndarray) -> float:
    m = p > 0
    return float(np.sum(p[m] * np.log(p[m] / np.maximum(q[m], 1e-300))))


def quality() -> None:
    print("\n# (b) quality: KL(p_true || ·) on a simplex grid of", GRID, "cells per edge")
    mu = torch.tensor([[-1.0, 2.0, -1.0]], dtype=torch.float64)
    ms = [10, 30, 100, 300, 1000, 3000, 10_000]
    print(
        "Σ | KL LB none | KL LB zero-sum | KL LB norm | "
        + " | ".join(f"MC {m}" for m in ms)
        + " | MC matches zero-sum LB at"
    )
    cases = {f"{v:g}·I": v * torch.eye(3, dtype=torch.float64) for v in (10.0, 1.0, 0.1)}
    # A common logit shift leaves softmax unchanged: same p_true as 1·I, 11× the variance.
    cases["1·I + 10·11ᵀ"] = cases["1·I"] + 10.0 * torch.ones(3, 3, dtype=torch.float64)
    for name, cov in cases.items():
        lg = LogitGaussian(mu, cov.diagonal().reshape(1, 3).clone(), cov[None])
        gen = torch.Generator().manual_seed(0)
        true = histogram(lg.sample(100_000, gen)[:, 0].softmax(-1).numpy())
        kls = {
            c: kl(true, dirichlet_cells(laplace_bridge(mu, lg.cov, c)[0].numpy()))
            for c in ("none", "zero-sum", "norm")
        }
        mc = {}
        for m in ms:
            vals = [
                kl(
                    true,
                    histogram(
                        lg.sample(m, torch.Generator().manual_seed(100 + r))[:, 0].softmax(-1).numpy(), 0.5
                    ),
                )
                for r in range(5)
            ]
            mc[m] = float(np.mean(vals))
        match = next((m for m in ms if mc[m] <= kls["zero-sum"]), None)
        print(
            f"{name} | {kls['none']:.3f} | {kls['zero-sum']:.3f} | {kls['norm']:.3f} | "
            + " | ".join(f"{mc[m]:.3f}" for m in ms)
            + f" | {match if match else '> ' + str(ms[-1])}"
        )
    print("seed: sampling matches the bridge somewhere between 750 and 10k samples")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Laplace bridge vs Monte Carlo: speed and quality.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--inputs", type=int, default=10_000, help="inputs of the speed table")
    parser.add_argument("--speed-only", action="store_true", help="skip the (CPU) quality table")
    args = parser.parse_args(argv)
    try:
        devices.resolve_device(args.device)
    except BayescliError as err:
        print(f"bridge.py: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    speed(args.device, args.inputs)
    if not args.speed_only:
        quality()


if __name__ == "__main__":
    main()
