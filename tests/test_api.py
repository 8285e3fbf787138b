"""The Python API: ``bayescli.fit`` on an ``nn.Module`` + ``DataLoader`` gives the posterior the CLI
writes for the same checkpoint and data, for every registered method; load/predict/settings."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import bayescli
from bayescli.data import load_data
from bayescli.errors import BayescliError
from bayescli.fitting.registry import REGISTRY, MethodKind
from bayescli.io import load_tensors
from bayescli.models.specs import load_classifier
from bayescli.posterior.base import load_posterior

# Few rows and epochs: the point is equality of the two paths, not quality.
LIMIT = 200
QUICK = {
    "mnvi": {"epochs": 2},
    "fsvi": {"epochs": 2},
    "dirichlet-fvi": {"epochs": 2, "members": 3},
    "glm-vi": {"epochs": 2},
    "ggp-vi": {"epochs": 2, "inducing_points": 20},
    "bbb": {"epochs": 2, "subset": "all"},
}


@pytest.fixture(scope="module")
def digits_parts(digits_ckpt):
    """The checkpoint as a plain module, its input normalisation, and digits train/val as loaders."""
    loaded = load_classifier("builtin:small-cnn", digits_ckpt)
    train = load_data("digits:train", limit=LIMIT, seed=0)
    val = load_data("digits:val")
    loaders = {
        name: DataLoader(TensorDataset(*data.take(slice(None))), batch_size=64)
        for name, data in (("train", train), ("val", val))
    }
    return loaded.classifier.network, loaded.preprocess, loaders


def _setting_flags(method: str) -> list[str]:
    return [a for k, v in QUICK.get(method, {}).items() for a in ("--set", f"{k}={v}")]


@pytest.mark.parametrize("method", list(REGISTRY))
def test_fit_on_a_module_and_loader_matches_the_cli(method, digits_ckpt, digits_parts, cli, tmp_path):
    module, preprocess, loaders = digits_parts
    out = tmp_path / f"{method}.safetensors"
    entry = REGISTRY[method]
    command = {MethodKind.LAPLACE: "fit-laplace", MethodKind.VI: "fit-vi"}.get(entry.kind)
    if command is None:  # temperature has no fit command of its own: select writes its file
        args = ["select", "--methods", method, "--out-dir", tmp_path / "sel"]
        out = tmp_path / "sel" / f"{method}.safetensors"
    elif command == "fit-laplace":
        hessian = entry.defaults.get("hessian", "kron")
        args = ["fit-laplace", "--hessian", hessian, "--out", out]
    else:
        args = ["fit-vi", "--method", method, "--out", out, *_setting_flags(method)]
    common = ["--model", "builtin:small-cnn", "--checkpoint", digits_ckpt, "--data", "digits:train"]
    result = cli(*args, *common, "--limit", LIMIT, "--val-data", "digits:val", "--device", "cpu", "--quiet")
    assert result.code == 0, result.err
    from_cli = load_posterior(out)

    post = bayescli.fit(
        module, loaders["train"], method, val=loaders["val"], preprocess=preprocess, **QUICK.get(method, {})
    )
    assert type(post) is type(from_cli)
    cli_tensors, _ = load_tensors(out)
    for name, tensor in post.tensors().items():
        torch.testing.assert_close(tensor.cpu(), cli_tensors[name], rtol=1e-6, atol=1e-6, msg=name)
    assert set(post.tensors()) == set(cli_tensors)
    chosen = post.metadata()["selection"].get("chosen")
    assert chosen == pytest.approx(from_cli.metadata()["selection"].get("chosen"), rel=1e-6)
    assert post.metadata()["selection"]["validated"] is True


def test_methods_and_settings():
    names = bayescli.methods()
    assert {
        "laplace",
        "laplace-diag",
        "laplace-kron",
        "mnvi",
        "fsvi",
        "dirichlet-fvi",
        "glm-vi",
        "temperature",
    } <= set(names)
    diag = bayescli.settings("laplace-diag")
    assert dataclasses.is_dataclass(diag) and diag.hessian.value == "diag"
    assert bayescli.settings("laplace").hessian.value == "kron"
    assert bayescli.settings("laplace", prior_precision="auto").prior_precision.value == "auto"
    with pytest.raises(BayescliError, match="unknown method 'lapalce'; the methods are laplace"):
        bayescli.settings("lapalce")
    with pytest.raises(BayescliError, match="laplace has no setting hesian; its settings: .*hessian"):
        bayescli.settings("laplace", hesian="diag")
    with pytest.raises(BayescliError, match="prior_precision must be a positive number"):
        bayescli.settings("laplace", prior_precision="large")


def test_predict_save_and_load_a_module_only_in_memory(digits_parts, tmp_path):
    module, preprocess, loaders = digits_parts
    post = bayescli.fit(module, loaders["train"], "laplace", preprocess=preprocess, prior_precision=5.0)
    assert post.metadata()["selection"] == {
        "method": "fixed",
        "validated": False,
        "setting": "prior_precision",
        "chosen": 5.0,
        "rule": "given",
    }
    assert post.metadata()["validated"] is False
    pred = post.predict(loaders["val"])
    n = len(loaders["val"].dataset)
    assert pred.probs.shape == (n, 10) and pred.logit_var.shape == (n, 10)
    assert torch.allclose(pred.probs.sum(-1), torch.ones(n, dtype=pred.probs.dtype), atol=1e-5)
    assert bool((pred.logit_var > 0).all())

    path = tmp_path / "mem.safetensors"
    post.save(path)
    with pytest.raises(BayescliError, match="only in memory; pass it: bayescli.load"):
        bayescli.load(path).predict(loaders["val"])
    again = bayescli.load(path, model=module)
    torch.testing.assert_close(again.predict(loaders["val"]).probs, pred.probs)

    other = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    with pytest.raises(BayescliError, match="with other layers than this Sequential"):
        bayescli.load(path, model=other)
    changed = _perturbed(module)
    with pytest.raises(BayescliError, match="weights differ from those"):
        bayescli.load(path, model=changed)


def _perturbed(module: torch.nn.Module) -> torch.nn.Module:
    import copy

    out = copy.deepcopy(module)
    with torch.no_grad():
        next(out.parameters()).add_(1e-3)
    return out


def test_data_in_every_form_gives_the_same_prediction(digits_parts):
    module, preprocess, loaders = digits_parts
    post = bayescli.fit(module, loaders["train"], "laplace-diag", preprocess=preprocess, prior_precision=3.0)
    x, y = loaders["val"].dataset.tensors
    reference = post.predict((x, y)).probs
    batches = [(x[i : i + 50], y[i : i + 50]) for i in range(0, len(x), 50)]
    torch.testing.assert_close(post.predict(batches).probs, reference)
    torch.testing.assert_close(post.predict(x).probs, reference)
    with pytest.raises(BayescliError, match="must be a DataLoader, an iterable of"):
        post.predict(3.0)
    with pytest.raises(BayescliError, match="has no labels; fitting a posterior needs labelled data"):
        bayescli.fit(module, x, "laplace", preprocess=preprocess)


def test_select_on_a_module_and_loaders(digits_parts):
    module, preprocess, loaders = digits_parts
    board, posts = bayescli.select(
        module,
        loaders["train"],
        loaders["val"],
        methods=["laplace-diag", "temperature"],
        preprocess=preprocess,
    )
    assert set(posts) == {"laplace-diag", "temperature"} and board["best"] in posts
    rows = board["methods"]
    assert board["best"] == min(rows, key=lambda m: rows[m]["nll"])
    assert all(row["hyperparameters"]["validated"] for row in rows.values())
    probs = posts[board["best"]].predict(loaders["val"]).probs
    assert probs.shape == (len(loaders["val"].dataset), 10)


def test_evaluate_returns_the_report_the_cli_writes(digits_posterior, cli, tmp_path):
    import json

    # both on the CPU: the reports are compared to the last bit
    args = ["--methods", "map,glm-probit", "--ood-scores", "msp", "--device", "cpu"]
    res = cli(
        "evaluate", "--posterior", digits_posterior, "--data", "digits:test", *args, "--json", "--quiet"
    )
    assert res.code == 0, res.err
    from_cli = json.loads(res.out)["results"]
    post = bayescli.load(digits_posterior)
    report = bayescli.evaluate(post, "digits:test", methods="map,glm-probit", ood_scores="msp", device="cpu")
    assert report["results"]["in_distribution"] == from_cli["in_distribution"]
