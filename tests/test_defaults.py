"""Defaults that do not hurt (issue 23): for every method, the default fit with held-out validation
data, then the default evaluate, is no worse than MAP on validation and within 0.005 nats of MAP's
test NLL; without held-out data the summary says that nothing was validated.

The net is the suite's digits CNN (trained by conftest on digits:train, validation digits:val,
test digits:test: disjoint seeded splits). Each posterior is read through its default predictive
(GLM probit, or the Dirichlet mean for a native-Dirichlet posterior).
"""

from __future__ import annotations

import json

import pytest
import torch

from bayescli.posterior.base import load_posterior

# fit command and arguments beyond the defaults: bbb places its posterior on every weight, and
# fits on 300 of the rows (its default epochs over all weights cost a minute on the full split)
METHODS = {
    "laplace": ["fit-laplace"],
    "temperature": None,  # fitted by `select` (it has no fit command of its own)
    "mnvi": ["fit-vi", "--method", "mnvi"],
    "fsvi": ["fit-vi", "--method", "fsvi"],
    "dirichlet-fvi": ["fit-vi", "--method", "dirichlet-fvi"],
    "glm-vi": ["fit-vi", "--method", "glm-vi"],
    "ggp-vi": ["fit-vi", "--method", "ggp-vi"],
    "bbb": ["fit-vi", "--method", "bbb", "--subset", "all", "--limit", "300"],
}
# How close to MAP the MAP end of each search gets (see each method's selection docs): the
# largest gap measured was 4e-8 nats; the test allows 1e-4.
MAP_LIMIT_GAP = 1e-4
TEST_MARGIN = 0.005


def _fit(cli, method, digits_ckpt, out_dir, *extra):
    common = ["--model", "builtin:small-cnn", "--checkpoint", digits_ckpt, "--data", "digits:train"]
    if METHODS[method] is None:
        res = cli("select", "--methods", method, "--out-dir", out_dir, *common, *extra, "--json")
        return res, out_dir / f"{method}.safetensors"
    out = out_dir / f"{method}.safetensors"
    res = cli(*METHODS[method], *common, "--out", out, *extra, "--json")
    return res, out


def _nll(cli, posterior, data):
    res = cli("evaluate", "--posterior", posterior, "--data", data, "--ood-scores", "msp", "--json")
    assert res.code == 0, res.err
    rows = json.loads(res.out)["results"]["in_distribution"]
    post = load_posterior(posterior)
    name = "glm-bridge" if post.native_dirichlet else "glm-probit"
    return rows["map"]["nll"], rows[name]["nll"]


@pytest.mark.parametrize("method", list(METHODS))
def test_default_fit_with_validation_data_is_no_worse_than_map(method, cli, digits_ckpt, tmp_path):
    res, post = _fit(cli, method, digits_ckpt, tmp_path, "--val-data", "digits:val", "--quiet")
    assert res.code == 0, res.err
    assert load_posterior(post).metadata()["selection"]["validated"] is True
    map_val, val = _nll(cli, post, "digits:val")
    map_test, test = _nll(cli, post, "digits:test")
    print(f"{method}: val {val:.5f} (MAP {map_val:.5f}), test {test:.5f} (MAP {map_test:.5f})")
    assert val <= map_val + MAP_LIMIT_GAP, (val, map_val)
    assert test <= map_test + TEST_MARGIN, (test, map_test)


@pytest.mark.parametrize("method", ["laplace", "mnvi"])
def test_without_held_out_data_the_summary_says_nothing_was_validated(method, cli, tmp_path):
    """A checkpoint that records no validation split, no --val-data: principled defaults, said so."""
    from bayescli.data import load_data
    from bayescli.options import TrainConfig
    from bayescli.training.classifier import save_checkpoint, train_classifier

    clf, meta = train_classifier("builtin:mlp", load_data("digits:train"), None, TrainConfig(epochs=2))
    save_checkpoint(tmp_path / "mlp.safetensors", clf, meta)
    out = tmp_path / "post.safetensors"
    args = [*METHODS[method], "--model", "builtin:mlp", "--checkpoint", tmp_path / "mlp.safetensors"]
    res = cli(*args, "--data", "digits:train", "--out", out, "--json")
    assert res.code == 0, res.err
    summary = json.loads(res.out)
    assert summary["validated"].startswith("nothing was validated") and "--val-data" in summary["validated"]
    assert "warning: nothing was validated" in res.err
    sel = load_posterior(out).metadata()["selection"]
    assert sel["validated"] is False and sel["method"] == "default" and sel["rule"]


def test_val_split_carves_a_seeded_disjoint_validation_set(cli, digits_ckpt, tmp_path):
    """For fitting data the net never saw (digits:test here), --val-split holds a fraction out."""
    from bayescli.data import load_data

    out = tmp_path / "post.safetensors"
    args = [
        "fit-laplace",
        "--model",
        "builtin:small-cnn",
        "--checkpoint",
        digits_ckpt,
        "--data",
        "digits:test",
    ]
    res = cli(*args, "--val-split", "0.25", "--out", out, "--json")
    assert res.code == 0, res.err
    post = load_posterior(out)
    n = len(load_data("digits:test"))
    n_val = round(0.25 * n)
    assert post.n_data == n - n_val and post.metadata()["selection"]["validated"] is True
    assert post.meta["validation_data"]["val_split"] == 0.25 and post.meta["data"]["val_split"] == 0.25
    assert json.loads(res.out)["validation"] == "digits:test"
    # the carve partitions the rows, seeded
    from bayescli.fitting.pipeline import carve_validation

    data = load_data("digits:test")
    fit, val = carve_validation(data, 0.25, 0)
    assert len(fit) == n - n_val and len(val) == n_val
    assert set(fit.index.tolist()).isdisjoint(val.index.tolist())
    assert set(fit.index.tolist()) | set(val.index.tolist()) == set(data.index.tolist())
    assert torch.equal(carve_validation(data, 0.25, 0)[1].index, val.index)
    assert not torch.equal(carve_validation(data, 0.25, 1)[1].index, val.index)
    res = cli(*args, "--val-split", "0.25", "--val-data", "digits:val", "--out", out)
    assert res.code == 2 and "give validation data or a val_split, not both" in res.err
