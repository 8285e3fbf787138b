"""Multi-label (bernoulli) last-layer Laplace at 2048 → 1000: fit and predictive cost as ratios to
the plain head forward, next to softmax KFAC from the same run (issue 26, part 6).

Synthetic post-ReLU features as in ``benchmarks/heads.py`` (N_train = 20,000, N_test = 10,000,
D = 2048, K = 1000). One head labels both problems: multi-label ``y_k ~ Bern(sigmoid(f_k))``
(its bias −3 makes ~15 % of the labels positive) and single-label ``y ~ softmax(f)``. Timed:

* fit (curvature + marglik δ) of bernoulli ``diag`` and ``kron`` and of softmax ``kron``, each
  ÷ the head forward on the 20,000 fitting rows;
* the GLM predictive (per-label logit means and variances, ``[N, K]``) of each fit and the probit
  link on the kron one, each ÷ the head forward on the 10,000 test rows; softmax KFAC's GLM +
  probit likewise;
* the MC (100 draws per label) and per-label Beta links on the first 1,000 test rows (their cost
  is per row: 10⁸ sigmoid draws or 64-node quadratures of 10⁶ labels), ÷ the head forward on
  those rows.

Bernoulli kron has ``G = diag(Σ_n λ_n)``, so its per-input variances cost what softmax KFAC's do:
``O(D² + K²)`` per input (``u = Q_Aᵀφ̃``, then the ``[K, K]`` basis), the fit ``O(N D²)``.

Run: ``python benchmarks/multilabel_bench.py [--device cuda] [--quick]`` (``--quick``: 4,000 +
2,000 rows). Steps of seconds (fits, MC and Beta links) are timed once, the others best of
several; 4–5 minutes on 2 CPU cores shared with other jobs (257 s in one run).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, peak_rss_gib, setup_threads  # noqa: E402

from bayescli.devices import synchronize  # noqa: E402
from bayescli.posterior.laplace import LaplacePosterior  # noqa: E402
from bayescli.predictive.links import probit as softmax_probit  # noqa: E402
from bayescli.predictive.sigmoid_links import apply_sigmoid_link  # noqa: E402

D, K = 2048, 1000
MC_SAMPLES = 100
LINK_ROWS = 1_000  # rows the MC and Beta links are timed on
SIZES = {"full": (20_000, 10_000), "quick": (4_000, 2_000)}  # (fitting rows, test rows)


def problem(
    n_train: int, n_test: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.nn.Linear]:
    """Features ``[n_train, D]``, ``[n_test, D]``, multi-label ``[n_train, K]`` and class labels
    ``[n_train]`` drawn from one head ``D → K``."""
    gen = torch.Generator().manual_seed(seed)
    phi = torch.randn(n_train + n_test, D, generator=gen).relu()
    head = torch.nn.Linear(D, K)
    with torch.no_grad():
        head.weight.copy_(torch.randn(K, D, generator=gen) * 3 / D**0.5)
        head.bias.fill_(-3.0)
        logits = head(phi[:n_train])
        multi = torch.bernoulli(logits.sigmoid(), generator=gen).long()
        single = logits.softmax(-1).multinomial(1, generator=gen).squeeze(1)
    return phi[:n_train], phi[n_train:], multi, single, head


def once(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """``fn()`` and its wall time, for steps of seconds, where a warm-up call changes nothing but
    the benchmark's own run time."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def run(n_train: int, n_test: int, device: str) -> dict:
    dev = torch.device(device)
    train, test, multi, single, head = (t.to(dev) for t in problem(n_train, n_test))
    with torch.no_grad():
        out = {
            "forward_train_s": best_of(lambda: head(train), device=dev),
            "forward_test_s": best_of(lambda: head(test), device=dev),
        }

    def fit(structure: str, likelihood: str) -> LaplacePosterior:
        labels = multi if likelihood == "bernoulli" else single
        post = LaplacePosterior.fit_last_layer(train, labels, head, structure, likelihood=likelihood)
        post.optimise_prior_marglik()
        return post

    # one small fit first: lazy imports and first-call set-up are not the fits' cost
    LaplacePosterior.fit_last_layer(train[:256], multi[:256], head, "diag", likelihood="bernoulli")
    posts = {}
    for name, structure, likelihood in (
        ("bernoulli_diag", "diag", "bernoulli"),
        ("bernoulli_kron", "kron", "bernoulli"),
        ("softmax_kron", "kron", "categorical"),
    ):
        post, out[f"fit_{name}_s"] = once(lambda s=structure, lk=likelihood: fit(s, lk), dev)
        posts[name] = post
        out[f"glm_{name}_s"] = best_of(lambda p=post: p.logit_gaussian(test), repeat=3, device=dev)
        out[f"delta_{name}"] = post.prior_precision
    lg = posts["bernoulli_kron"].logit_gaussian(test)
    out["link_probit_s"] = best_of(lambda: apply_sigmoid_link(lg.mean, lg.var, "probit"), device=dev)
    few = lg.slice(slice(0, LINK_ROWS))
    with torch.no_grad():
        out["forward_link_rows_s"] = best_of(lambda: head(test[:LINK_ROWS]), device=dev)
    for link in ("mc", "beta"):
        _, out[f"link_{link}_s"] = once(
            lambda link=link: apply_sigmoid_link(few.mean, few.var, link, MC_SAMPLES), dev
        )
    soft = posts["softmax_kron"]
    out["glm_probit_softmax_kron_s"] = best_of(lambda: softmax_probit(soft.logit_gaussian(test)), device=dev)
    out["positive_fraction"] = multi.float().mean().item()
    out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else peak_rss_gib()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="4,000 fitting and 2,000 test rows")
    args = parser.parse_args()
    n_train, n_test = SIZES["quick" if args.quick else "full"]
    where = f"on {args.device}" if args.device != "cpu" else setup_threads()
    print(f"# multi-label Laplace at {D}→{K}: N_train={n_train:,}, N_test={n_test:,}, {where}")
    start = time.perf_counter()
    r = run(n_train, n_test, args.device)
    fwd_tr, fwd_te, fwd_few = r["forward_train_s"], r["forward_test_s"], r["forward_link_rows_s"]
    print(
        f"head forward: {1e3 * fwd_tr:.1f} ms on the fitting rows, {1e3 * fwd_te:.1f} ms on the test rows, "
        f"{1e3 * fwd_few:.1f} ms on {LINK_ROWS:,} rows; {100 * r['positive_fraction']:.1f} % labels positive"
    )
    print(f"{'':<30} {'seconds':>9} {'× forward':>10}")
    rows = [
        ("fit bernoulli diag", r["fit_bernoulli_diag_s"], fwd_tr),
        ("fit bernoulli kron", r["fit_bernoulli_kron_s"], fwd_tr),
        ("fit softmax kron (KFAC)", r["fit_softmax_kron_s"], fwd_tr),
        ("GLM bernoulli diag", r["glm_bernoulli_diag_s"], fwd_te),
        ("GLM bernoulli kron", r["glm_bernoulli_kron_s"], fwd_te),
        ("  + probit link", r["link_probit_s"], fwd_te),
        (f"  + MC link ({MC_SAMPLES} draws)*", r["link_mc_s"], fwd_few),
        ("  + Beta link*", r["link_beta_s"], fwd_few),
        ("GLM + probit bernoulli kron", r["glm_bernoulli_kron_s"] + r["link_probit_s"], fwd_te),
        ("GLM softmax kron (KFAC)", r["glm_softmax_kron_s"], fwd_te),
        ("GLM + probit softmax kron", r["glm_probit_softmax_kron_s"], fwd_te),
    ]
    for name, seconds, fwd in rows:
        print(f"{name:<30} {seconds:>9.3f} {seconds / fwd:>10.1f}")
    print(f"* on the first {LINK_ROWS:,} test rows, ÷ the head forward on those rows")
    deltas = ", ".join(f"{k[6:]} {v:.3g}" for k, v in r.items() if k.startswith("delta_"))
    print(f"marglik δ: {deltas}; peak memory {r['peak_gib']:.2f} GiB; "
          f"total {time.perf_counter() - start:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
