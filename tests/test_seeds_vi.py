"""Helpers of ``benchmarks/seeds_vi.py`` (the VI seed-claim rows): the κ carried to a smaller
training set, the paper's LeNet, early stopping of the deterministic baseline, the protocol split,
and the Dirichlet fVI pattern statistics."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dirichlet_fvi_real  # noqa: E402
import seeds_vi  # noqa: E402

from bayescli.data import ArrayData  # noqa: E402
from bayescli.metrics.classification import nll  # noqa: E402


def test_kl_weight_keeps_kappa():
    # Oracle: the paper's κ = (κ/N)·N = 2e-7 · 55,000 = 0.011, the same at every N.
    assert seeds_vi.kl_weight_at(55_000) == pytest.approx(2e-7, rel=1e-12)
    assert seeds_vi.kl_weight_at(5_000) == pytest.approx(2.2e-6, rel=1e-12)
    for n in (100, 5_000, 60_000):
        assert seeds_vi.kl_weight_at(n) * n == pytest.approx(0.011, rel=1e-12)


def test_relative_change_of_table_2():
    # [002] Table 2: NLL 0.0266 → 0.0177 is the quoted −33%.
    assert seeds_vi.relative_change(0.0177, 0.0266) == pytest.approx(-0.0089 / 0.0266, rel=1e-12)
    assert round(100 * seeds_vi.relative_change(0.0177, 0.0266)) == -33


def test_lenet_002_is_the_papers_size():
    # Oracle: [002] Table 2 lists 1.111e6 parameters; by hand 32·25+32 + 64·32·25+64 + 1024·1024+1024
    # + 10·1024+10 = 1,111,946 at 28×28.
    net = seeds_vi.lenet_002(10, (1, 28, 28))
    assert sum(p.numel() for p in net.parameters()) == 1_111_946
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_split_rows_are_disjoint():
    ranges = [
        slice(*(int(v) if v else None for v in r.strip("[]").split(":"))) for r in seeds_vi.SPLIT.values()
    ]
    rows = [set(range(10_000)[s]) for s in ranges]
    assert all(not (a & b) for i, a in enumerate(rows) for b in rows[i + 1 :])
    assert sum(map(len, rows)) == 10_000


@pytest.mark.parametrize("permuted", [False, True])
def test_deterministic_baseline_keeps_the_best_validation_epoch(permuted):
    # Images whose brightness gives the class. Validated on the training labels the NLL falls
    # with training; on permuted labels it rises (the net grows confident in the true ones), so
    # keeping the last or the first epoch fails one of the two cases.
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (256,), generator=gen)
    x = (torch.rand(256, 1, 16, 16, generator=gen) * 100 + 50 * y.view(-1, 1, 1, 1)).to(torch.uint8)
    names = [str(k) for k in range(4)]
    train = ArrayData(x, y, names)
    val = ArrayData(x, y[torch.randperm(256, generator=gen)] if permuted else y, names)
    cfg = seeds_vi.DeterministicConfig(epochs=4, batch_size=32, milestone=2)
    clf, rec = seeds_vi.train_deterministic("builtin:lenet-002", train, val, cfg)
    curve = rec["val_nll"]
    assert len(curve) == cfg.epochs and rec["epoch"] == curve.index(min(curve)) + 1
    assert rec["epoch"] == (1 if permuted else cfg.epochs)
    assert nll(seeds_vi.softmax(clf, val), val.y) == pytest.approx(min(curve), rel=1e-6)


def test_dirichlet_pattern_statistics():
    # Two seeds of hand-made per-angle (accuracy, LL, ECE); oracle: the differences by hand and
    # statistics.mean/stdev.
    def result(acc0: float, ll: dict[int, float], ece: float) -> dict[int, tuple[float, float, float]]:
        return {a: (acc0 if a == 0 else 0.1, ll.get(a, -1.0), ece) for a in dirichlet_fvi_real.ANGLES}

    per_seed = [
        {
            "f": result(0.97, {0: -0.10, 60: -3.0, 90: -4.0, 120: -4.0}, 0.05),
            "b": result(0.96, {0: -0.11}, 0.01),
        },
        {
            "f": result(0.98, {0: -0.12, 60: -2.0, 90: -3.0, 120: -3.5}, 0.07),
            "b": result(0.96, {0: -0.11}, 0.02),
        },
    ]
    out = dirichlet_fvi_real.pattern(per_seed, "f", "b")
    far = [(-3.0 + 1 - 4.0 + 1 - 4.0 + 1) / 3, (-2.0 + 1 - 3.0 + 1 - 3.5 + 1) / 3]
    assert out["ΔLL(60–120°)"] == pytest.approx((statistics.mean(far), statistics.stdev(far)), rel=1e-12)
    assert out["ΔLL(0°)"] == pytest.approx((0.0, statistics.stdev([0.01, -0.01])), abs=1e-12)
    assert out["Δacc(0°) pp"] == pytest.approx((1.5, statistics.stdev([1.0, 2.0])), rel=1e-9)
    assert out["ΔECE(>60°)"] == pytest.approx((0.045, statistics.stdev([0.04, 0.05])), rel=1e-9)
    single = dirichlet_fvi_real.pattern(per_seed[:1], "f", "b")
    assert single["ΔLL(0°)"] == pytest.approx((0.01, 0.0), abs=1e-12)


def test_size_markdown_row():
    # One hand-made run of the size sweep: ΔNLL is 100·rel_nll with a sign, N has a thousands comma.
    run = {
        "n": 1250,
        "seed": 1,
        "kl_weight": seeds_vi.kl_weight_at(1250),
        "det": {"nll": 0.2, "err": 5.0, "ece": 0.02},
        "mnvi": {"nll": 0.15, "err": 5.5, "ece": 0.01},
        "rel_nll": seeds_vi.relative_change(0.15, 0.2),
    }
    table = seeds_vi.size_markdown([run]).splitlines()
    assert len(table) == 3
    assert table[2] == "| 1,250 | 1 | 8.8e-06 | 0.2000 | 5.00 | 0.0200 | 0.1500 | 5.50 | 0.0100 | -25.0% |"
