"""``bayescli fit-vi`` / ``train --method`` end to end, and VI posteriors in predict and evaluate."""

from __future__ import annotations

import json

import pytest
import torch

from bayescli.errors import BayescliError
from bayescli.fitting.registry import create_settings, parse_setting
from bayescli.io import load_tensors
from bayescli.posterior.base import load_posterior

FITS = {
    "mnvi": ["--set", "epochs=2"],
    "fsvi": ["--set", "epochs=1", "--set", "context_points=8"],
    "dirichlet-fvi": ["--set", "epochs=2", "--set", "members=3"],
}


@pytest.fixture(scope="module")
def vi_posteriors(digits_ckpt, tmp_path_factory):
    from bayescli.cli.app import main

    out = tmp_path_factory.mktemp("vi")
    paths = {}
    for method, extra in FITS.items():
        path = out / f"{method}.safetensors"
        args = ["fit-vi", "--method", method, "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt,
                "--data", "digits:train", "--limit", "300", "--out", path, "--quiet", *extra]  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in args])
        assert exc.value.code == 0
        paths[method] = path
    return paths


def test_fit_vi_writes_posteriors_of_each_method(vi_posteriors, digits_ckpt):
    for method, path in vi_posteriors.items():
        post = load_posterior(path)
        assert post.method == method and post.subset.value == "last-layer"
        # Provenance from the CLI: the model is re-created from the file alone (hash-checked).
        assert post.load_model().classifier.num_classes == 10
        assert post.meta["data"]["spec"] == "digits:train"


def test_vi_posteriors_in_evaluate_with_laplace(vi_posteriors, digits_posterior, tmp_path, cli):
    out = tmp_path / "r.json"
    posts = [a for p in [digits_posterior, *vi_posteriors.values()] for a in ("--posterior", p)]
    res = cli("evaluate", *posts, "--data", "digits:test", "--limit", "80", "--methods", "map,glm-probit",
              "--ood", "noise:uniform", "--out", out)  # fmt: skip
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    ind = report["results"]["in_distribution"]
    expected = {"map", *(f"{tag}/glm-probit" for tag in ("post", "mnvi", "fsvi", "dirichlet-fvi"))}
    assert expected <= set(ind)
    assert {p["method"] for p in report["posteriors"].values()} == {"laplace", *FITS}
    for name, row in ind.items():
        assert 0.0 <= row["accuracy"] <= 1.0 and row["nll"] > 0, name


def test_bridge_link_returns_the_native_dirichlet(vi_posteriors, tmp_path, cli):
    """Dirichlet fVI's logit Gaussian is the bridge image of its own α: predict --bridge gives α back."""
    from bayescli.data import load_data
    from bayescli.models.features import extract_features

    path = vi_posteriors["dirichlet-fvi"]
    res = cli("predict", "--posterior", path, "--data", "digits:test", "--limit", "25", "--bridge",
              "--out", tmp_path / "d.safetensors")  # fmt: skip
    assert res.code == 0, res.err
    alpha = load_tensors(tmp_path / "d.safetensors")[0]["alpha"].double()
    post = load_posterior(path)
    feats = extract_features(post.load_model(), load_data("digits:test", limit=25, seed=0))
    native = post.alpha_features(feats.phi).double()
    # float32 features through the same computation: equal to float32 rounding of α.
    assert torch.allclose(alpha, native, rtol=1e-5)


def test_fit_vi_rejects_options_of_other_methods(digits_ckpt, tmp_path, cli):
    res = cli("fit-vi", "--method", "mnvi", "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt,
              "--data", "digits:train", "--tau", "0.5", "--out", tmp_path / "x.safetensors")  # fmt: skip
    assert res.code == 2 and "does not apply to --method mnvi" in res.err
    assert not (tmp_path / "x.safetensors").exists()


