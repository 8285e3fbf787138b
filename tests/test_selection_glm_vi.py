"""Held-out choice of the prior precision δ for GLM VI, GGP VI and Bayes by Backprop.

A small MLP trained on digits' training split; the fitting set, the validation set (digits' val
split) and the test rows (digits' test split) are disjoint. With validation data and δ unset,
each method fits one posterior per grid value ``δ_0 · 10^i`` (``δ_0`` the Laplace marginal-likelihood
optimum) and keeps the lowest validation NLL; without validation data it uses ``δ_0``.

None of these families contains MAP: their prior is centred at zero and the mean is fitted, so no
δ gives back the network (GLM VI and GGP VI tend to the prior's uniform predictive as δ → ∞, BBB
pulls every weight to zero). "Never worse than MAP on validation" therefore cannot hold by
construction; the record carries MAP's validation scores and warns when every δ scores worse.
Measured here (MAP validation NLL 0.1882, test 0.2045), chosen δ → validation / test NLL:
GLM VI 0.354 → 0.2053 / 0.2079, GGP VI 9.7e6 (grid edge) → 0.1903 / 0.2049, BBB 1e-5 → 0.1897 / 0.2032:
all three slightly worse than MAP on validation, within 0.005 of it on test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bayescli.data import load_data
from bayescli.errors import BayescliError
from bayescli.fit_source import FitSource
from bayescli.metrics import nll
from bayescli.models import LoadedModel, ModelSpec
from bayescli.posterior.vi import bbb, ggp_vi, glm_vi
from bayescli.predictive.glm import predict
from bayescli.training.classifier import TrainConfig, train_classifier

# Fast settings: everything but δ and the selection switches is fixed small.
METHODS = {
    "glm-vi": (glm_vi, lambda **kw: glm_vi.GLMVIConfig(epochs=50, **kw), "glm"),
    "ggp-vi": (ggp_vi, lambda **kw: ggp_vi.GGPVIConfig(inducing_points=64, epochs=5, **kw), "glm"),
    "bbb": (bbb, lambda **kw: bbb.BBBConfig(epochs=2, samples=10, **kw), "bnn"),
}


@pytest.fixture(scope="module")
def digits_mlp() -> tuple[LoadedModel, object, object, object]:
    train = load_data("digits:train[:600]")
    clf, meta = train_classifier("builtin:mlp", train, None, TrainConfig(epochs=10, seed=0))
    model = LoadedModel(clf, ModelSpec.parse("builtin:mlp"), Path(), "", meta)
    return model, train, load_data("digits:val"), load_data("digits:test")


def _fit(digits_mlp, name: str, with_val: bool, **settings):  # noqa: ANN001, ANN202
    model, train, val, _ = digits_mlp
    module, config, _ = METHODS[name]
    source = FitSource(model, train, val if with_val else None)
    return source, module.fit(source, config(**settings))


@pytest.mark.parametrize("name", list(METHODS))
def test_validation_chooses_delta_around_the_marginal_likelihood(digits_mlp, name):
    source, post = _fit(digits_mlp, name, with_val=True)
    sel = post.meta["selection"]
    assert sel["validated"] and sel["setting"] == "prior_precision" and sel["criterion"] == "nll"
    deltas = [p["prior_precision"] for p in sel["curve"]]
    principled = sel["principled"]
    # the grid spans δ_0 by two decades each way
    assert principled in deltas and min(deltas) <= principled / 99 and max(deltas) >= principled * 99
    best = min(sel["curve"], key=lambda p: p["nll"])
    assert post.prior_precision == sel["chosen"] == best["prior_precision"]
    at_principled = next(p for p in sel["curve"] if p["prior_precision"] == principled)
    assert best["nll"] <= at_principled["nll"]
    # MAP's validation NLL is recorded (float64 softmax of the network's logits vs the record's)
    map_nll = nll(source.val_features().logits.softmax(-1).double(), source.val.y)
    assert abs(sel["map_validation"]["nll"] - map_nll) < 1e-6
    worse = "worse validation nll than MAP" in sel.get("warning", "")
    assert worse == (best["nll"] > map_nll)


@pytest.mark.parametrize("name", list(METHODS))
def test_test_nll_stays_near_map(digits_mlp, name):
    """Test NLL of the chosen posterior within 0.005 of MAP's (measured +0.0034 GLM VI, +0.0004
    GGP VI, −0.0013 BBB). A regression bound at this net, not a guarantee: on digits' whole training
    split (MLP, 10 epochs) GLM VI's choice measured 0.109 against MAP's 0.094."""
    model, _, _, test = digits_mlp
    source, post = _fit(digits_mlp, name, with_val=True)
    feats = source.features(test)
    probs = predict(post, feats, METHODS[name][2], "mc", 100, 0, model.classifier, test).probs
    assert nll(probs, test.y) <= nll(feats.logits.softmax(-1).double(), test.y) + 0.005


@pytest.mark.parametrize("name", list(METHODS))
def test_without_validation_data_the_marginal_likelihood_rule_is_recorded(digits_mlp, name):
    _, post = _fit(digits_mlp, name, with_val=False)
    sel = post.meta["selection"]
    assert not sel["validated"] and sel["method"] == "default"
    assert sel["rule"] == "Laplace marginal likelihood" and sel["chosen"] == post.prior_precision
    assert post.meta["prior"]["method"] == "laplace-marglik"


def test_explicit_values_and_switches(digits_mlp):
    _, post = _fit(digits_mlp, "glm-vi", with_val=True, prior_precision=3.0)
    assert post.prior_precision == 3.0
    assert post.meta["selection"] == {
        "method": "fixed",
        "validated": False,
        "setting": "prior_precision",
        "chosen": 3.0,
        "rule": "given",
    }
    _, post = _fit(digits_mlp, "ggp-vi", with_val=True, select=False)
    assert post.meta["selection"]["rule"] == "Laplace marginal likelihood"
    for name in METHODS:
        with pytest.raises(BayescliError, match=r"select=True .* no validation data \(`val`\)"):
            _fit(digits_mlp, name, with_val=False, select=True)
    with pytest.raises(BayescliError, match="select_by must be one of nll, ece, brier"):
        glm_vi.GLMVIConfig(select_by="accuracy")


def test_select_by_brier(digits_mlp):
    _, post = _fit(digits_mlp, "glm-vi", with_val=True, select_by="brier")
    sel = post.meta["selection"]
    assert sel["criterion"] == "brier"
    assert sel["chosen"] == min(sel["curve"], key=lambda p: p["brier"])["prior_precision"]
    assert post.meta["prior"]["method"] == "val-brier"
