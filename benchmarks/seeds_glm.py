"""Seed-claim rows for seeds 003 (GLM/GGP predictives) and 004 (Laplace bridge) — issue 25 parts 2–3.

``rows(quick, shared)`` returns one dict per claim (the contract of ``benchmarks/seeds.py``):

* 003 Table 1 / Fig. 4 — GLM predictive beats the BNN predictive on the same Laplace posterior
  (sklearn tabular sets, all-layer full GGN as in the paper, and diagonal), under two protocols:
  the MAP trained once at δ = 1 (``glm_vi_real.run``; δ on the seed's grid continued upward to
  1e6; 10 splits (digits 3) in full mode, quick: cancer-1 and wine-1, 1 split) and the seed's,
  the MAP retrained at every δ (``glm_vi_real.run_retrained``; cancer/wine, depth 1 on 10 splits
  and depth 2 on 3 in full mode, quick: wine-1, 1 split).
* 003 §2.5 — GGP with every fitting point equals the GLM (``ggp.all_points_equivalence``).
* 003 Table 2 — GGP VI with inducing points matches GGP Laplace at the refined mode. The claim is
  the paper's CIFAR-10 / LeNet5 table (Table 1, the UCI table, has no GGP column): LeNet5 on 5,000
  training images, δ chosen per method on a disjoint validation split, GGP Laplace refined on all
  5,000 points, GGP VI with 512 / 2048 random inducing points, test NLL of the MC predictive.
* 004 Table 1 — the bridge matches MC(1000) on MNIST → notMNIST with an all-layer diagonal
  Laplace of a 2-conv + 1-linear network, δ set so that the sampled in-distribution MMC is about
  5% below MAP's (App. D: "MMC of the sampling averages around 5% lower than the MAP estimate"),
  here on the validation split.
* 004, the normalised bridge (laplace-torch's ``bridge_norm``; seed 004's text has no normalised
  variant, the README line of ``shared/data`` quotes it with KFAC): OOD MMC and AUROC vs MAP, for
  the last-layer KFAC at the marginal-likelihood δ and for the all-layer diagonal at the 5% δ.
* 004 Table 2 — bridge vs MC(1000) cost (``bridge.speed_ratios``).
* 004 §5.4 — Laplace on a pretrained network: last-layer KFAC in one pass over the fitting data
  on the trained network, uncertainty-aware top-k from the bridge, beside MAP's NLL and AUROC.

Only MNIST's 10,000 *test* images exist here: train = test[:5000], validation = test[5000:6000]
(δ is chosen there, never on test rows), test = test[6000:]; notMNIST's 10,000 letters are the
OOD set. Quick mode shrinks epochs, grids and evaluation sets; everything is seeded.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bridge as bridge_bench  # noqa: E402
import ggp as ggp_bench  # noqa: E402
import glm_vi_real  # noqa: E402

from bayescli.data import Data, load_data  # noqa: E402
from bayescli.dirichlet import correct  # noqa: E402
from bayescli.errors import LowAccuracyWarning  # noqa: E402
from bayescli.fitting.fit_source import FitSource  # noqa: E402
from bayescli.metrics.classification import accuracy, ece, mmc, nll, ood_metrics  # noqa: E402
from bayescli.models.features import extract_features  # noqa: E402
from bayescli.models.specs import Classifier, LoadedModel, ModelSpec, last_linear_name  # noqa: E402
from bayescli.posterior.curvature import network_jacobian  # noqa: E402
from bayescli.posterior.gaussian import LogitGaussian  # noqa: E402
from bayescli.posterior.laplace import LaplacePosterior, fit_laplace  # noqa: E402
from bayescli.posterior.vi import ggp_vi  # noqa: E402
from bayescli.predictive.dirichlet import mean as dirichlet_mean  # noqa: E402
from bayescli.predictive.glm import logit_gaussian  # noqa: E402
from bayescli.predictive.links import bridge, monte_carlo, probit  # noqa: E402
from bayescli.predictive.topk import topk_summary, uncertainty_topk  # noqa: E402
from bayescli.training.classifier import TrainConfig, channel_stats, train_classifier  # noqa: E402

CPU = torch.device("cpu")
MC_SAMPLES = 1000
# Train/val/test splits per set of the GLM-vs-BNN row in full mode (seed 003: 10 each).
GLM_BNN_SPLITS = {"cancer": 10, "wine": 10, "digits": 3}
# Its δ grid with the MAP trained once: the seed's (App. B.3: 10 log values in [1e-2, 1e2], 4/9 of a
# decade apart) continued upward at the same spacing to 1e6. On the seed's grid the validation
# choice sat at its top (100) in 77 of 112 choices: a MAP trained at δ = 1 is best left almost alone.
GLM_BNN_GRID = [float(v) for v in np.logspace(-2, 6, 19)]
# (set, depth) → splits of the seed's own protocol (the MAP retrained at every δ: one MAP, one
# curvature and, for the full GGN, one eigendecomposition per δ), in full and quick mode. One split
# on one core: cancer-1 35 s, wine-1 22 s, wine-2 150 s, cancer-2 250 s; digits-2 would take
# about 17 minutes (85 s of curvature and eigendecomposition per δ).
RETRAIN_SPLITS = {("cancer", 1): 10, ("wine", 1): 10, ("cancer", 2): 3, ("wine", 2): 3}
RETRAIN_QUICK = {("wine", 1): 1}
# Seed 003 Table 2's standard errors of GGP Laplace (refined) and GGP VI (2048), in quadrature:
# the paper's own noise level for "equivalent" NLLs.
GGP_TOLERANCE = math.hypot(0.006, 0.007)


# ---------------------------------------------------------------------------------------------
# protocol helpers (maths: tested in tests/test_seeds_protocol.py)
# ---------------------------------------------------------------------------------------------


def mmc_matched_delta(
    grid: Sequence[float], mmc_at: Callable[[float], float], target: float
) -> tuple[float, float]:
    """Seed 004's prior rule: the ``δ`` of ``grid`` whose (validation) MMC is closest to ``target``.

    ``mmc_at(δ)`` is evaluated once per grid value; ties go to the first. Returns ``(δ, MMC)``.
    """
    values = [mmc_at(d) for d in grid]
    best = min(range(len(grid)), key=lambda i: abs(values[i] - target))
    return grid[best], values[best]


def select_by_nll(
    grid: Sequence[float],
    fit_predict: Callable[[float], tuple[torch.Tensor, torch.Tensor]],
    y_val: torch.Tensor,
) -> tuple[float, torch.Tensor]:
    """``fit_predict(δ) → (val probs [Nv, K], test probs [Nt, K])``; the δ of lowest validation NLL
    and its test probabilities (hyperparameters never see the test rows)."""
    best = (math.inf, math.nan, None)
    for delta in grid:
        p_val, p_test = fit_predict(delta)
        score = nll(p_val, y_val)
        if score < best[0]:
            best = (score, delta, p_test)
    return best[1], best[2]


# ---------------------------------------------------------------------------------------------
# data and networks
# ---------------------------------------------------------------------------------------------


class MnistSplits:
    """MNIST test[:5000] / [5000:6000] / [6000:] and notMNIST (quick: 2,000 test, 2,000 OOD)."""

    def __init__(self, shared: Path, quick: bool) -> None:
        root = shared / "data" / "mnist"
        notmnist = shared / "data" / "notmnist" / "raw"
        if not (root / "MNIST" / "raw").is_dir() or not notmnist.is_dir():
            raise FileNotFoundError(f"real MNIST/notMNIST not found under {shared / 'data'}")
        end = 8000 if quick else 10_000
        self.train = load_data("mnist:test[:5000]", root=root)
        self.val = load_data("mnist:test[5000:6000]", root=root)
        self.test = load_data(f"mnist:test[6000:{end}]", root=root)
        self.ood = load_data(f"idx:{notmnist}", root=root, limit=2000 if quick else None)


def two_conv_net(k: int = 10) -> nn.Sequential:
    """Seed 004's MNIST network family: two conv layers and one linear layer (18,378 weights)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, k),
    )


