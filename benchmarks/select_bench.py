"""``select`` at a large head: every post-hoc method on one feature pass, 2048 → 1000.

Synthetic post-ReLU features (20,000 fitting + 5,000 validation rows, D = 2048, K = 1,000) through
an identity backbone; the head is a teacher ``W*`` whose logits label the rows (with Gumbel noise,
so the MAP head is confident but not perfect). Every registered method that ``bayescli select``
runs by default is fitted with its defaults — so each chooses its key hyperparameter on the
validation rows — and the per-method fit seconds and the total are printed. Goal: the whole
``select`` under 10 minutes on 2 CPU cores.

Run: ``python benchmarks/select_bench.py [--methods a,b] [--device cuda] [--quick]``
(``--quick``: 4,000 + 1,000 rows).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import peak_rss_gib, setup_threads  # noqa: E402

from bayescli.data import ArrayData  # noqa: E402
from bayescli.fitting.fit_source import FitSource  # noqa: E402
from bayescli.fitting.registry import select_defaults  # noqa: E402
from bayescli.fitting.select import SelectOptions, select  # noqa: E402
from bayescli.models.classifier import Classifier  # noqa: E402
from bayescli.models.specs import LoadedModel, ModelSpec  # noqa: E402

D, K = 2048, 1000


def synthetic(n_fit: int, n_val: int, seed: int = 0) -> tuple[LoadedModel, ArrayData, ArrayData]:
    """The identity-backbone model with teacher head ``W* [K, D]`` and labelled feature sets."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(K, D, generator=gen) / D**0.5 * 6.0

    def rows(n: int, tag: str) -> ArrayData:
        x = torch.relu(torch.randn(n, D, generator=gen))
        logits = x @ teacher.T
        noise = -torch.log(-torch.log(torch.rand(n, K, generator=gen).clamp(1e-12, 1 - 1e-12)))
        y = (logits + noise).argmax(1)
        return ArrayData(x, y, [str(k) for k in range(K)], {"spec": f"synthetic:{tag}"})

    net = nn.Sequential(nn.Identity(), nn.Linear(D, K))
    with torch.no_grad():
        net[1].weight.copy_(teacher)
        net[1].bias.zero_()
    clf = Classifier(net, "1").eval()
    loaded = LoadedModel(clf, ModelSpec("memory", "teacher"), Path(""), "", {"input_shape": [D]})
    return loaded, rows(n_fit, "fit"), rows(n_val, "val")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(select_defaults()))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n_fit, n_val = (4_000, 1_000) if args.quick else (20_000, 5_000)
    loaded, fit, val = synthetic(n_fit, n_val)
    source = FitSource(loaded, fit, val, args.device, batch_size=1024)
    methods = [m for m in args.methods.split(",") if m]
    print(f"select {D} → {K}: {n_fit} fitting + {n_val} validation rows; {setup_threads()}")
    start = time.perf_counter()

    def progress(name: str, row: dict) -> None:
        print(
            f"  {name:15s} fit {row['fit_seconds']:7.1f} s   val NLL {row['nll']:.4f}   "
            f"ECE {row['ece']:.4f}   {row['hyperparameters']}",
            flush=True,
        )

    board, _ = select(source, {}, SelectOptions(methods), on_fitted=progress)
    total = time.perf_counter() - start
    print(f"  MAP             val NLL {board['map']['nll']:.4f}   ECE {board['map']['ece']:.4f}")
    print(f"best: {board['best']}; total {total:.1f} s; peak RSS {peak_rss_gib():.2f} GiB")
    summary = {name: round(row["fit_seconds"], 2) for name, row in board["methods"].items()}
    print(json.dumps({"total_seconds": round(total, 1), "fit_seconds": summary}))


if __name__ == "__main__":
    main()
