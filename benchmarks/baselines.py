"""Post-hoc baselines at ImageNet-head scale: OOD detector fit and scoring, conformal sets and
temperature scaling, each as a ratio to the plain head forward pass.

Synthetic post-ReLU features of a 2048→1000 head: 50,000 fitting features (labels drawn from
the head's softmax), 10,000 test and 10,000 OOD inputs (scored together, 20,000). The reference
is the head forward on those 20,000 features (one float32 GEMM). Each detector runs in its own
process so that its peak resident memory is its own (it includes the ~0.6 GiB of features).

Run: ``python benchmarks/baselines.py`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, peak_rss_gib, setup_threads  # noqa: E402

from bayescli.evaluation import detectors as det  # noqa: E402
from bayescli.evaluation.temperature import fit_temperature  # noqa: E402
from bayescli.predictive import conformal as cp  # noqa: E402

D, K, N_FIT, N_TEST = 2048, 1000, 50_000, 10_000
DETECTORS = ["energy", "max_logit", "mahalanobis", "rel_mahalanobis", "knn", "knn_full_bank", "vim", "react"]
TARGETS = {"energy": 1.2, "max_logit": 1.2, "mahalanobis": 5.0, "knn": 20.0, "conformal": 2.0}


def problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.nn.Linear]:
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(D, K)
    with torch.no_grad():
        head.weight.copy_(torch.randn(K, D, generator=gen) * 3 / D**0.5)
        head.bias.zero_()
    fit = torch.randn(N_FIT, D, generator=gen).relu_()
    with torch.no_grad():
        labels = head(fit).softmax(-1).multinomial(1, generator=gen).squeeze(1)
    test = torch.randn(N_TEST, D, generator=gen).relu_()
    ood = (1.5 * torch.randn(N_TEST, D, generator=gen) + 0.3).relu_()
    return fit, labels, torch.cat([test, ood]), head


def run_one(name: str) -> dict:
    fit, labels, scored, head = problem()
    w, b = head.weight.detach(), head.bias.detach()
    with torch.no_grad():
        forward = best_of(lambda: head(scored), repeat=3)
        forward_fit = best_of(lambda: head(fit), repeat=2)
        logits = head(scored)
    out = {"name": name, "forward_s": forward, "forward_fit_s": forward_fit}
    if name in ("energy", "max_logit"):
        fn = det.energy if name == "energy" else det.max_logit
        out |= {"fit_s": 0.0, "score_s": best_of(lambda: fn(logits), repeat=3)}
    elif name == "conformal":
        probs = logits[:N_TEST].softmax(-1)
        y = probs.multinomial(1, generator=torch.Generator().manual_seed(1)).squeeze(1)
        cal, test = slice(0, N_TEST // 2), slice(N_TEST // 2, N_TEST)
        for score in cp.ConformalScore:

            def conformal(score=score) -> None:
                cfg = cp.ConformalConfig(score, 0.1)
                q = cp.calibrate(probs[cal], y[cal], cfg)
                cp.prediction_sets(probs[test], q, cfg)

            out[f"{score.value}_s"] = best_of(conformal, repeat=2)
        out |= {"fit_s": 0.0, "score_s": max(out[f"{s.value}_s"] for s in cp.ConformalScore)}
        # the forward pass that produced these 10,000 inputs' probabilities
        with torch.no_grad():
            out["forward_s"] = best_of(lambda: head(scored[:N_TEST]), repeat=3)
    elif name == "temperature":
        y = logits[:N_TEST].softmax(-1).multinomial(1, generator=torch.Generator().manual_seed(1)).squeeze(1)
        start = time.perf_counter()
        fit_t = fit_temperature(2 * logits[:N_TEST], y)
        out |= {"fit_s": time.perf_counter() - start, "score_s": 0.0, "temperature": fit_t.temperature}
    else:
        makers = {
            "mahalanobis": lambda: det.Mahalanobis.fit(fit, labels, K),
            "rel_mahalanobis": lambda: det.RelativeMahalanobis.fit(fit, labels, K),
            "knn": lambda: det.KNN.fit(fit, 10, 10_000),
            "knn_full_bank": lambda: det.KNN.fit(fit, 50),
            "vim": lambda: det.ViM.fit(fit, w, b),
            "react": lambda: det.ReAct.fit(fit, w, b),
        }
        start = time.perf_counter()
        detector = makers[name]()
        out["fit_s"] = time.perf_counter() - start
        start = time.perf_counter()
        detector.score(scored)
        out["score_s"] = time.perf_counter() - start
    out["peak_rss_gib"] = peak_rss_gib()
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(run_one(sys.argv[2])))
        return
    print(f"{setup_threads()}; head {D}→{K}, {N_FIT:,} fitting, {2 * N_TEST:,} scored features")
    print(
        "×fwd: fit ÷ head forward on the 50,000 fitting features; score and all ÷ head forward on the "
        "20,000 scored features (conformal: on the 10,000 whose sets are built)"
    )
    print(f"{'':<16} {'fit s':>7} {'score s':>8} {'fit ×fwd':>9} {'score ×fwd':>11} {'all ×fwd':>9} "
          f"{'target':>7} {'peak GiB':>9}")  # fmt: skip
    rows = []
    for name in [*DETECTORS, "conformal", "temperature"]:
        done = subprocess.run(
            [sys.executable, __file__, "--one", name], check=True, capture_output=True, text=True
        )
        r = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(r)
        fwd = r["forward_s"]
        target = TARGETS.get(name)
        print(
            f"{name:<16} {r['fit_s']:7.2f} {r['score_s']:8.3f} {r['fit_s'] / r['forward_fit_s']:9.1f} "
            f"{r['score_s'] / fwd:11.2f} {(r['fit_s'] + r['score_s']) / fwd:9.1f} "
            f"{'' if target is None else f'≤{target:g}':>7} {r['peak_rss_gib']:9.2f}"
        )
    fwd, fwd_fit = rows[0]["forward_s"], rows[0]["forward_fit_s"]
    print(f"head forward: {fwd:.3f} s on {2 * N_TEST:,}, {fwd_fit:.3f} s on {N_FIT:,} features")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
