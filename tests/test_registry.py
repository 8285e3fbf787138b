"""The registry is the one table of methods: every other list is derived from its entries, and a
method added as one entry (the toy below, whose module is this file) reaches ``bayescli.methods()``,
``fit-vi`` (its choices, ``--set`` and ``--help``), ``select`` and the Python API."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import typer

import bayescli
from bayescli.cli.app import app
from bayescli.cli.train import train_methods
from bayescli.data import load_data
from bayescli.errors import require
from bayescli.fitting.fit_source import FitSource
from bayescli.fitting.registry import (
    REGISTRY,
    MethodEntry,
    MethodKind,
    methods,
    select_defaults,
    sharding,
    trainable,
)
from bayescli.fitting.select import SelectOptions
from bayescli.models.features import extract_features
from bayescli.models.specs import load_classifier
from bayescli.options import Subset
from bayescli.posterior.base import Posterior, load_posterior
from bayescli.posterior.gaussian import LogitGaussian

# -- the toy method: MAP logits with a constant variance c -----------------------------------------


@dataclass
class ToySettings:
    """``c``: the variance of every logit."""

    c: float = 2.0

    def __post_init__(self) -> None:
        require(self.c >= 0, f"c must be >= 0, got {self.c}")


@dataclass
class ToyPosterior(Posterior):
    """The MAP head ``W [K, D]``, ``b [K]`` with logit Gaussian ``N(Wφ + b, c·I)``."""

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


def fit(source: FitSource, settings: ToySettings) -> ToyPosterior:
    head = source.classifier.head
    # on the head's device, as every method's posterior (a GPU run would mix devices otherwise)
    return ToyPosterior(head.weight.detach().clone(), head.bias.detach().clone(), settings.c)


TOY = MethodEntry(
    "toy",
    "MAP logits with a constant variance c (a test double)",
    f"{__name__}:ToySettings",
    f"{__name__}:fit",
    f"{__name__}:ToyPosterior",
    "toy",
    kind=MethodKind.VI,
    select_default=True,
)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(REGISTRY, "toy", TOY)


def probit_oracle(logits: torch.Tensor, c: float) -> torch.Tensor:
    """The probit predictive of ``N(logits, c·I)``: ``softmax(logits / √(1 + πc/8))`` ``[N, K]``."""
    return (logits.double() / math.sqrt(1 + math.pi * c / 8)).softmax(-1)


# -- derived lists ---------------------------------------------------------------------------------


def test_every_list_of_methods_is_the_registry_s():
    """The lists that were written out by hand before the registry held the capabilities."""
    vi = ["mnvi", "fsvi", "dirichlet-fvi", "glm-vi", "ggp-vi", "bbb"]
    assert methods("vi") == vi and methods(MethodKind.VI) == vi
    assert methods("laplace") == ["laplace", "laplace-diag", "laplace-kron", "laplace-full"]
    assert methods("calibration") == ["temperature"]
    assert sorted(methods()) == sorted(methods("laplace") + vi + ["temperature"])
    assert train_methods() == ["map", *vi] and trainable() == vi
    assert train_methods("bernoulli") == ["map", "mnvi"] and train_methods("categorical") == ["map", *vi]
    assert select_defaults() == ["laplace-diag", "laplace-kron", "mnvi", "fsvi", "dirichlet-fvi", "glm-vi",
                                 "temperature"]  # fmt: skip
    assert SelectOptions().methods == select_defaults()
    assert sharding() == methods("laplace")


def test_cli_choices_and_help_are_the_registry_s(cli):
    res = cli("train", "--method", "nope", "--out", "x.safetensors")
    assert res.code == 2 and "choose one of map, mnvi, fsvi, dirichlet-fvi, glm-vi, ggp-vi, bbb" in res.err
    res = cli("fit-vi", "--method", "laplace", "--data", "d", "--model", "m", "--out", "x.safetensors")
    assert res.code == 2 and "choose one of mnvi, fsvi, dirichlet-fvi, glm-vi, ggp-vi, bbb" in res.err
    select = typer.main.get_command(app).commands["select"]
    methods_help = next(p.help for p in select.params if p.name == "methods")
    assert f"(default: {','.join(select_defaults())})" in methods_help


def test_fit_vi_help_lists_each_method_s_settings_and_hides_the_old_options(cli):
    res = cli("fit-vi", "--help")
    assert res.code == 0, res.err
    text = res.out
    for name in methods("vi"):
        assert f"Settings of --method {name}" in text
    mnvi = text[text.index("Settings of --method mnvi") : text.index("Settings of --method fsvi")]
    rows = {line.strip("│ ").split()[0]: line for line in mnvi.splitlines()[1:] if line.strip("│ ╰─")}
    assert (
        "kl_weight" in rows
        and "float or None" in rows["kl_weight"]
        and "[default: None]" in rows["kl_weight"]
    )
    assert "samples" in rows and "int" in rows["samples"] and "[default: 16]" in rows["samples"]
    assert "select_by" in rows and "nll|ece|brier" in rows["select_by"]
    for flag in ("--kl-weight", "--tau", "--family", "--train-batch-size", "--inducing-points"):
        assert flag not in text


# -- a method added as one entry --------------------------------------------------------------------


def test_a_toy_method_is_one_entry_away_from_methods_and_fit_vi(toy, cli, digits_ckpt, tmp_path):
    assert "toy" in bayescli.methods() and "toy" in methods("vi") and "toy" in select_defaults()
    assert bayescli.settings("toy", c=0.5) == ToySettings(0.5)
    fit_vi = typer.main.get_command(app).commands["fit-vi"]  # as a run builds it
    assert "bbb, toy" in next(p.help for p in fit_vi.params if p.name == "method")
    res = cli("fit-vi", "--help")
    assert res.code == 0 and "Settings of --method toy" in res.out
    toy_panel = res.out[res.out.index("Settings of --method toy") :]
    assert "float" in toy_panel and "[default: 2.0]" in toy_panel

    out = tmp_path / "toy.safetensors"
    common = (
        "--model",
        "builtin:small-cnn",
        "--checkpoint",
        digits_ckpt,
        "--data",
        "digits:train",
        "--limit",
        50,
    )
    res = cli("fit-vi", "--method", "toy", *common, "--set", "c=3", "--out", out, "--quiet")
    assert res.code == 0, res.err
    post = load_posterior(out)
    assert isinstance(post, ToyPosterior) and post.c == 3.0
    # the command's own options apply where the settings have them: an explicit one must apply
    res = cli("fit-vi", "--method", "toy", *common, "--subset", "all", "--out", tmp_path / "x.safetensors")
    assert res.code == 2 and "does not apply to --method toy" in res.err


def test_a_toy_method_reaches_the_api_and_select(toy, cli, digits_ckpt, tmp_path):
    model = load_classifier("builtin:small-cnn", digits_ckpt)
    test = load_data("digits:test", limit=40, seed=0)
    logits = extract_features(model, test).logits

    post = bayescli.fit("builtin:small-cnn", "digits:train", "toy", checkpoint=digits_ckpt, c=1.5)
    assert isinstance(post, ToyPosterior) and post.c == 1.5
    probs = post.predict(test).probs
    # float32 features and logits against the closed form in float64: a few float32 ulps
    torch.testing.assert_close(probs.double().cpu(), probit_oracle(logits.cpu(), 1.5), rtol=0, atol=1e-5)

    res = cli("select", "--methods", "toy,temperature", "--model", "builtin:small-cnn", "--checkpoint",
              digits_ckpt, "--data", "digits:train", "--limit", 200, "--val-data", "digits:val",
              "--out-dir", tmp_path, "--json")  # fmt: skip
    assert res.code == 0, res.err
    board = json.loads((tmp_path / "leaderboard.json").read_text())
    assert list(board["methods"]) == ["toy", "temperature"]
    val = load_data("digits:val")
    oracle = probit_oracle(extract_features(model, val).logits, 2.0)  # the toy's default c
    nll = -oracle[torch.arange(len(val)), val.y].log().mean().item()
    # the leaderboard scores float32 logits' predictive; the oracle is float64 of the same logits
    assert board["methods"]["toy"]["nll"] == pytest.approx(nll, rel=1e-5)
    assert isinstance(load_posterior(tmp_path / "toy.safetensors"), ToyPosterior)


def test_sharding_is_the_entry_s_capability_narrowed_by_its_settings(digits_ckpt, monkeypatch):
    """Under torchrun only entries that shard are fitted (their settings may still refuse); the
    check runs before any fitting, so a 2-process world is faked here."""
    from bayescli import parallel
    from bayescli.errors import BayescliError
    from bayescli.fitting.pipeline import ModelOptions, fit_from_specs

    monkeypatch.setattr(parallel, "world", lambda: parallel.World(0, 2, 0))
    model = ModelOptions("builtin:small-cnn", digits_ckpt)
    with pytest.raises(BayescliError, match="only laplace, laplace-diag, laplace-kron, laplace-full fits"):
        fit_from_specs("temperature", model, "digits:train[:20]")
    with pytest.raises(BayescliError, match="only last-layer Laplace fits without refine_steps are sharded"):
        fit_from_specs("laplace-diag", model, "digits:train[:20]", settings=bayescli.settings("laplace-diag",
                       refine_steps=2))  # fmt: skip
    bayescli.settings("laplace-diag").check_shardable()  # last-layer, no refinement: shards
