"""The posterior interface: file dispatch on ``method``, and several posteriors in one evaluate."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import jsonschema
import pytest
import torch

from bayescli.errors import BayescliError
from bayescli.fitting.registry import REGISTRY, MethodEntry, MethodKind
from bayescli.io import load_tensors, save_tensors
from bayescli.options import Subset
from bayescli.posterior.base import Posterior, load_posterior
from bayescli.posterior.gaussian import LogitGaussian
from bayescli.posterior.laplace import LaplacePosterior

SCHEMA = Path(__file__).parents[1] / "bayescli" / "schemas" / "report.schema.json"


@dataclass
class ToyPosterior(Posterior):
    """MAP head with a constant logit variance ``c``: ``N(Wφ̃, c·I)`` (a registry test double)."""

    weight: torch.Tensor
    bias: torch.Tensor
    c: float
    subset: Subset = Subset.LAST_LAYER
    meta: dict = field(default_factory=dict)

    method: ClassVar[str] = "toy"

    def logit_gaussian(self, phi: torch.Tensor) -> LogitGaussian:
        mean = phi.double() @ self.weight.double().T + self.bias.double()
        return LogitGaussian(mean, torch.full_like(mean, self.c))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "bias": self.bias}

    def own_metadata(self) -> dict:
        return {"c": self.c}

    @classmethod
    def from_file(cls, tensors: dict, meta: dict, path: Path) -> ToyPosterior:
        return cls(tensors["weight"], tensors["bias"], float(meta["c"]), meta=cls.provenance(meta, {"c"}))


@pytest.fixture
def toy_registered(monkeypatch):
    entry = MethodEntry(
        "toy", "a toy", "", "", f"{__name__}:ToyPosterior", "toy", kind=MethodKind.CALIBRATION
    )
    monkeypatch.setitem(REGISTRY, "toy", entry)


def _toy_from(laplace_path: Path, out: Path, c: float) -> Path:
    """A toy posterior of the same checkpoint as the Laplace file (its head and provenance)."""
    post = LaplacePosterior.load(laplace_path)
    w = post.gaussian.mean
    toy = ToyPosterior(w[:, :-1].contiguous().float(), w[:, -1].contiguous().float(), c, meta=dict(post.meta))
    toy.save(out)
    return out


def test_load_posterior_dispatches_on_method(digits_posterior, toy_registered, tmp_path):
    assert isinstance(load_posterior(digits_posterior), LaplacePosterior)
    toy_path = _toy_from(digits_posterior, tmp_path / "toy.safetensors", 2.0)
    toy = load_posterior(toy_path)
    assert isinstance(toy, ToyPosterior) and toy.c == 2.0
    # Provenance survives the round trip, so the model can be re-created from the file alone.
    assert toy.meta["checkpoint_sha256"] == LaplacePosterior.load(digits_posterior).meta["checkpoint_sha256"]
    assert toy.load_model().classifier.num_classes == 10
    with pytest.raises(BayescliError, match="holds a toy posterior, not laplace"):
        LaplacePosterior.load(toy_path)


def test_unknown_or_malformed_method_is_a_clear_error(digits_posterior, tmp_path, cli):
    tensors, meta = load_tensors(digits_posterior)
    save_tensors(tmp_path / "odd.safetensors", tensors, {**meta, "method": "nope"})
    with pytest.raises(BayescliError, match="unknown posterior method 'nope'"):
        load_posterior(tmp_path / "odd.safetensors")
    res = cli("predict", "--posterior", tmp_path / "odd.safetensors", "--data", "digits:test")
    assert res.code == 2 and res.err.count("\n") == 1 and "unknown posterior method" in res.err
    del tensors["kron_G"]
    save_tensors(tmp_path / "broken.safetensors", tensors, meta)
    with pytest.raises(BayescliError, match="malformed"):
        load_posterior(tmp_path / "broken.safetensors")


def test_predict_accepts_any_registered_posterior(digits_posterior, toy_registered, tmp_path, cli):
    """A method plugged in through the registry works in predict with no change elsewhere, and its
    probit link is softmax(μ/√(1+πc/8)) of the MAP logits (an independent closed form)."""
    toy_path = _toy_from(digits_posterior, tmp_path / "toy.safetensors", 3.0)
    res = cli("predict", "--posterior", toy_path, "--data", "digits:test", "--limit", "30",
              "--link", "probit", "--out", tmp_path / "p.safetensors")  # fmt: skip
    assert res.code == 0, res.err
    probs = load_tensors(tmp_path / "p.safetensors")[0]["probs"].double()
    post = LaplacePosterior.load(digits_posterior)
    model = post.load_model()
    from bayescli.data import load_data
    from bayescli.models.features import extract_features

    feats = extract_features(model, load_data("digits:test", limit=30, seed=0))
    expected = (feats.logits.double() / (1 + torch.pi * 3.0 / 8) ** 0.5).softmax(-1)
    # float32 features and logits: agreement to a few float32 ulps of probabilities ≤ 1.
    assert torch.allclose(probs, expected, atol=1e-5)


def test_evaluate_compares_several_posteriors_on_one_pass(digits_posterior, toy_registered, tmp_path, cli):
    toy_path = _toy_from(digits_posterior, tmp_path / "toy.safetensors", 3.0)
    out = tmp_path / "report.json"
    res = cli("evaluate", "--posterior", digits_posterior, "--posterior", toy_path, "--data", "digits:test",
              "--limit", "60", "--methods", "map,glm-probit", "--ood", "noise:uniform", "--out", out,
              "--fail-if", "ood.noise:uniform.toy/glm-probit.max_prob.auroc < 0.0")  # fmt: skip
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    ind = report["results"]["in_distribution"]
    assert set(ind) == {"map", "post/glm-probit", "toy/glm-probit"}
    assert report["protocol"]["methods"] == ["map", "post/glm-probit", "toy/glm-probit"]
    toy = dict(report["posteriors"]["toy"])
    # each posterior's own preprocessing is recorded (the toy copies the Laplace file's header)
    assert toy.pop("preprocess") == report["posteriors"]["post"]["preprocess"]
    assert toy == {"method": "toy", "subset": "last-layer", "c": 3.0,
                   "fit_data": report["posteriors"]["post"]["fit_data"]}  # fmt: skip
    assert report["posteriors"]["post"]["method"] == "laplace"
    # One backbone pass per input set, shared by both posteriors: test + OOD inputs.
    assert report["timings"]["forward_inputs"] == 120
    # The toy's probit differs from Laplace's (different variances) but both keep MAP's argmax
    # on most inputs; a mix-up of posteriors would make the two rows equal.
    assert ind["toy/glm-probit"]["nll"] != ind["post/glm-probit"]["nll"]


def test_evaluate_refuses_posteriors_of_different_checkpoints(digits_posterior, tmp_path, cli):
    tensors, meta = load_tensors(digits_posterior)
    save_tensors(tmp_path / "other.safetensors", tensors, {**meta, "checkpoint_sha256": "0" * 64})
    res = cli("evaluate", "--posterior", digits_posterior, "--posterior", tmp_path / "other.safetensors",
              "--data", "digits:test", "--limit", "20", "--out", tmp_path / "r.json")  # fmt: skip
    assert res.code == 2 and "different model" in res.err and res.err.count("\n") == 1
    assert not (tmp_path / "r.json").exists()


def test_ggp_methods_need_a_laplace_posterior(digits_posterior, toy_registered, tmp_path, cli):
    toy_path = _toy_from(digits_posterior, tmp_path / "toy.safetensors", 1.0)
    res = cli("evaluate", "--posterior", toy_path, "--data", "digits:test", "--limit", "20",
              "--methods", "ggp-probit")  # fmt: skip
    assert res.code == 2 and "needs a Laplace posterior" in res.err
