"""Rotated MNIST with Dirichlet fVI from scratch (VI-SPEC A-3; seed 000 §4.2, Tables 2–10).

MLP 784-50-50-10 (ReLU, pixels to [−1, 1]) trained on the genuine MNIST test[:5000] (only the test
files exist here) with Adam lr 1e-3, B = 256, index set = the batch; evaluated on test[5000:]
rotated 0–180° in 30° steps. Rows: MAP, MAP-fVI, ensemble(5), ensemble-fVI(5) (the weight-space rows
are the same trainer with τ = 0) and plain label smoothing with ε = Kc/(1+Kc), c = τB/N (what
MAP-fVI equals, VI-SPEC A1). τ = 1 is the seed's value, but with N = 5000 instead of 60,000 it
weighs the KL 12× more (c = τB/N); the ``τ=N/60k`` rows match the seed's effective weight.

Predictive probabilities are the mean of the members' softmax (the categorical BMA); accuracy,
log-likelihood (mean log p(y|x), higher is better) and ECE (15 bins) per angle, means over
``--seeds`` seeds (init and batch order), and the fVI − weight-space differences with their SD.

Run: ``OMP_NUM_THREADS=1 python benchmarks/dirichlet_fvi_real.py [--shared ../shared] [--seeds 3]``
(about 1 minute per seed on one core).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bayescli.data import load_data
from bayescli.data.shifts import rotate
from bayescli.metrics.classification import accuracy, ece
from bayescli.models.specs import Classifier, ModelSpec, build_network, last_linear_name
from bayescli.posterior.vi.dirichlet_fvi import DirichletFVIConfig
from bayescli.training import dirichlet_fvi as scratch

HERE = Path(__file__).resolve().parent
ANGLES = list(range(0, 181, 30))
KWARGS = "hidden=50,depth=2"


def label_smoothing(train, tau: float, cfg: DirichletFVIConfig) -> Classifier:
    """Cross-entropy with ε = Kc/(1+Kc), c = τ·|batch|/N; same init, batches and Adam as the fVI run."""
    torch.manual_seed(cfg.seed)
    net = build_network(ModelSpec.parse("builtin:mlp"), 10, train.input_shape, {"hidden": 50, "depth": 2})
    clf = Classifier(net, last_linear_name(net), [0.5], [0.5])
    opt = torch.optim.Adam(clf.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    n = len(train)
    for _ in range(cfg.epochs):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, cfg.batch_size):
            idx = perm[start : start + cfg.batch_size]
            c = tau * len(idx) / n
            eps = 10 * c / (1 + 10 * c)
            loss = F.cross_entropy(clf(train.inputs(idx)), train.y[idx], label_smoothing=eps)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return clf.eval()


def evaluate(predict, test) -> dict[int, tuple[float, float, float]]:
    out = {}
    for angle in ANGLES:
        x = rotate(test.inputs(slice(None)), angle)
        with torch.no_grad():
            probs = predict(x).double()
        ll = float(probs.gather(1, test.y[:, None]).clamp_min(1e-300).log().mean())
        out[angle] = (accuracy(probs, test.y), ll, ece(probs, test.y))
    return out


def all_runs(matched: float) -> list[tuple[str, str, float]]:
    """The script's rows as (name, family, τ): weight space (τ = 0), τ = 1 and τ = ``matched``."""
    return [
        ("MAP", "map", 0.0),
        ("MAP-fVI", "map", 1.0),
        (f"MAP-fVI τ={matched:.3f}", "map", matched),
        ("Ens(5)", "ensemble", 0.0),
        ("Ens-fVI(5)", "ensemble", 1.0),
        (f"Ens-fVI(5) τ={matched:.3f}", "ensemble", matched),
    ]


