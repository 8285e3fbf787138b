"""The shared held-out selection rule (bayescli/posterior/selection.py) on curves we design."""

from __future__ import annotations

import pytest
import torch

from bayescli.metrics.classification import nll
from bayescli.posterior.selection import Scored, select_on_grid

N, K = 200, 4
GEN = torch.Generator().manual_seed(0)
LOGITS = torch.randn(N, K, generator=GEN, dtype=torch.float64) * 2
# labels drawn at scale 1/4: the NLL of softmax(s · logits) falls as s falls toward ~1/4
LABELS = torch.multinomial((LOGITS / 4).softmax(-1), 1, generator=GEN).squeeze(1)


def scaled(scale_of):
    """candidate(v) = softmax(scale(v) · logits), with its log-softmax."""

    def candidate(v: float):
        z = LOGITS * scale_of(v)
        return v, Scored(z.softmax(-1), z.log_softmax(-1))

    return candidate


def grid(lo: int, hi: int) -> list[float]:
    return [10.0**i for i in range(lo, hi + 1)]


def test_a_curve_flat_to_the_map_end_chooses_the_map_end_without_extending():
    # scale 1 (MAP) from v = 100 up, overconfident (scale > 1, worse) below: the curve is flat
    # from 100 to the MAP end, and the tie goes to the MAP end
    chosen, sel = select_on_grid(
        "delta", grid(-2, 4), scaled(lambda v: max(1.0, 100 / v)), LABELS, map_side="high",
        map_probs=LOGITS.softmax(-1),
    )  # fmt: skip
    assert chosen == sel.chosen == 1e4 and sel.map_point and sel.extensions == 0
    assert "reaches the MAP limit" in sel.warning
    assert sel.map_scores["nll"] == pytest.approx(nll(LOGITS.softmax(-1), LABELS))


def test_an_interior_minimum_is_chosen_and_recorded():
    # scale 1/4 (where the labels were drawn) at v = 1, a factor 10^(1/3) apart per grid step
    def scale(v: float) -> float:
        return v ** (1 / 3) / 4

    chosen, sel = select_on_grid("tau", grid(-3, 3), scaled(scale), LABELS, map_side="low")
    assert chosen == 1.0 and not sel.map_point and sel.warning is None and sel.extensions == 0
    curve = {row["tau"]: row["nll"] for row in sel.curve}
    assert set(curve) == set(grid(-3, 3)) and min(curve, key=curve.get) == 1.0
    for v, value in curve.items():
        assert value == pytest.approx(nll((LOGITS * scale(v)).softmax(-1), LABELS), rel=1e-12)


def test_a_minimum_at_the_other_edge_extends_the_grid_then_warns():
    # scale 1/2 + v^(1/4)/2 stays above the labels' 1/4 and falls as v → 0: the NLL keeps improving
    # below the grid, whose MAP end is high
    chosen, sel = select_on_grid(
        "c",
        grid(0, 3),
        scaled(lambda v: 0.5 + 0.5 * v**0.25),
        LABELS,
        map_side="high",
        extensions=2,
        extend_by=2,
    )
    assert sel.extensions == 2 and len(sel.curve) == 4 + 4
    assert chosen == min(row["c"] for row in sel.curve) == pytest.approx(1e-4)
    assert not sel.map_point and "smallest value searched" in sel.warning


def test_a_curve_improving_up_to_the_map_end_is_not_extended_past_it():
    # scale 1 + 1/v: overconfident, improving toward the MAP end, strictly best there
    chosen, sel = select_on_grid("delta", grid(-2, 4), scaled(lambda v: 1 + 1 / v), LABELS, map_side="high")
    assert chosen == 1e4 and sel.map_point and sel.extensions == 0 and len(sel.curve) == 7
