"""Held-out choice of Dirichlet fVI's τ (bayescli.posterior.selection): by default on validation
data, over a grid from 10·τ_p down to the weight-space limit, never worse than MAP on validation.

Rows: the nets train on digits:train (1,258 rows, also the fitting set), τ is chosen on
digits:val (180) and checked on digits:test (359); the three splits are disjoint.
"""

import math

import pytest
import torch
from tolerance import assert_below

from bayescli.data import load_data
from bayescli.fitting.fit_source import FitSource
from bayescli.metrics.classification import nll
from bayescli.models.specs import load_classifier
from bayescli.posterior.vi.dirichlet_fvi import PRINCIPLED_RULE, DirichletFVIConfig, fit, principled_tau
from bayescli.posterior.vi.dirichlet_fvi_settings import GAMMA
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier

# The MAP end of the search is the MAP head with γ-smoothed probabilities (1 − γ)p + γ/K: its NLL
# exceeds MAP's by at most −ln(1 − γ) ≈ 1.0e-4 on any row.
MAP_GAP = -math.log1p(-GAMMA)
# Test NLL may trail MAP's by sampling noise of a 180-row validation choice; the brief's bound.
TEST_SLACK = 0.005


@pytest.fixture(scope="module")
def splits():
    return load_data("digits:train"), load_data("digits:val"), load_data("digits:test")


def dirichlet_mean_nll(post, source: FitSource, data) -> float:
    alpha = post.alpha_features(source.features(data).phi)
    return nll(alpha / alpha.sum(-1, keepdim=True), data.y)


def map_nll(source: FitSource, data) -> float:
    return nll(torch.softmax(source.features(data).logits.double(), -1), data.y)


def mlp(splits, epochs: int, tmp_path_factory):
    path = tmp_path_factory.mktemp("sel") / f"mlp{epochs}.safetensors"
    clf, meta = train_classifier("builtin:mlp", splits[0], None, TrainConfig(epochs=epochs, seed=0))
    save_checkpoint(path, clf, meta)
    return load_classifier("builtin:mlp", path)


def test_default_settings_choose_tau_on_validation_no_worse_than_map(digits_ckpt, splits):
    train, val, test = splits
    source = FitSource(load_classifier("builtin:small-cnn", digits_ckpt), train, val)
    post = fit(source, DirichletFVIConfig())  # ensemble of 10, τ unset, select unset
    record = post.metadata()["selection"]
    principled = principled_tau(10, len(train))
    assert record["validated"] and record["criterion"] == "nll" and record["principled"] == principled
    # the grid spans τ_p and reaches 10⁻³·τ_p, where the refit is the weight-space one (module docs)
    assert min(record["grid"]) <= 1e-3 * principled * (1 + 1e-12) and max(record["grid"]) >= principled
    # ... and the MAP limit itself: the MAP head, within MAP_GAP of MAP's validation NLL
    map_val = map_nll(source, val)
    assert_below(record["map_limit"]["nll"] - map_val, MAP_GAP, what="MAP limit vs MAP, validation NLL")
    # the chosen posterior is the best point searched, recomputed independently of the record
    val_nll = dirichlet_mean_nll(post, source, val)
    best = min([row["nll"] for row in record["curve"]] + [record["map_limit"]["nll"]])
    assert abs(val_nll - best) <= 1e-12 and post.tau == record["chosen"]
    assert_below(val_nll - map_val, MAP_GAP, what="selected vs MAP, validation NLL")
    test_gap = dirichlet_mean_nll(post, source, test) - map_nll(source, test)
    assert_below(test_gap, TEST_SLACK, what="selected vs MAP, test NLL")


def test_on_a_well_trained_net_no_refit_beats_map_so_the_map_head_is_kept(splits, tmp_path_factory):
    # 30 epochs, annealed: Adam's constant-rate refit sharpens the head (every τ scores ≥ 0.003
    # worse than MAP on validation, measured), so only the MAP end keeps the choice at MAP
    train, val, test = splits
    source = FitSource(mlp(splits, 30, tmp_path_factory), train, val)
    post = fit(source, DirichletFVIConfig(family="map"))
    record = post.metadata()["selection"]
    assert post.family == "map" and post.tau == 0.0 and record["chosen"] == 0.0
    assert "MAP head" in record["warning"] and post.meta["history"] == []
    # recorded as the MAP fallback, which select and evaluate read (no method-specific entry)
    assert record["map_fallback"] is True and post.selection.chose_map is True
    assert min(row["nll"] for row in record["curve"]) > record["map_limit"]["nll"]
    map_val = map_nll(source, val)
    assert_below(dirichlet_mean_nll(post, source, val) - map_val, MAP_GAP, what="validation NLL vs MAP")
    test_gap = dirichlet_mean_nll(post, source, test) - map_nll(source, test)
    assert_below(test_gap, MAP_GAP, what="test NLL vs MAP (the same head)")


def test_an_undertrained_net_gains_from_the_weight_space_refit_at_the_grid_edge(splits, tmp_path_factory):
    # 4 epochs: refitting the head by plain NLL improves it (measured 0.014 below MAP), so the
    # search walks to the smallest τ (the weight-space limit: never extended past) and says so
    train, val, _ = splits
    source = FitSource(mlp(splits, 4, tmp_path_factory), train, val)
    post = fit(source, DirichletFVIConfig(family="map"))
    record = post.metadata()["selection"]
    assert record["extensions"] == 0 and post.tau == record["chosen"] == min(
        r["tau"] for r in record["curve"]
    )
    assert "smallest value searched" in record["warning"] and "weight-space limit" in record["warning"]
    assert dirichlet_mean_nll(post, source, val) < record["map_limit"]["nll"]
    assert record["map_point"] is False  # a refit that beats the MAP head, not the MAP head
    assert "map_fallback" not in record and post.selection.chose_map is False


def test_without_validation_data_tau_is_the_principled_default_and_says_so(digits_ckpt, splits):
    train = splits[0]
    source = FitSource(load_classifier("builtin:small-cnn", digits_ckpt), train)
    post = fit(source, DirichletFVIConfig(family="map", epochs=1))
    record = post.metadata()["selection"]
    assert post.tau == record["chosen"] == pytest.approx(len(train) / 60_000, rel=1e-12)
    assert record["method"] == "default" and not record["validated"]
    assert record["rule"] == PRINCIPLED_RULE and "default_tau(K)*N/60000" in record["rule"]


def test_select_by_brier_minimises_the_brier_score(digits_ckpt, splits):
    train, val, _ = splits
    source = FitSource(load_classifier("builtin:small-cnn", digits_ckpt), train, val)
    post = fit(source, DirichletFVIConfig(family="map", epochs=2, select_by="brier"))
    record = post.metadata()["selection"]
    assert record["criterion"] == "brier"
    chosen = (
        record["map_limit"] if post.tau == 0.0 else next(r for r in record["curve"] if r["tau"] == post.tau)
    )
    assert chosen["brier"] == min([r["brier"] for r in record["curve"]] + [record["map_limit"]["brier"]])