def run_seed(
    train,
    test,
    epochs: int,
    seed: int,
    matched: float,
    runs: list[tuple[str, str, float]] | None = None,
    smoothing: bool = True,
) -> dict[str, dict]:
    """Every row's per-angle (accuracy, LL, ECE) for one seed; ``runs`` (default
    :func:`all_runs`) picks the trained rows, ``smoothing`` adds the label-smoothing rows."""
    n = len(train)
    results: dict[str, dict] = {}
    runs = all_runs(matched) if runs is None else runs
    gen = torch.Generator().manual_seed(seed)
    for name, family, tau in runs:
        cfg = DirichletFVIConfig(
            family=family, members=5, tau=tau, epochs=epochs, batch_size=256, lr=1e-3,
            seed=seed, model_kwargs=KWARGS, normalisation="pm1",
        )  # fmt: skip
        t0 = time.perf_counter()
        clf, _, post = scratch.train("builtin:mlp", train, None, cfg, torch.device("cpu"))

        def predict(x, clf=clf, post=post):
            return post.sample_logits(post.members, clf, x, None, gen).softmax(-1).mean(0)

        results[name] = evaluate(predict, test)
        print(f"  seed {seed}: trained {name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    for tau in (1.0, matched) if smoothing else ():
        c = tau * 256 / n
        cfg = DirichletFVIConfig(epochs=epochs, batch_size=256, lr=1e-3, seed=seed)
        clf = label_smoothing(train, tau, cfg)
        results[f"LS ε={10 * c / (1 + 10 * c):.3f}"] = evaluate(lambda x, clf=clf: clf(x).softmax(-1), test)
    return results


def pattern(per_seed: list[dict[str, dict]], fvi: str, base: str) -> dict[str, tuple[float, float]]:
    """Row ``fvi`` − row ``base`` of :func:`run_seed`'s results: Δaccuracy at 0° (pp), ΔLL at 0°
    and averaged over 60°, 90°, 120°, ΔECE at 0° and averaged over the angles beyond 60°; each
    as (mean, SD) over the seeds (SD 0 for one seed)."""
    far = [a for a in ANGLES if a > 60]
    stats = {
        "Δacc(0°) pp": lambda f, b: 100 * (f[0][0] - b[0][0]),
        "ΔLL(0°)": lambda f, b: f[0][1] - b[0][1],
        "ΔLL(60–120°)": lambda f, b: sum(f[a][1] - b[a][1] for a in (60, 90, 120)) / 3,
        "ΔECE(0°)": lambda f, b: f[0][2] - b[0][2],
        "ΔECE(>60°)": lambda f, b: sum(f[a][2] - b[a][2] for a in far) / len(far),
    }
    out = {}
    for label, fn in stats.items():
        vals = torch.tensor([fn(r[fvi], r[base]) for r in per_seed], dtype=torch.float64)
        out[label] = (float(vals.mean()), float(vals.std()) if len(vals) > 1 else 0.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=HERE.parent.parent / "shared")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    root = args.shared / "data" / "mnist"
    if not (root / "MNIST" / "raw").is_dir():
        sys.exit(f"MNIST test files not found under {root}; pass --shared DIR")
    train = load_data("mnist:test[:5000]", root=root)
    test = load_data("mnist:test[5000:]", root=root)
    matched = len(train) / 60_000
    start = time.perf_counter()
    per_seed = [run_seed(train, test, args.epochs, seed, matched) for seed in range(args.seeds)]
    names = list(per_seed[0])
    mean = {
        name: {a: [sum(r[name][a][i] for r in per_seed) / len(per_seed) for i in range(3)] for a in ANGLES}
        for name in names
    }
    print(
        f"MNIST test[:5000] → test[5000:] rotated; MLP 784-50-50-10, {args.epochs} epochs, B=256, "
        f"means over {args.seeds} seeds"
    )
    for col, metric in enumerate(("accuracy", "log-likelihood", "ECE")):
        print(f"\n{metric}")
        print(f"{'':<22}" + "".join(f"{a:>8}°" for a in ANGLES))
        for name in names:
            print(f"{name:<22}" + "".join(f"{mean[name][a][col]:9.4f}" for a in ANGLES))
    print("\npattern (fVI − weight space), mean ± SD over seeds:")
    for fvi, base in (("MAP-fVI", "MAP"), ("Ens-fVI(5)", "Ens(5)")):
        for tag in ("", f" τ={matched:.3f}"):
            cells = [
                f"{label} {mean:+.3f}±{sd:.3f}"
                for label, (mean, sd) in pattern(per_seed, fvi + tag, base).items()
            ]
            print(f"  {fvi + tag:<20} " + "  ".join(cells))
    print(f"\ntotal {time.perf_counter() - start:.0f} s, torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
