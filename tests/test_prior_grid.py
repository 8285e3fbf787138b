"""Grid searches for δ extend past an edge minimum and warn when the optimum stays on the edge."""

import math

from bayescli.posterior.prior import edge_warning, grid_search

GRID = [10.0**e for e in range(-4, 5)]


def test_interior_minimum_needs_no_extension():
    best, curve = grid_search(lambda d: (math.log10(d) - 1) ** 2, GRID)
    assert best == 10.0 and len(curve) == len(GRID) and edge_warning(best, curve) is None


def test_minimum_beyond_the_grid_is_found_by_extending():
    best, curve = grid_search(lambda d: (math.log10(d) - 7) ** 2, GRID)
    assert math.isclose(best, 1e7, rel_tol=1e-9) and max(d for d, _ in curve) >= 1e7
    assert edge_warning(best, curve) is None
    best, _ = grid_search(lambda d: (math.log10(d) + 9) ** 2, GRID)
    assert math.isclose(best, 1e-9, rel_tol=1e-9)


def test_monotone_objective_ends_on_the_edge_with_a_warning():
    best, curve = grid_search(lambda d: -d, GRID, extensions=2, extend_by=8)
    assert math.isclose(best, 1e4 * 10.0**16, rel_tol=1e-9) and len(curve) == len(GRID) + 16
    assert "largest value searched" in edge_warning(best, curve)
    best, curve = grid_search(lambda d: d, GRID)
    assert "smallest value searched" in edge_warning(best, curve)
