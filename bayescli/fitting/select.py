"""``bayescli select``: which posterior should I use for this model?

One :class:`~bayescli.fitting.fit_source.FitSource` holds the fitting, validation and OOD sets; each set's
backbone features are computed once and shared by every method. Each method is fitted with its
defaults, so its key hyperparameter is chosen on the validation set (:mod:`bayescli.posterior.selection`)
by the same ``criterion`` the methods are ranked by (NLL when ranking by AUROC, which no method tunes
by) and with the run's ``seed``, unless a method's own settings say otherwise; every posterior, and
MAP beside them, is then scored on that same validation set (accuracy, NLL, ECE, Brier, and AUROC of
its max-probability score against each OOD set). The best by ``criterion`` is the recommendation.
Choosing by AUROC uses the OOD sets, as OpenOOD's protocol does, and the leaderboard says so; each
row says which criterion tuned the method (``tuned_by``), the board which one ranked them
(``criterion``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bayescli._version import __version__
from bayescli.data import Data
from bayescli.errors import BayescliError, require
from bayescli.fitting.fit_source import FitSource
from bayescli.fitting.pipeline import DataOptions, fit_posterior
from bayescli.fitting.registry import method_entry, select_defaults, setting_fields
from bayescli.io import write_json
from bayescli.metrics.classification import (
    accuracy,
    brier,
    ece,
    log_probabilities,
    map_log_probabilities,
    max_prob_logit,
    nll,
    ood_metrics,
)
from bayescli.options import Criterion, Predictive
from bayescli.posterior.base import Posterior
from bayescli.predictive.glm import predict
from bayescli.progress import stage

CRITERIA = ("nll", "ece", "brier", "auroc")
LOWER_IS_BETTER = {"nll": True, "ece": True, "brier": True, "auroc": False}


@dataclass
class SelectOptions:
    """What ``select`` compares (default: the registry's ``select_default`` methods) and how it
    ranks them."""

    methods: Sequence[str] = field(default_factory=select_defaults)
    criterion: str = "nll"
    samples: int = 100
    seed: int = 0
    settings: dict[str, dict] = field(default_factory=dict)  # method → setting values

    def __post_init__(self) -> None:
        require(
            self.criterion in CRITERIA,
            f"criterion must be one of {', '.join(CRITERIA)}, got '{self.criterion}'",
        )
        require(bool(self.methods), "select needs at least one method")
        for name in self.methods:
            method_entry(name)  # an unknown name is an error listing the known ones

    @property
    def tune_by(self) -> Criterion:
        """The validation criterion every method tunes its key setting by: the ranking criterion,
        or NLL when ranking by AUROC (a score of OOD data, which no method tunes by)."""
        return Criterion.NLL if self.criterion == "auroc" else Criterion(self.criterion)

    def method_settings(self, name: str) -> dict:
        """The setting values ``name`` is fitted with: ``select_by`` (:attr:`tune_by`) and
        ``seed`` where its settings have them, under the values given for it in ``settings``."""
        fields = setting_fields(name)
        shared = {"select_by": self.tune_by, "seed": self.seed}
        return {k: v for k, v in shared.items() if k in fields} | self.settings.get(name, {})


def score_probs(
    probs: torch.Tensor, labels: torch.Tensor, log_probs: torch.Tensor | None = None
) -> dict[str, float]:
    """Validation accuracy, NLL (from ``log_probs [N, K]`` when given), ECE and Brier of ``probs [N, K]``."""
    p, y = probs.detach().double().cpu(), labels.cpu()
    logp = None if log_probs is None else log_probs.detach().cpu()
    return {"accuracy": accuracy(p, y), "nll": nll(p, y, logp), "ece": ece(p, y), "brier": brier(p, y)}


def _auroc(log_probs_in: torch.Tensor, log_probs_out: torch.Tensor) -> float:
    """Max-prob AUROC, ranked by the top class's log-odds from the log-probabilities ``[N, K]``
    (no ties where the probabilities saturate)."""
    return ood_metrics(max_prob_logit(log_probs_in).cpu(), max_prob_logit(log_probs_out).cpu())["auroc"]


def select(
    source: FitSource,
    ood: dict[str, Data] | None = None,
    options: SelectOptions | None = None,
    *,
    data_options: DataOptions | None = None,
    out_dir: Path | None = None,
    on_fitted: Callable[[str, dict], None] | None = None,
) -> tuple[dict, dict[str, Posterior]]:
    """Fit every method of ``options`` on ``source`` (which must hold validation data), score each
    and MAP on it, and return the leaderboard and the posteriors.

    With ``out_dir``: writes ``<method>.safetensors``, ``best.safetensors`` and
    ``leaderboard.json`` there (atomically). ``on_fitted(method, row)`` is called after each method
    (progress for the CLI).
    """
    opts = options or SelectOptions()
    ood = ood or {}
    require(source.val is not None, "select needs held-out validation data (val); it chooses on it")
    require(opts.criterion != "auroc" or bool(ood), "criterion 'auroc' needs OOD data (ood)")
    stage("backbone pass: validation data")
    val = source.val_features()
    labels = val.labels
    stage("backbone pass: fitting data")
    source.features()  # one backbone pass of the fitting set, shared by every method
    if ood:
        stage(f"backbone pass: {len(ood)} OOD set{'s' if len(ood) != 1 else ''}")
    ood_feats = {name: source.features(data) for name, data in ood.items()}
    map_probs, map_logp = val.logits.softmax(-1), map_log_probabilities(val.logits)
    map_row = {
        **score_probs(map_probs, labels, map_logp),
        "auroc": {name: _auroc(map_logp, map_log_probabilities(f.logits)) for name, f in ood_feats.items()},
    }
    rows: dict[str, dict] = {}
    posteriors: dict[str, Posterior] = {}
    for i, name in enumerate(opts.methods, 1):
        stage(f"fit and score {name} ({i}/{len(opts.methods)})")
        start = time.perf_counter()
        post = fit_posterior(name, source, data_options=data_options, **opts.method_settings(name))
        seconds = time.perf_counter() - start

        def probs_of(feats: object, data: Data, post: Posterior = post) -> tuple[torch.Tensor, torch.Tensor]:
            pred = predict(
                post,
                feats,
                Predictive.GLM,
                post.default_link,
                opts.samples,
                opts.seed,
                classifier=source.classifier,
                data=data,
                batch_size=source.batch_size,
            )
            logp = pred.log_probs if pred.log_probs is not None else log_probabilities(pred.probs)
            return pred.probs, logp

        probs, logp = probs_of(val, source.val)
        row = {
            **score_probs(probs, labels, logp),
            "auroc": {n: _auroc(logp, probs_of(f, ood[n])[1]) for n, f in ood_feats.items()},
            "hyperparameters": _chosen(post),
            "tuned_by": _tuned_by(post),
            "fit_seconds": seconds,
            "predictive": f"glm-{post.default_link.value}",
        }
        row["mean_auroc"] = _mean(row["auroc"])
        warning = None if post.selection is None else post.selection.warning
        if warning:
            row["warning"] = warning
        rows[name], posteriors[name] = row, post
        if on_fitted is not None:
            on_fitted(name, row)
    map_row["mean_auroc"] = _mean(map_row["auroc"])
    best = _best(rows, opts.criterion)
    board = {
        "schema_version": 1,
        "kind": "select",
        "bayescli_version": __version__,
        "criterion": opts.criterion,
        "tuned_by": opts.tune_by.value,
        "used_ood_for_choice": opts.criterion == "auroc",
        "model": source.model.describe(),
        "precision": source.model.precision.value,  # of the one backbone pass the methods share
        "data": source.data.info,
        "validation": source.val.info,
        "ood": {name: data.info for name, data in ood.items()},
        "map": map_row,
        "methods": rows,
        "best": best,
        "best_beats_map": _better(rows[best], map_row, opts.criterion),
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, post in posteriors.items():
            post.save(out_dir / f"{name}.safetensors")
            rows[name]["file"] = f"{name}.safetensors"
        posteriors[best].save(out_dir / "best.safetensors")
        write_json(out_dir / "leaderboard.json", board)
    return board, posteriors


def _chosen(post: Posterior) -> dict:
    """The hyperparameters selection chose, and whether the result is the MAP point itself."""
    sel = post.selection
    if sel is None:
        return {"validated": False, "map_point": False, "map_fallback": False}
    out: dict = {"validated": sel.validated}
    if sel.setting:
        out[sel.setting] = sel.chosen
    # the grid's MAP end was best, or no value beat MAP and the method fell back to the MAP point
    out["map_point"] = sel.map_fallback or sel.map_point
    out["map_fallback"] = sel.map_fallback
    return out


def _tuned_by(post: Posterior) -> str | None:
    """The validation criterion that chose ``post``'s key setting (``None``: not chosen on
    held-out data, e.g. given in its settings)."""
    sel = post.selection
    if sel is None or not sel.validated or sel.criterion is None:
        return None
    return sel.criterion.value


def _mean(values: dict[str, float]) -> float | None:
    return sum(values.values()) / len(values) if values else None


def _key(row: dict, criterion: str) -> float:
    value = row["mean_auroc"] if criterion == "auroc" else row[criterion]
    if value is None:
        raise BayescliError(f"no {criterion} to rank by")
    return value if LOWER_IS_BETTER[criterion] else -value


def _best(rows: dict[str, dict], criterion: str) -> str:
    return min(rows, key=lambda name: _key(rows[name], criterion))


def _better(row: dict, map_row: dict, criterion: str) -> bool:
    return _key(row, criterion) <= _key(map_row, criterion)
