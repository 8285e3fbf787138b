"""GLM VI and GGP VI speed on a large last layer: 20,000 synthetic 512-d features, K = 100.

* GLM VI (last layer, default schedule: 250 natural-gradient iterations, Monte-Carlo expectations
  with 16 draws): seconds and peak RSS for ``diag``; ``full`` has 100·513 = 51,300 > 20,000
  parameters and is refused (the Laplace limit), which is reported.
* GGP VI (M = 500 inducing points, minibatch 256): seconds per epoch (fits of 1 and 3 epochs;
  their difference over two).

* Multi-label (Bernoulli) GLM VI against softmax at the composed-MNIST size (N = 7,000 fitting
  rows, D = 128 synthetic features, K = 10, last layer, full batch): milliseconds per
  natural-gradient iteration of each likelihood in the same process (``diag`` and ``full``, from
  their GGN Laplace start) and their ratio, and a Bernoulli ``diag`` fit's iterations over a
  7-value δ grid (250 each, as glm-vi's selection runs them).

Each part runs in a child process so its peak RSS is its own. Threads: 2 (``--threads``).

Run: ``python benchmarks/glm_vi_bench.py`` (``--part bernoulli`` for the multi-label part alone)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_seconds, linear_head_problem, peak_rss_gib  # noqa: E402

from bayescli.data import ArrayData  # noqa: E402
from bayescli.errors import BayescliError  # noqa: E402
from bayescli.fitting.fit_source import FitSource  # noqa: E402
from bayescli.models.specs import LoadedModel  # noqa: E402
from bayescli.posterior.gaussian import augment  # noqa: E402
from bayescli.posterior.vi import ggp_vi, glm_vi  # noqa: E402
from bayescli.posterior.vi.linearised_glm import GLMData, natural_gradient_vi  # noqa: E402

N, D, K = 20_000, 512, 100
# the multi-label part: composed MNIST's fitting rows and labels, a 128-d last layer
ML_N, ML_D, ML_K = 7_000, 128, 10
ML_GRID = [10.0**i for i in range(-3, 4)]
ML_ITERATIONS = 250


def problem() -> tuple[LoadedModel, ArrayData]:
    """:func:`linear_head_problem` at ``N × D → K``."""
    model, x, y = linear_head_problem(N, D, K)
    return model, ArrayData(x, y, [str(k) for k in range(K)])


def multilabel_problem(likelihood: str, covariance: str) -> tuple[GLMData, torch.Tensor, torch.Tensor]:
    """The linearised head on Gaussian features, labels drawn from the head (sigmoids per label or
    one softmax), and the GGN Laplace start's curvature (diag, or the label-block-diagonal full)."""
    gen = torch.Generator().manual_seed(0)
    phi = torch.randn(ML_N, ML_D, generator=gen)
    w = torch.randn(ML_K, ML_D + 1, generator=gen, dtype=torch.float64) * 0.2
    phi_aug = augment(phi).double()
    logits = phi_aug @ w.T
    if likelihood == "bernoulli":
        labels = torch.bernoulli(torch.sigmoid(logits), generator=gen)
    else:
        labels = torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(1)
    p = torch.sigmoid(logits) if likelihood == "bernoulli" else logits.softmax(-1)
    lam = p * (1 - p)  # the diagonal of Λ (all of it for Bernoulli)
    if covariance == "diag":
        curvature = lam.T @ phi_aug.square()
    else:
        curvature = torch.block_diag(*((lam.T[:, :, None] * phi_aug).transpose(1, 2) @ phi_aug))
    return GLMData(labels, ML_K, phi=phi, likelihood=likelihood), w, curvature


def iteration_ms(likelihood: str, covariance: str, iterations: int) -> tuple[float, float]:
    """Wall and CPU milliseconds per natural-gradient iteration."""
    data, w, curvature = multilabel_problem(likelihood, covariance)
    start, cpu0 = time.perf_counter(), cpu_seconds()
    natural_gradient_vi(data, w, curvature, 1.0, iterations, glm_vi.default_lr(covariance))
    return 1e3 * (time.perf_counter() - start) / iterations, 1e3 * (cpu_seconds() - cpu0) / iterations


def run_multilabel() -> dict:
    result: dict = {"part": "bernoulli", "N": ML_N, "D": ML_D, "K": ML_K}
    for covariance, iterations in (("diag", 40), ("full", 3)):
        soft, soft_cpu = iteration_ms("categorical", covariance, iterations)
        bern, bern_cpu = iteration_ms("bernoulli", covariance, iterations)
        result[covariance] = {
            "softmax_ms": soft,
            "bernoulli_ms": bern,
            "ratio": bern / soft,
            "softmax_cpu_ms": soft_cpu,
            "bernoulli_cpu_ms": bern_cpu,
            "cpu_ratio": bern_cpu / soft_cpu,
        }
    data, w, curvature = multilabel_problem("bernoulli", "diag")
    start, cpu0 = time.perf_counter(), cpu_seconds()
    for delta in ML_GRID:
        natural_gradient_vi(data, w, curvature, delta, ML_ITERATIONS, glm_vi.default_lr("diag"))
    result["diag_grid_fit"] = {
        "deltas": len(ML_GRID),
        "iterations": ML_ITERATIONS,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": cpu_seconds() - cpu0,
    }
    return result


def run_part(part: str) -> dict:
    if part == "bernoulli":
        return run_multilabel()
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
    for part in ("glm-diag", "glm-full", "ggp", "bernoulli"):
        cmd = [sys.executable, __file__, "--part", part, "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
