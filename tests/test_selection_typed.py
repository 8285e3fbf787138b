"""``post.selection``: one typed record of how a method's key setting was set (issue 34, part 1).

Every fit sets it; only the posterior's serialisation writes it (the file's ``selection``,
``validated`` and ``prior`` entries, as before) and loading reads it back. ``select`` tunes each
method by its own ranking criterion and seed; Laplace scores its δ candidates without touching
the posterior it returns.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from conftest import random_head
from tolerance import assert_close

from bayescli.data import load_data
from bayescli.fitting.fit_source import FitSource
from bayescli.fitting.laplace import LaplaceSettings
from bayescli.fitting.laplace import fit as fit_laplace_method
from bayescli.fitting.pipeline import fit_posterior
from bayescli.fitting.select import SelectOptions, select
from bayescli.io import load_tensors, save_tensors
from bayescli.models.specs import load_classifier
from bayescli.options import Criterion
from bayescli.posterior import LaplacePosterior
from bayescli.posterior.base import load_posterior
from bayescli.posterior.gaussian import DiagGaussian, augment
from bayescli.posterior.selection import Selection, unvalidated

COMMON = ["--model", "builtin:small-cnn", "--data", "digits:train", "--device", "cpu"]


@pytest.fixture(scope="module")
def source(digits_ckpt) -> FitSource:
    model = load_classifier("builtin:small-cnn", digits_ckpt)
    return FitSource(model, load_data("digits:train"), load_data("digits:val"))


def _argmin(curve: list[dict], setting: str, key: str) -> float:
    return min(curve, key=lambda row: row[key])[setting]


# -- select tunes by its criterion and seed -----------------------------------------------------


def test_select_by_ece_tunes_laplace_by_ece_and_says_so(source):
    nll_board, nll_posts = select(source, None, SelectOptions(["laplace-diag"], "nll"))
    ece_board, ece_posts = select(source, None, SelectOptions(["laplace-diag"], "ece"))
    by_nll, by_ece = nll_posts["laplace-diag"].selection, ece_posts["laplace-diag"].selection
    # the premise: on this net the validation NLL and ECE curves over δ have different minima
    assert by_nll.grid == by_ece.grid
    assert _argmin(by_nll.curve, "prior_precision", "nll") != _argmin(by_nll.curve, "prior_precision", "ece")
    assert by_nll.criterion is Criterion.NLL and by_ece.criterion is Criterion.ECE
    assert by_ece.chosen == _argmin(by_ece.curve, "prior_precision", "ece")
    assert by_ece.chosen != by_nll.chosen
    assert ece_posts["laplace-diag"].prior_precision == by_ece.chosen
    # the record names the criterion used, in the file's selection and prior entries alike
    meta = ece_posts["laplace-diag"].metadata()
    assert meta["selection"]["criterion"] == "ece" and meta["prior"]["method"] == "val-ece"
    assert "validation ece" in meta["prior"]["objective"]
    assert nll_posts["laplace-diag"].metadata()["prior"]["method"] == "val-nll"
    # the leaderboard says which criterion tuned each method and which one ranked them
    assert (ece_board["criterion"], ece_board["tuned_by"]) == ("ece", "ece")
    assert ece_board["methods"]["laplace-diag"]["tuned_by"] == "ece"
    assert nll_board["methods"]["laplace-diag"]["tuned_by"] == "nll"
    row = ece_board["methods"]["laplace-diag"]
    assert row["hyperparameters"]["prior_precision"] == by_ece.chosen


def test_select_keeps_a_criterion_given_for_one_method_and_tunes_auroc_runs_by_nll(source):
    from bayescli.data.shifts import synthetic_ood

    given = SelectOptions(
        ["laplace-diag", "temperature"], "ece", settings={"laplace-diag": {"select_by": "nll"}}
    )
    assert given.method_settings("laplace-diag")["select_by"] == "nll"
    assert given.method_settings("temperature") == {"select_by": Criterion.ECE}  # it has no seed
    board, posts = select(source, None, given)
    assert board["methods"]["laplace-diag"]["tuned_by"] == "nll"
    assert board["methods"]["temperature"]["tuned_by"] == "ece"
    assert posts["temperature"].selection.criterion is Criterion.ECE
    ood = {"patches": synthetic_ood("patches", source.val, len(source.val))}
    board, _ = select(source, ood, SelectOptions(["temperature"], "auroc"))
    assert (board["criterion"], board["tuned_by"], board["methods"]["temperature"]["tuned_by"]) == (
        "auroc",
        "nll",
        "nll",
    )


def test_select_passes_its_seed_to_every_method(source):
    def run(seed: int) -> tuple[dict, Selection]:
        opts = SelectOptions(["fsvi"], "nll", seed=seed, settings={"fsvi": {"epochs": 1}})
        board, posts = select(source, None, opts)
        return board, posts["fsvi"].selection

    board0, sel0 = run(0)
    again, sel_again = run(0)
    _, sel1 = run(1)
    # FSVI's validation predictive is a Monte Carlo one: its scores depend on the seed it is given
    assert sel0.curve == sel_again.curve and sel0.curve != sel1.curve
    assert _untimed(board0) == _untimed(again)


def _untimed(board: dict) -> dict:
    """The leaderboard less its wall-clock entries (and the files written)."""
    out = json.loads(json.dumps(board))
    for row in out["methods"].values():
        row.pop("fit_seconds")
        row.pop("file", None)
    return out


def test_select_cli_with_the_same_seed_gives_the_same_leaderboard(cli, digits_ckpt, tmp_path):
    boards = []
    for run in ("a", "b"):
        out = tmp_path / run
        res = cli("select", *COMMON, "--checkpoint", digits_ckpt, "--val-data", "digits:val",
                  "--methods", "laplace-diag,temperature", "--select-by", "ece", "--seed", "3",
                  "--out-dir", out)  # fmt: skip
        assert res.code == 0, res.err
        assert "tuned by" in res.out and "methods tuned by validation ece" in res.out
        for method in ("laplace-diag", "temperature"):  # its row's "tuned by" cell
            assert re.search(rf"{method}\b.*│\s*ece\s*│[^│]*│\s*$", res.out, re.MULTILINE), res.out
        boards.append(json.loads((out / "leaderboard.json").read_text()))
    assert _untimed(boards[0]) == _untimed(boards[1])
    assert boards[0]["tuned_by"] == "ece"
    assert {row["tuned_by"] for row in boards[0]["methods"].values()} == {"ece"}


# -- Laplace's δ search leaves the returned posterior alone --------------------------------------


def test_laplace_scores_candidates_without_touching_the_posterior_it_returns(source, monkeypatch):
    refreshed: list[tuple[int, float]] = []
    original = DiagGaussian._refresh

    def spy(self: DiagGaussian) -> None:
        refreshed.append((id(self), self.delta))
        original(self)

    monkeypatch.setattr(DiagGaussian, "_refresh", spy)
    post = fit_laplace_method(source, LaplaceSettings(hessian="diag"))
    own = [delta for ident, delta in refreshed if ident == id(post.gaussian)]
    sel = post.selection
    assert sel.validated and len(sel.curve) > 3
    # its own Gaussian was built at marglik's δ (fit_laplace) and set once, to the chosen δ
    assert own[-1] == sel.chosen == post.prior_precision
    assert own.count(sel.chosen) == 1 and len(own) <= 3, own
    assert len(refreshed) > len(sel.curve)  # the candidates' δ went to copies
    # the returned Gaussian is a fresh fit's at the chosen δ
    monkeypatch.setattr(DiagGaussian, "_refresh", original)
    fresh = fit_laplace_method(source, LaplaceSettings(hessian="diag", prior_precision=sel.chosen))
    # the same float64 sum h + δ and the same cast: equal up to rounding
    assert_close(post.gaussian.variance(), fresh.gaussian.variance(), rtol=1e-12, what="variances")
    assert_close(post.gaussian.mean, fresh.gaussian.mean, rtol=1e-12, atol=1e-30, what="means")


# -- save and load --------------------------------------------------------------------------------


def _laplace(delta: float = 0.7) -> LaplacePosterior:
    gen = torch.Generator().manual_seed(1)
    phi = torch.randn(120, 5, generator=gen, dtype=torch.float64)
    head = random_head(5, 3, seed=1)
    labels = (augment(phi) @ torch.cat([head.weight, head.bias[:, None]], 1).T).detach().argmax(1)
    post = LaplacePosterior.fit_last_layer(phi, labels, head, "diag")
    post.set_prior_precision(delta)
    return post


CURVE = [{"prior_precision": v, "nll": 1.0 / v, "ece": 0.1, "brier": 0.2} for v in (0.1, 1.0, 10.0)]
MAP_SCORES = {"nll": 0.3, "ece": 0.05, "brier": 0.1}


def _records() -> dict[str, Selection]:
    validated = Selection(
        "prior_precision", Criterion.ECE, [0.1, 1.0, 10.0], CURVE, 10.0, 1.0, MAP_SCORES, 1,
        "reaches the MAP limit", True, 0.8,
        prior={"method": "val-ece", "curve": [[0.1, 0.1]], "objective": "validation ece", "marglik": 1.0},
        extra={"objective": "validation ece (glm, probit)", "map_limit_gap": 1e-6},
    )  # fmt: skip
    fallback = Selection(
        "prior_precision", Criterion.NLL, [0.1, 1.0, 10.0], CURVE, 10.0, 1.0, MAP_SCORES,
        warning="no prior_precision improves on MAP", map_fallback=True,
        prior={"method": "map-fallback", "objective": "glm"}, extra={"objective": "glm"},
    )  # fmt: skip
    fixed = unvalidated("prior_precision", 0.7, "given", fixed=True)
    fixed.prior = {"method": "given"}
    default = unvalidated("prior_precision", 0.7, "Laplace marginal likelihood")
    default.prior = {"method": "laplace-marglik"}
    return {"validated": validated, "fallback": fallback, "fixed": fixed, "default": default}


@pytest.mark.parametrize("kind", ["validated", "fallback", "fixed", "default"])
def test_a_selection_survives_save_and_load(kind, tmp_path):
    post = _laplace()
    post.meta.pop("prior")  # a fit moves it into the selection
    post.selection = _records()[kind]
    post.save(tmp_path / "p.safetensors")
    _, meta = load_tensors(tmp_path / "p.safetensors")
    assert meta["selection"] == post.selection.record() and meta["validated"] is (
        kind in ("validated", "fallback")
    )
    assert meta["prior"] == {"value": 0.7, **post.selection.prior} and "prior" not in post.meta
    back = load_posterior(tmp_path / "p.safetensors")
    assert back.selection == post.selection
    assert not set(back.meta) & {"selection", "validated", "prior"}  # stored once, in the attribute
    assert back.selection.chose_map is {"validated": True, "fallback": True}.get(kind)
    assert back.metadata() == post.metadata()


def test_fits_round_trip_their_selection(source, tmp_path):
    with_val = fit_posterior("temperature", source)
    given = fit_posterior("temperature", source, temperature=2.0)
    no_val = fit_posterior("temperature", FitSource(source.model, source.data, None))
    assert [p.selection.how for p in (with_val, given, no_val)] == ["validation", "fixed", "default"]
    for i, post in enumerate((with_val, given, no_val)):
        assert "selection" not in post.meta
        post.save(tmp_path / f"{i}.safetensors")
        back = load_posterior(tmp_path / f"{i}.safetensors")
        assert back.selection == post.selection
        assert back.metadata()["validated"] is post.selection.validated


def test_a_file_written_with_the_earlier_record_format_loads(tmp_path):
    """A file as bayescli wrote it before ``post.selection``: the dicts are written by hand."""
    post = _laplace(25.9)
    header = {k: v for k, v in post.metadata().items() if k != "prior"}
    selection = {
        "method": "validation",
        "validated": True,
        "setting": "prior_precision",
        "criterion": "nll",
        "grid": [2.59, 8.19, 25.9],
        "curve": [{"prior_precision": v, "nll": 0.4, "ece": 0.02, "brier": 0.1} for v in (2.59, 8.19, 25.9)],
        "chosen": 25.9,
        "principled": 8.19,
        "map_validation": {"nll": 0.41, "ece": 0.03, "brier": 0.11},
        "extensions": 0,
        "map_point": False,
        "warning": "tau = 25.9 is the largest value searched",
        "map_limit_gap": 0.001,  # a method's own entry
    }
    prior = {
        "value": 25.9,
        "method": "val-nll",
        "curve": [[2.59, 0.4], [8.19, 0.4], [25.9, 0.4]],
        "objective": "validation nll (glm, probit)",
        "marglik": 8.19,
    }
    header |= {"selection": selection, "validated": True, "prior": prior}
    save_tensors(tmp_path / "old.safetensors", post.tensors(), header)
    back = load_posterior(tmp_path / "old.safetensors")
    sel = back.selection
    assert (sel.how, sel.validated, sel.criterion, sel.chosen, sel.principled) == (
        "validation",
        True,
        Criterion.NLL,
        25.9,
        8.19,
    )
    assert sel.curve == selection["curve"] and sel.map_scores == selection["map_validation"]
    assert sel.warning == selection["warning"] and sel.extra == {"map_limit_gap": 0.001}
    assert sel.chose_map is False and sel.label == "prior_precision = 25.9"
    assert back.prior_record == prior and back.summary()["prior_method"] == "val-nll"
    assert back.prior_precision == 25.9
    rewritten = back.metadata()
    assert {k: rewritten[k] for k in ("selection", "validated", "prior")} == {
        "selection": selection,
        "validated": True,
        "prior": prior,
    }
    # a file from before selection records: its prior entry stays as it was, and nothing is validated
    older = {k: v for k, v in header.items() if k not in ("selection", "validated")}
    save_tensors(tmp_path / "older.safetensors", post.tensors(), older)
    back = load_posterior(tmp_path / "older.safetensors")
    assert back.selection is None and back.prior_record == prior
    assert back.metadata()["prior"] == prior and "selection" not in back.metadata()


def test_setting_delta_by_hand_after_a_fit_records_it_as_given(source):
    post = fit_laplace_method(source, LaplaceSettings(hessian="diag"))
    assert post.selection.validated
    post.set_prior_precision(3.0)
    assert (post.selection.how, post.selection.chosen, post.selection.rule) == ("fixed", 3.0, "given")
    assert post.metadata()["prior"]["value"] == 3.0 and post.metadata()["prior"]["method"] == "fixed"
    assert not math.isnan(post.prior_precision)
