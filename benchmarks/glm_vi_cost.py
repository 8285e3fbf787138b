"""GLM VI's default fit on a mid-sized head: 500 → 10, 5,000 fitting + 1,000 validation rows.

Issue 37's cost target: ≤ 30 s on 2 CPU cores. Synthetic Gaussian features, labels drawn from a
softmax of a random linear map, and that map as the "pretrained" head; ``glm_vi.fit`` with its
default settings (diag, last layer, 250 full-batch natural-gradient iterations per δ, 8 Monte-Carlo
draws, δ selected on the validation rows over the grid around the Laplace marginal-likelihood δ).

Prints wall seconds and this process's CPU seconds (user + system: on a shared machine the CPU
time, not the wall time, is the work done), the number of δ candidates fitted, the chosen δ and
checksums of the posterior.

Oversubscribed machines: with ``--threads 2`` on 2 cores that other jobs keep busy, every small
parallel kernel waits for a descheduled OpenMP thread and the same fit takes ~10x the CPU time of
``--threads 1`` (measured: 56.6 vs 5.5 CPU s at 1,000 rows); time with ``--threads 1`` there.

Measured (2 shared cores, load ≈ 8, 1 thread, 5,000 rows; 9 δ candidates, MAP fallback): before
the middle-axis softmax 25.4 CPU s (wall 50.9 s), after 15.3 CPU s (wall 31.3 s).

Run: ``python benchmarks/glm_vi_cost.py [--rows 5000] [--threads 2] [--no-val]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_seconds, linear_head_problem, setup_threads  # noqa: E402

from bayescli.data import ArrayData  # noqa: E402
from bayescli.fitting.fit_source import FitSource  # noqa: E402
from bayescli.models.specs import LoadedModel  # noqa: E402
from bayescli.posterior.vi import glm_vi  # noqa: E402

D, K, N_VAL = 500, 10, 1000


def problem(n: int) -> tuple[LoadedModel, ArrayData, ArrayData]:
    """:func:`linear_head_problem` with ``n`` fitting and ``N_VAL`` validation rows."""
    model, x, y = linear_head_problem(n + N_VAL, D, K)
    names = [str(k) for k in range(K)]
    return model, ArrayData(x[:n], y[:n], names), ArrayData(x[n:], y[n:], names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-val", action="store_true", help="no validation rows: δ = the marglik one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, train, val = problem(args.rows)
    source = FitSource(model, train, None if args.no_val else val, "cpu", 256)
    wall, cpu = time.perf_counter(), cpu_seconds()
    post = glm_vi.fit(source, glm_vi.GLMVIConfig())
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    sel = post.selection.record()
    rows = f"{args.rows} fitting rows ({'no' if args.no_val else N_VAL} validation)"
    print(f"glm-vi {D}→{K}, {rows}; {setup_threads()}")
    candidates = len(sel.get("curve", [])) or 1
    fallback = bool(sel.get("map_fallback"))
    print(f"  wall {wall:.1f} s, cpu {cpu:.1f} s; δ candidates {candidates}; δ {post.prior_precision:.6g}")
    print(f"  chosen {sel.get('chosen')}; map_fallback {fallback}")
    gauss = post.gaussian
    print(f"  mean-sum {float(gauss.mean.sum()):.10g} curvature-sum {float(gauss.h.sum()):.10g}")


if __name__ == "__main__":
    main()
