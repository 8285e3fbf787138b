"""``bayescli select``: every method on one feature pass, ranked on held-out data."""

from __future__ import annotations

import json

import pytest
import torch

from bayescli.fitting.fit_source import FitSource
from bayescli.fitting.select import SelectOptions, select
from bayescli.io import load_tensors
from bayescli.metrics.classification import nll
from bayescli.models.specs import load_classifier
from bayescli.posterior.base import load_posterior

COMMON = ["--model", "builtin:small-cnn", "--data", "digits:train", "--device", "cpu"]


def test_select_writes_every_posterior_the_leaderboard_and_the_best(cli, digits_ckpt, tmp_path):
    out = tmp_path / "sel"
    res = cli("select", *COMMON, "--checkpoint", digits_ckpt, "--val-data", "digits:val", "--ood", "patches",
              "--methods", "laplace-diag,temperature", "--out-dir", out, "--json")  # fmt: skip
    assert res.code == 0, res.err
    board = json.loads((out / "leaderboard.json").read_text())
    assert board == json.loads(res.out) | {"methods": board["methods"]}  # files named in the written one
    assert set(board["methods"]) == {"laplace-diag", "temperature"}
    assert board["criterion"] == "nll" and board["used_ood_for_choice"] is False
    rows = board["methods"]
    assert board["best"] == min(rows, key=lambda m: rows[m]["nll"])
    best = load_tensors(out / "best.safetensors")[1]
    assert best["method"] == load_tensors(out / f"{board['best']}.safetensors")[1]["method"]
    for row in rows.values():
        post = load_posterior(out / row["file"])
        assert post.selection.validated is True and row["hyperparameters"]["validated"] is True
        assert set(row["auroc"]) == {"patches"} and 0.5 < row["auroc"]["patches"] <= 1.0
    # the rows are the posteriors' validation scores: temperature's NLL from its T directly
    model = load_classifier("builtin:small-cnn", digits_ckpt)
    val = FitSource(model, *(_digits("train"), _digits("val"))).val_features()
    temperature = load_posterior(out / "temperature.safetensors").temperature
    expected = nll((val.logits.double() / temperature).softmax(-1), val.labels)
    assert rows["temperature"]["nll"] == pytest.approx(expected, rel=1e-6)
    assert board["map"]["nll"] == pytest.approx(nll(val.logits.double().softmax(-1), val.labels), rel=1e-6)


def _digits(split: str):
    from bayescli.data import load_data

    return load_data(f"digits:{split}")


def test_select_by_auroc_says_it_used_the_ood_data(digits_ckpt):
    model = load_classifier("builtin:small-cnn", digits_ckpt)
    from bayescli.data.shifts import synthetic_ood

    val = _digits("val")
    source = FitSource(model, _digits("train"), val)
    ood = {"patches": synthetic_ood("patches", val, len(val))}
    board, posts = select(source, ood, SelectOptions(["laplace-diag", "temperature"], "auroc"))
    assert board["used_ood_for_choice"] is True
    rows = board["methods"]
    assert board["best"] == max(rows, key=lambda m: rows[m]["mean_auroc"])
    assert set(posts) == {"laplace-diag", "temperature"}
    # one backbone pass per set: the fitting, validation and OOD features are memoised
    assert source.has_features() and source.has_features(val) and source.has_features(ood["patches"])


def test_select_needs_held_out_data_and_known_methods(cli, digits_ckpt, tmp_path):
    args = ["select", *COMMON, "--checkpoint", digits_ckpt, "--out-dir", tmp_path / "s"]
    res = cli(*args)
    assert res.code == 2 and "pass --val-data SPEC or --val-split FRACTION" in res.err
    res = cli(*args, "--val-data", "digits:val", "--methods", "laplace,lapalce")
    assert res.code == 2 and "unknown method 'lapalce'; the methods are laplace" in res.err
    res = cli(*args, "--val-data", "digits:val", "--select-by", "auroc")
    assert res.code == 2 and "criterion 'auroc' needs OOD data" in res.err
    assert not (tmp_path / "s").exists()


def test_temperature_posterior_is_softmax_of_scaled_logits(digits_ckpt):
    model = load_classifier("builtin:small-cnn", digits_ckpt)
    import bayescli

    post = bayescli.fit(model, _digits("train"), "temperature", val=_digits("val"))
    feats = FitSource(model, _digits("test")).features()
    lg = post.logit_gaussian(feats.phi)
    torch.testing.assert_close(lg.mean, feats.logits / post.temperature, rtol=1e-5, atol=1e-5)
    assert bool((lg.var == 0).all())
    sel = post.metadata()["selection"]
    assert (
        sel["validated"]
        and sel["curve"]
        and sel["map_validation"]["nll"] >= min(r["nll"] for r in sel["curve"])
    )