# Each per-method option of earlier releases: (option, a method with the setting, a value, the
# setting it fills, that value as the setting's type).
DEPRECATED = [
    ("--variant", "mnvi", "mean-and-noise", "variant", "mean-and-noise"),
    ("--family", "dirichlet-fvi", "mfvi", "family", "mfvi"),
    ("--members", "dirichlet-fvi", "4", "members", 4),
    ("--kl-weight", "mnvi", "2e-7", "kl_weight", 2e-7),
    ("--prior-var", "mnvi", "0.01", "prior_var", 0.01),
    ("--prior-scale", "fsvi", "3", "prior_scale", 3.0),
    ("--tau", "dirichlet-fvi", "0.5", "tau", 0.5),
    ("--beta", "dirichlet-fvi", "2", "beta", 2.0),
    ("--rho0", "mnvi", "-4", "rho0", -4.0),
    ("--samples", "mnvi", "8", "samples", 8),
    ("--context", "fsvi", "augment", "context", "augment"),
    ("--context-points", "fsvi", "16", "context_points", 16),
    ("--index-data", "dirichlet-fvi", "digits:val", "index_data", "digits:val"),
    ("--dropout", "dirichlet-fvi", "0.3", "dropout", 0.3),
    ("--epochs", "mnvi", "3", "epochs", 3),
    ("--lr", "mnvi", "0.05", "lr", 0.05),
    ("--train-batch-size", "mnvi", "32", "batch_size", 32),
    ("--covariance", "glm-vi", "full", "covariance", "full"),
    ("--prior-precision", "glm-vi", "2.5", "prior_precision", 2.5),
    ("--inducing-points", "ggp-vi", "64", "inducing_points", 64),
]


@pytest.mark.parametrize(("option", "method", "text", "setting", "value"), DEPRECATED)
def test_deprecated_options_are_set_aliases_that_warn(option, method, text, setting, value, cli, monkeypatch):
    """Each old option gives the settings ``--set`` gives (and its value, typed), and warns once,
    naming the ``--set`` spelling; the fit itself is stubbed out (the settings are the point)."""
    seen = []

    def capture(method, model, data, *, settings, **kw):
        seen.append(settings)
        raise BayescliError("stubbed fit")

    monkeypatch.setattr("bayescli.fitting.pipeline.fit_from_specs", capture)
    args = ("fit-vi", "--method", method, "--model", "builtin:small-cnn", "--data", "digits:train",
            "--out", "x.safetensors")  # fmt: skip
    old = cli(*args, f"{option}={text}")
    new = cli(*args, "--set", f"{setting}={text}")
    assert old.code == new.code == 2 and "stubbed fit" in old.err and "stubbed fit" in new.err
    assert len(seen) == 2 and seen[0] == seen[1], (seen, old.err)
    assert getattr(seen[0], setting) == value and type(getattr(seen[0], setting)) is type(value)
    assert seen[0] != create_settings(method)  # the option took effect
    warned = [line for line in old.err.splitlines() if "deprecated" in line]
    assert len(warned) == 1 and f"{option} is deprecated" in warned[0], old.err
    assert f"use --set {setting}=" in warned[0]
    assert "deprecated" not in new.err


def test_set_values_take_the_declared_field_types():
    given = {"kl_weight": "2e-7", "samples": "4", "variant": "mean-and-noise"}
    got = {k: parse_setting("mnvi", k, v) for k, v in given.items()}
    assert got == {"kl_weight": 2e-7, "samples": 4, "variant": "mean-and-noise"}
    assert type(got["kl_weight"]) is float and type(got["samples"]) is int
    got = {k: parse_setting("dirichlet-fvi", k, v) for k, v in {"select": "true", "tau": "none"}.items()}
    assert got == {"select": True, "tau": None}
    assert parse_setting("laplace", "prior_precision", "3") == 3.0
    assert parse_setting("laplace", "hessian", "diag").value == "diag"
    with pytest.raises(BayescliError, match="setting samples cannot be 'many' \\(it takes int"):
        parse_setting("mnvi", "samples", "many")
    with pytest.raises(BayescliError, match="mnvi has no setting 'nope'; its settings: .*kl_weight"):
        parse_setting("mnvi", "nope", "1")


def test_train_method_writes_checkpoint_and_posterior(tmp_path, cli):
    out = tmp_path / "m.safetensors"
    res = cli("train", "--method", "mnvi", "--data", "digits:train", "--limit", "200", "--epochs", "1",
              "--out", out, "--set", "kl_weight=2e-7", "--quiet")  # fmt: skip
    assert res.code == 0, res.err
    post = load_posterior(tmp_path / "m-mnvi.safetensors")
    assert post.method == "mnvi" and post.subset.value == "all"
    assert post.meta["checkpoint_sha256"] == post.load_model().sha256
    res = cli("predict", "--posterior", tmp_path / "m-mnvi.safetensors", "--data", "digits:test",
              "--limit", "20", "--out", tmp_path / "p.json")  # fmt: skip
    assert res.code == 0, res.err