def train_two_conv(train: Data, epochs: int) -> LoadedModel:
    """Adam (lr 1e-3), batch 32 as in seed 004 App. D (its lr "1e-6" would not train in 6 epochs)."""
    torch.manual_seed(0)
    mean, std = channel_stats(train)
    net = two_conv_net(train.num_classes)
    clf = Classifier(net, last_linear_name(net), mean, std)
    opt = torch.optim.Adam(clf.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        clf.train()
        perm = torch.randperm(len(train), generator=gen)
        for start in range(0, len(train), 32):
            xb, yb = train.take(perm[start : start + 32])
            loss = nn.functional.cross_entropy(clf(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    clf.eval()
    return as_loaded(clf, "builtin:small-cnn")


def as_loaded(clf: Classifier, spec: str) -> LoadedModel:
    """A loaded-model wrapper for an in-memory classifier (``spec`` only names it in messages)."""
    return LoadedModel(clf, ModelSpec.parse(spec), Path(), "", {"input_shape": [1, 28, 28]})


def auroc(p_in: torch.Tensor, p_out: torch.Tensor) -> float:
    """MNIST-vs-notMNIST AUROC of the max-probability score (in-distribution positive)."""
    return float(ood_metrics(p_in.max(-1).values, p_out.max(-1).values)["auroc"])


def all_layer_mmc(
    lap: LaplacePosterior, clf: Classifier, data: Data, grid: Sequence[float]
) -> dict[float, float]:
    """MC(1000) MMC on ``data`` of the all-layer GLM predictive at every ``δ`` of ``grid``, each
    batch's Jacobians ``[B, K, P]`` computed once for the whole grid."""
    total = dict.fromkeys(grid, 0.0)
    for x, _ in data.batches(256):
        f, jac = network_jacobian(clf.net, clf.normalise(x))
        for delta in grid:
            lap.set_prior_precision(delta)
            probs = monte_carlo(
                lap.gaussian.push_jacobian(f, jac), MC_SAMPLES, torch.Generator().manual_seed(0)
            ).probs
            total[delta] += float(probs.max(-1).values.sum())
    return {d: v / len(data) for d, v in total.items()}


def links(lg: LogitGaussian) -> dict[str, torch.Tensor]:
    """Probabilities of every link the seed-004 rows compare, on one logit Gaussian."""
    gen = torch.Generator().manual_seed(0)
    return {
        "mc": monte_carlo(lg, MC_SAMPLES, gen).probs,
        "probit": probit(lg),
        "lb": dirichlet_mean(bridge(lg, "zero-sum")).float(),
        "lb-norm": dirichlet_mean(bridge(lg, "norm")).float(),
    }


def norm_gain(lg: LogitGaussian) -> float:
    """Median factor ``1/√c`` by which the normalised bridge scales the (zero-sum corrected) logit
    means, ``c = mean_k Σ_kk / √(K/2)``: above 1 it sharpens the prediction."""
    _, var = correct(lg.mean, lg.var, lg.rowsum(), "zero-sum")
    c = var.mean(-1) / math.sqrt(lg.num_classes / 2)
    return float(c.rsqrt().median())


def fmt(x: float) -> str:
    return f"{x:.3f}"


# ---------------------------------------------------------------------------------------------
# seed 003
# ---------------------------------------------------------------------------------------------


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error ``s / √n`` (``s`` with Bessel's correction; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def edge_counts(chosen: Iterable[float], grid: Sequence[float]) -> tuple[int, int]:
    """How many of the ``chosen`` δ are ``grid``'s smallest and how many its largest value (a choice at
    an edge might be bettered outside the grid)."""
    lo, hi = min(grid), max(grid)
    values = list(chosen)
    return sum(d <= lo for d in values), sum(d >= hi for d in values)


def glm_vs_bnn(quick: bool) -> list[dict]:
    """GLM vs BNN predictive on one all-layer GGN Laplace posterior, full (the seed's) and diagonal,
    δ by validation NLL per predictive and split; test NLL mean over splits, and the paired
    per-split difference GLM − BNN with its standard error (the split noise). Two protocols: the
    MAP trained once at δ = 1 (a post-hoc tool's; δ on :data:`GLM_BNN_GRID`), and the seed's, the
    MAP retrained at every δ of its own grid (``glm_vi_real.run_retrained``)."""
    # quick: the two small sets (P = 1,652 / 853); digits' full GGN (P = 3,760 / 6,310) costs
    # about 1.2 / 4 minutes per split on one core (its eigendecomposition, then ~7 s per δ for the
    # GLM predictive's J Σ Jᵀ at depth 2), hence 3 splits of it in full mode and the seed's 10 for
    # the others
    depths = (1,) if quick else (1, 2)
    names = ("cancer", "wine") if quick else tuple(glm_vi_real.DATASETS)
    configs = [(n, d) for d in depths for n in names]
    n_splits = {n: 1 if quick else GLM_BNN_SPLITS[n] for n, _ in configs}
    cols = tuple(f"{p} Lapl (all {s})" for s in ("full", "diag") for p in ("BNN", "GLM"))
    res = {
        f"{n}-{d}": [glm_vi_real.run(n, d, cols, s, GLM_BNN_GRID) for s in range(n_splits[n])]
        for n, d in configs
    }
    retrain_configs = RETRAIN_QUICK if quick else RETRAIN_SPLITS
    retrained = {
        f"{n}-{d}": [glm_vi_real.run_retrained(n, d, s) for s in range(k)]
        for (n, d), k in retrain_configs.items()
    }
    several = max(n_splits.values()) > 1

    def summary(
        results: dict[str, list[dict]], structure: str
    ) -> tuple[dict[str, tuple[float, float, float, float]], str]:
        """``config → (GLM mean, BNN mean, mean Δ, se Δ)`` and its text."""
        bnn, glm = f"BNN Lapl (all {structure})", f"GLM Lapl (all {structure})"
        out = {}
        for key, runs in results.items():
            diff = mean_se([r[glm][0] - r[bnn][0] for r in runs])
            out[key] = (mean_se([r[glm][0] for r in runs])[0], mean_se([r[bnn][0] for r in runs])[0], *diff)
        text = "; ".join(
            f"{k} {fmt(g)} vs {fmt(b)}" + (f" (Δ {d:+.3f}±{se:.3f})" if len(results[k]) > 1 else "")
            for k, (g, b, d, se) in out.items()
        )
        return out, text

    def medians(results: dict[str, list[dict]]) -> str:
        glm_col, bnn_col = "GLM Lapl (all full)", "BNN Lapl (all full)"
        return "; ".join(
            f"{key} {statistics.median(r[glm_col][2] for r in runs):.2g}/"
            f"{statistics.median(r[bnn_col][2] for r in runs):.2g}"
            for key, runs in results.items()
        )

    def edges(results: dict[str, list[dict]], grid: Sequence[float], map_gap: bool) -> str:
        """Choices at the grid's ends; with ``map_gap`` (one MAP for every δ: the predictives' limit
        as δ → ∞), how many top choices score the MAP's validation NLL to 1e-4 (the predictive has
        become the MAP there: a larger δ changes nothing)."""
        chosen = [(r[c][2], r[c][3], r["MAP"][3]) for runs in results.values() for r in runs for c in cols]
        low, high = edge_counts((d for d, _, _ in chosen), grid)
        text = f"{low} at the bottom, {high} at the top of {len(chosen)} choices"
        if map_gap and high:
            flat = sum(abs(v - m) <= 1e-4 for d, v, m in chosen if d >= max(grid))
            text += f" ({flat} of them at the MAP's val NLL ± 1e-4)"
        return text

    _, full_text = summary(res, "full")
    _, diag_text = summary(res, "diag")
    rt_full, rt_full_text = summary(retrained, "full")
    _, rt_diag_text = summary(retrained, "diag")
    counts = ", ".join(f"{n} {k}" for n, k in n_splits.items())
    rt_counts = ", ".join(f"{n}-{d} {k}" for (n, d), k in retrain_configs.items())
    mean_of = "mean over splits, Δ = GLM − BNN ± se" if several else "1 split"
    grid = GLM_BNN_GRID
    return [
        {
            "seed": "003 GLM/GGP",
            "where": "Table 1, Fig. 4",
            "claim": "GLM predictive < BNN predictive (test NLL), same Laplace posterior",
            "paper": "8/8 UCI sets, e.g. digits 0.256 vs 0.671, cancer 0.10 vs 0.15",
            "ours": f"GLM vs BNN NLL ({mean_of}). Seed's protocol (MAP retrained per δ), full GGN: "
            f"{rt_full_text}; diag GGN: {rt_diag_text}; δ GLM/BNN (full, median): {medians(retrained)}; "
            f"at a grid edge: {edges(retrained, glm_vi_real.GRID, False)}. MAP trained once at δ = 1, full "
            f"GGN: {full_text}; diag GGN: {diag_text}; δ GLM/BNN (full, median): {medians(res)}; at a grid "
            f"edge: {edges(res, grid, True)}",
            "protocol": f"sklearn cancer/wine/digits (3 of 8 sets), 50-unit tanh MLP depth 1/2 (MAP: "
            "full-batch Adam 3000 steps; paper 10,000); all-layer full GGN Laplace (as the paper) and "
            "diag; BNN predictive 100 weight draws, GLM MC(1000); δ by val NLL per predictive and split. "
            f"Seed's protocol: MAP retrained at each of the seed's 10 δ 1e-2..1e2 (paper: digits "
            f"1e-1..1e2), {rt_counts} split(s) (paper 10; no digits: one eigendecomposition per δ). MAP "
            f"once: {counts} split(s), δ on {len(grid)} log values {grid[0]:.0e}..{grid[-1]:.0e} (the seed's "
            "4/9-decade spacing continued upward; both predictives tend to that MAP as δ grows). Held = "
            "GLM < BNN (full) on every set/depth of the seed's protocol",
            "held": all(g < b for g, b, _, _ in rt_full.values()),
        }
    ]


def ggp_all_points(quick: bool) -> list[dict]:
    r = ggp_bench.all_points_equivalence()
    gaps = (r["max gap f*"], r["max gap refined"])
    return [
        {
            "seed": "003 GLM/GGP",
            "where": "§2.5",
            "claim": "GGP on all N fitting points = GLM (at f*/θ* and refined)",
            "paper": "exact equivalence",
            "ours": f"max |Δp| {gaps[0]:.1e} (f*), {gaps[1]:.1e} (refined); NLL {fmt(r['glm f*'])} = "
            f"{fmt(r['ggp f*'])}, {fmt(r['glm refined'])} = {fmt(r['ggp refined'])}",
            "protocol": f"digits small CNN, last-layer full Laplace, marglik δ {r['prior_precision']:.3g}, "
            f"N = {int(r['points'])}",
            "held": max(gaps) < 1e-3,
        }
    ]


def ggp_vi_vs_laplace(splits: MnistSplits, quick: bool) -> list[dict]:
    """Seed 003 Table 2's protocol on MNIST: LeNet5, δ per method by validation NLL, MC predictive."""
    epochs = 8 if quick else 20
    cfg = TrainConfig(epochs=epochs, batch_size=64, lr=1e-3, seed=0)
    clf, _ = train_classifier("builtin:lenet", splits.train, splits.val, cfg)
    model = as_loaded(clf, "builtin:lenet")
    f_tr, f_va, f_te = (extract_features(model, d) for d in (splits.train, splits.val, splits.test))
    y_va, y_te = splits.val.y, splits.test.y
    grid = [float(v) for v in np.logspace(-2, 3, 6)]
    gen = torch.Generator().manual_seed(0)

    def mc(lg: LogitGaussian) -> torch.Tensor:
        return monte_carlo(lg, MC_SAMPLES, gen.manual_seed(0)).probs

    out = {"MAP": nll(f_te.logits.softmax(-1), y_te)}
    chosen = {}
    # GGP Laplace on all 5,000 fitting points through its weight-space twin: with every point the
    # GGP *is* the GLM (§2.5, the "GGP(all points) = GLM" row checks it to 1e-6), and the GP form
    # costs O(M³) with a [C, M, M] buffer (2 GB at M = 5,000) per Newton step.
    for refine in (False, True):

        def ggp_at(delta: float, refine: bool = refine) -> tuple[torch.Tensor, torch.Tensor]:
            lap = fit_laplace(
                clf, phi=f_tr.phi, labels=f_tr.labels, structure="full", prior_precision=delta,
                refine_steps=20 if refine else 0,
            )  # fmt: skip
            return mc(lap.logit_gaussian(f_va.phi)), mc(lap.logit_gaussian(f_te.phi))

        name = "GGP Lapl " + ("refined" if refine else "f*")
        chosen[name], p = select_by_nll(grid, ggp_at, y_va)
        out[name] = nll(p, y_te)
    source = FitSource(model, splits.train, device=CPU)
    vi_epochs = 20 if quick else 40
    for m in (512,) if quick else (512, 2048):

        def vi_at(delta: float, m: int = m) -> tuple[torch.Tensor, torch.Tensor]:
            settings = ggp_vi.GGPVIConfig(
                prior_precision=delta, inducing_points=m, epochs=vi_epochs, batch_size=512, select=False
            )
            post = ggp_vi.fit(source, settings)
            return mc(post.logit_gaussian(f_va.phi)), mc(post.logit_gaussian(f_te.phi))

        chosen[f"GGP VI {m}"], p = select_by_nll(grid, vi_at, y_va)
        out[f"GGP VI {m}"] = nll(p, y_te)
    best_vi = f"GGP VI {2048 if not quick else 512}"
    gap = out[best_vi] - out["GGP Lapl refined"]
    ours = ", ".join(f"{k} {fmt(v)}" for k, v in out.items())
    return [
        {
            "seed": "003 GLM/GGP",
            "where": "Table 2 (CIFAR-10 LeNet5)",
            "claim": "GGP VI (inducing points) = GGP Laplace at the refined mode (test NLL)",
            "paper": "VI 2048: 1.368±0.007 vs Lapl refined 1.366±0.006 (VI 512: 1.409; f*: 1.407; MAP 1.415)",
            "ours": f"{ours}; Δ({best_vi} − refined) = {gap:+.4f} (tol {GGP_TOLERANCE:.4f}); "
            f"δ: " + ", ".join(f"{k} {v:.3g}" for k, v in chosen.items()),
            "protocol": f"MNIST 5,000 train images (paper CIFAR-10 5k split), LeNet5 {epochs} epochs "
            f"(paper 60), last-layer kernel (rank 85; paper all-layer), VI {vi_epochs} epochs cosine "
            f"(paper 200, 0.97/epoch), δ grid 1e-2..1e3 on val (paper 10..120), MC {MC_SAMPLES} "
            "(paper 50,000), 1 split (paper 10)",
            "held": abs(gap) <= GGP_TOLERANCE,
        }
    ]


# ---------------------------------------------------------------------------------------------
# seed 004
# ---------------------------------------------------------------------------------------------


def bridge_rows(splits: MnistSplits, quick: bool) -> list[dict]:
    """Table 1 (MNIST → notMNIST, all-layer diag), the normalised bridge, and §5.4 (pretrained)."""
    model = train_two_conv(splits.train, 2 if quick else 6)
    clf = model.classifier
    data = {"val": splits.val, "test": splits.test, "ood": splits.ood}
    with warnings.catch_warnings():  # notMNIST's letters have digit labels: MAP "accuracy" is meaningless
        warnings.simplefilter("ignore", LowAccuracyWarning)
        feats = {k: extract_features(model, d) for k, d in data.items()}
    p_map = {k: f.logits.softmax(-1) for k, f in feats.items()}
    acc_map = accuracy(p_map["test"], splits.test.y)

    # all-layer diagonal GGN Laplace, δ such that the sampled validation MMC is ~5% below MAP's
    lap_all = fit_laplace(
        clf, batches=splits.train.batches(256), subset="all", structure="diag", prior_precision=1.0
    )
    grid = [float(v) for v in np.logspace(-1, 5, 7 if quick else 13)]
    val_mmc = all_layer_mmc(lap_all, clf, splits.val, grid)
    target = 0.95 * mmc(p_map["val"])
    delta, val_mmc_at = mmc_matched_delta(grid, val_mmc.__getitem__, target)
    lap_all.set_prior_precision(delta)
    lg_all = {k: logit_gaussian(lap_all, feats[k], clf, data[k]) for k in ("test", "ood")}
    p_all = {k: links(lg) for k, lg in lg_all.items()}

    # last-layer KFAC at the marginal-likelihood δ: the project's default post-hoc Laplace
    f_tr = extract_features(model, splits.train)
    kfac = fit_laplace(clf, phi=f_tr.phi, labels=f_tr.labels, structure="kron", prior_precision="auto")
    lg_kfac = {k: kfac.logit_gaussian(feats[k].phi) for k in ("test", "ood")}
    p_kfac = {k: links(lg) for k, lg in lg_kfac.items()}

    def cell(p: dict[str, dict[str, torch.Tensor]], link: str) -> tuple[float, float, float]:
        """(in-distribution MMC, OOD MMC, AUROC)."""
        return mmc(p["test"][link]), mmc(p["ood"][link]), auroc(p["test"][link], p["ood"][link])

    map_cell = (mmc(p_map["test"]), mmc(p_map["ood"]), auroc(p_map["test"], p_map["ood"]))
    mc_cell, lb_cell = cell(p_all, "mc"), cell(p_all, "lb")
    norm_all, norm_kfac = cell(p_all, "lb-norm"), cell(p_kfac, "lb-norm")

    def show(c: tuple[float, float, float]) -> str:
        return f"{fmt(c[0])}/{fmt(c[1])}/{fmt(c[2])}"

    net = (
        f"2-conv+1-linear net, Adam batch 32, {2 if quick else 6} epochs on MNIST test[:5000] "
        f"(paper: 60k train, 99% acc; ours {acc_map:.3f})"
    )
    rows = [
        {
            "seed": "004 Laplace bridge",
            "where": "Table 1 (MNIST→notMNIST)",
            "claim": "bridge ≈ MC(1000) for OOD detection (all-layer diag Laplace)",
            "paper": "MMC in/OOD / AUROC: MC 0.942/0.543/0.960, LB 0.987/0.649/0.961",
            "ours": f"MAP {show(map_cell)}, MC {show(mc_cell)}, LB {show(lb_cell)}; δ {delta:.3g} "
            f"(val MC MMC {val_mmc_at:.3f}, target {target:.3f})",
            "protocol": f"{net}; δ by the seed's 5%-below-MAP MMC rule on val (paper: on its eval data); "
            f"{len(splits.ood):,} notMNIST, {len(splits.test):,} MNIST; 1 seed (paper 5)",
            "held": abs(lb_cell[2] - mc_cell[2]) <= 0.01,
        },
        {
            "seed": "004 Laplace bridge",
            "where": "normalised bridge (laplace-torch bridge_norm)",
            "claim": "normalised bridge lowers OOD MMC below MAP and raises AUROC",
            "paper": "not in seed 004's text; shared/data README: AUROC MAP 0.91 → KFAC+norm 0.986",
            "ours": f"MMC in/OOD / AUROC: MAP {show(map_cell)}, KFAC marglik δ {kfac.prior_precision:.3g} "
            f"+norm {show(norm_kfac)}, all-diag δ {delta:.3g} +norm {show(norm_all)}; median μ gain 1/√c "
            f"on notMNIST: KFAC {norm_gain(lg_kfac['ood']):.2f}, all-diag {norm_gain(lg_all['ood']):.2f}",
            "protocol": f"{net}; formula = laplace-torch's (zero-sum, then mean diag Σ scaled to √(K/2)): "
            "it rescales μ by 1/√c, so a confident posterior (var ≪ √(K/2)) is made *more* confident",
            "held": norm_kfac[1] < map_cell[1] and norm_kfac[2] > map_cell[2],
        },
    ]

    # §5.4: Laplace on a pretrained network (one pass for the curvature), δ by validation NLL
    # (the project's default), uncertainty-aware top-k from the bridge
    post = fit_laplace(clf, phi=f_tr.phi, labels=f_tr.labels, structure="kron", prior_precision=1.0)

    def probit_at(d: float) -> tuple[torch.Tensor, torch.Tensor]:
        post.set_prior_precision(d)
        return probit(post.logit_gaussian(feats["val"].phi)), probit(post.logit_gaussian(feats["test"].phi))

    delta_pt, p_probit = select_by_nll([float(v) for v in np.logspace(-2, 4, 13)], probit_at, splits.val.y)
    post.set_prior_precision(delta_pt)
    alpha = bridge(post.logit_gaussian(feats["test"].phi), "zero-sum")
    top = topk_summary(uncertainty_topk(alpha, 0.05, 10), dirichlet_mean(alpha), splits.test.y)
    y = splits.test.y
    nll_map, nll_lap = nll(p_map["test"], y), nll(p_probit, y)
    ece_map, ece_lap = ece(p_map["test"], y), ece(p_probit, y)
    auroc_lap = auroc(p_probit, probit(post.logit_gaussian(feats["ood"].phi)))
    rows.append(
        {
            "seed": "004 Laplace bridge",
            "where": "§5.4 (ImageNet, pretrained)",
            "claim": "post-hoc last-layer Laplace on a pretrained net: uncertainty-aware top-k beats top-1",
            "paper": "DenseNet top-1 0.744 → top-k 0.797 at mean k 1.688",
            "ours": f"top-1 {top['top1_accuracy']:.4f} → top-k {top['set_accuracy']:.4f} at mean k "
            f"{top['mean_k']:.3f}; MAP → KFAC probit: NLL {nll_map:.4f} → {nll_lap:.4f}, ECE "
            f"{ece_map:.4f} → {ece_lap:.4f}, AUROC {map_cell[2]:.3f} → {auroc_lap:.3f}",
            "protocol": "the trained 2-conv net as the pretrained one (paper ImageNet DenseNet), last-layer "
            f"KFAC, δ {delta_pt:.3g} by val NLL (paper: by hand), threshold 0.05, max k 10",
            "held": top["set_accuracy"] > top["top1_accuracy"]
            and nll_lap <= nll_map
            and auroc_lap >= map_cell[2],
        }
    )
    return rows


def bridge_cost(quick: bool) -> list[dict]:
    res = bridge_bench.speed_ratios((10, 100) if quick else (10, 100, 1000), 2_000 if quick else 10_000)
    ours = ", ".join(
        f"K={r['k']}: {r['ratio']:,.0f}× ({1e3 * r['bridge_s']:.2f} ms vs {r['mc_s']:.2f} s)" for r in res
    )
    return [
        {
            "seed": "004 Laplace bridge",
            "where": "Table 1, Table 2",
            "claim": "bridge ≥ ~400× faster than MC(1000) on the same logit Gaussians",
            "paper": "~400× on average (GPU); CIFAR-10: MC(1000) 8.18 s vs LB 0.014 s",
            "ours": ours,
            "protocol": f"CPU, {torch.get_num_threads()} thread(s), {res[0]['mc_inputs']:,} random diagonal "
            "Gaussians (paper: network outputs on a GPU)",
            "held": all(r["ratio"] >= 400 for r in res),
        }
    ]


# ---------------------------------------------------------------------------------------------


def error_row(seed: str, where: str, claim: str, exc: BaseException) -> dict:
    return {
        "seed": seed,
        "where": where,
        "claim": claim,
        "paper": "—",
        "ours": f"error: {type(exc).__name__}: {exc}",
        "protocol": "—",
        "held": False,
        "error": traceback.format_exc(),
    }


def rows(quick: bool, shared: Path) -> list[dict]:
    """One dict per seed-003/004 claim (see the module docstring); a failing experiment becomes an
    error row (``held`` False, ``error`` set) so that the others still report."""
    out: list[dict] = []
    splits: MnistSplits | None = None

    def mnist() -> MnistSplits:
        nonlocal splits
        if splits is None:
            splits = MnistSplits(shared, quick)
        return splits

    jobs = [
        ("003 GLM/GGP", "Table 1, Fig. 4", "GLM < BNN predictive", lambda: glm_vs_bnn(quick)),
        ("003 GLM/GGP", "§2.5", "GGP(all points) = GLM", lambda: ggp_all_points(quick)),
        ("003 GLM/GGP", "Table 2", "GGP VI = GGP Laplace", lambda: ggp_vi_vs_laplace(mnist(), quick)),
        (
            "004 Laplace bridge",
            "Table 1, §5.4",
            "bridge on MNIST→notMNIST",
            lambda: bridge_rows(mnist(), quick),
        ),
        ("004 Laplace bridge", "Table 2", "bridge vs MC cost", lambda: bridge_cost(quick)),
    ]
    for seed, where, claim, job in jobs:
        start = time.perf_counter()
        try:
            got = job()
        except Exception as exc:  # one failing experiment must not lose the other rows
            got = [error_row(seed, where, claim, exc)]
        for r in got:
            r["seconds"] = round(time.perf_counter() - start, 1)
        out.extend(got)
    return out
