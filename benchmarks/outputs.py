"""What writing predictions costs next to computing them.

40,000 inputs of a 256→100 last-layer KFAC head: the GLM + probit predictive, then the three
``predict --out`` formats (``.json`` document, streamed ``.jsonl``, ``.safetensors`` arrays), each
as a ratio to the predictive. The rows are the ones ``bayescli predict`` writes (top-5, entropy,
label). Peak memory of the process is printed at the end.

Run: ``python benchmarks/outputs.py``
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import peak_rss_gib, setup_threads  # noqa: E402

from bayescli.io import save_tensors, write_json, write_jsonl  # noqa: E402
from bayescli.posterior.laplace import LaplacePosterior  # noqa: E402
from bayescli.predictive.links import probit  # noqa: E402
from bayescli.predictive.outputs import prediction_rows  # noqa: E402

N, D, K = 40_000, 256, 100


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    print(setup_threads())
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(D, K)
    phi = torch.randn(N, D, generator=gen)
    labels = torch.randint(0, K, (N,), generator=gen)
    post = LaplacePosterior.fit_last_layer(phi[:20_000], labels[:20_000], head, "kron")
    post.set_prior_precision(1.0)
    holder = {}
    t_pred = timed(lambda: holder.update(probs=probit(post.logit_gaussian(phi))))
    probs = holder["probs"]
    names = [str(k) for k in range(K)]
    report = {"kind": "prediction", "results": {"glm-probit": {"accuracy": 0.0}}}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        arrays = {"probs": probs, "labels": labels}

        def rows():
            return prediction_rows(probs, labels, names, {})

        times = {
            ".json": timed(lambda: write_json(out / "p.json", {**report, "rows": list(rows())})),
            ".jsonl": timed(lambda: write_jsonl(out / "p.jsonl", report, rows())),
            ".safetensors": timed(lambda: save_tensors(out / "p.safetensors", arrays, report)),
        }
        sizes = {k: (out / f"p{k}").stat().st_size / 2**20 for k in times}
    print(f"GLM + probit predictive, {N:,} inputs of {D}→{K}: {t_pred:.2f} s")
    print(f"{'output':<14} {'seconds':>8} {'× predictive':>13} {'MiB':>7}")
    for k, t in times.items():
        print(f"{k:<14} {t:8.2f} {t / t_pred:13.2f} {sizes[k]:7.1f}")
    print(f"peak RSS {peak_rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
