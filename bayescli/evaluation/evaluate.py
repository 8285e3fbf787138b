"""``evaluate`` as a library call: posteriors and loaded data in, the report dictionary out.

:func:`evaluate` returns the report ``bayescli evaluate`` writes (schema ``report.schema.json``):
the CLI parses its options, loads the posteriors, models and data, and hands them here. Nothing
is printed (progress bars aside); warnings go into ``report["warnings"]``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from bayescli.data import Data
from bayescli.data.corruptions import parse_corruptions, parse_severities
from bayescli.data.shifts import parse_angles
from bayescli.devices import resolve_device
from bayescli.errors import BayescliError
from bayescli.evaluation.attacks import parse_epsilons
from bayescli.evaluation.config import BaselineConfig, EvalConfig, fidelity_runs, parse_ood_scores
from bayescli.evaluation.gates import Gate, check_gates, check_paths, expected_results, parse_gate
from bayescli.evaluation.methods import expand_methods, parse_methods
from bayescli.evaluation.multilabel import for_likelihood, likelihood_of
from bayescli.evaluation.runner import ood_name, preprocess_key, run_grouped
from bayescli.models.features import (
    check_precision,
    parse_precision,
    require_last_layer_precision,
    resolve_precision,
)
from bayescli.models.specs import LoadedModel
from bayescli.options import DEFAULT_METHODS, DEFAULT_OOD_SCORES, GGPMode, Precision, Predictive
from bayescli.posterior.base import Posterior

T = TypeVar("T")


def evaluation_config(
    *,
    methods: str | Sequence[str] | None = None,
    ood: Sequence[str | Data] = (),
    ood_limit: int | None = None,
    ood_scores: str | Sequence[str] | None = None,
    fit_data: str | Data | None = None,
    fit_cache: Path | None = None,
    val_data: str | Data | None = None,
    conformal: float | None = None,
    fidelity_inputs: int = 32,
    rotation: str | Sequence[float] | None = None,
    corruption: str | Sequence[str] | None = None,
    severity: str | Sequence[int] = "1-5",
    corruption_root: Path | None = None,
    fgsm: str | Sequence[str | float] | None = None,
    samples: int = 1000,
    ggp_points: int = 1000,
    ggp_mode: GGPMode | str = GGPMode.REFINED,
    data_root: Path = Path("data"),
    download: bool = False,
    num_workers: int = 0,
    skip_unreadable: bool = False,
    batch_size: int = 256,
    device: str | torch.device = "auto",
    precision: Precision | str | None = None,
    seed: int = 0,
) -> EvalConfig:
    """The suites and baselines that :func:`evaluate` runs for these options (see there).

    Text options take the CLI's syntax (``"map,glm-probit"``, ``"0:180:15"``, ``"1-5"``,
    ``"0,2/255"``); sequences give the same items one by one. Invalid values raise here, before
    anything is loaded or run. ``methods`` and ``ood_scores`` left ``None`` are the defaults of
    the posteriors' likelihood (softmax: ``DEFAULT_METHODS``, ``DEFAULT_OOD_SCORES``;
    multi-label: :data:`~bayescli.evaluation.multilabel.MULTILABEL_METHODS` and
    :data:`~bayescli.evaluation.multilabel.MULTILABEL_OOD_SCORES`), see :func:`for_likelihood`.
    """
    chosen = methods is not None
    methods = methods if chosen else DEFAULT_METHODS
    scores = DEFAULT_OOD_SCORES if ood_scores is None else ood_scores
    scores = scores if isinstance(scores, str) else ",".join(scores)
    return EvalConfig(
        methods=parse_methods(methods if isinstance(methods, str) else ",".join(methods)),
        default_methods=not chosen,
        ood=list(ood),
        ood_limit=ood_limit,
        rotations=_parsed(rotation, parse_angles),
        corruptions=_parsed(corruption, parse_corruptions),
        severities=parse_severities(severity if isinstance(severity, str) else ",".join(map(str, severity))),
        corruption_root=corruption_root,
        epsilons=_parsed(fgsm, parse_epsilons),
        samples=samples,
        ggp_points=ggp_points,
        ggp_mode=GGPMode(ggp_mode).value,
        seed=seed,
        batch_size=batch_size,
        data_root=data_root,
        download=download,
        device=_device(device),
        precision=None if precision is None else parse_precision(precision),
        num_workers=num_workers,
        skip_unreadable=skip_unreadable,
        baselines=BaselineConfig(
            ood_scores=parse_ood_scores(scores),
            default_scores=ood_scores is None,
            fit_data=fit_data,
            val_data=val_data,
            fit_cache=fit_cache,
            conformal=conformal,
            fidelity_inputs=fidelity_inputs,
        ),
    )


def _parsed(value: str | Sequence | None, parse: Callable[[str], list]) -> list:
    """A text option parsed, or a sequence's items joined and parsed (so both are checked alike)."""
    if value is None:
        return []
    return parse(value if isinstance(value, str) else ",".join(str(v) for v in value))


def _device(device: str | torch.device) -> torch.device:
    """A resolved device passes through (the CLI resolved it, joining torchrun's process group,
    once); ``auto``/``cpu``/``cuda[:N]`` text is resolved here. Joining a process group is
    :func:`bayescli.distributed.init`'s business alone: call it first under torchrun."""
    return torch.device(device) if isinstance(device, torch.device) else resolve_device(device)


def check_gate_paths(fail_if: Sequence[str], cfg: EvalConfig, tags: Sequence[str]) -> list[Gate]:
    """Parse the gates ``"PATH OP NUMBER"`` and check that each path names a number the report
    for ``cfg`` (resolved for the posteriors' likelihood by :func:`for_likelihood`) will hold
    (posteriors tagged ``tags``); raises on a malformed gate or an unknown path, before any work."""
    gates = [parse_gate(g) for g in fail_if]
    if gates:
        methods = [m.name for m in expand_methods(cfg.methods, list(tags))]
        expected = expected_results(
            methods,
            ood=[ood_name(o) for o in cfg.ood],
            ood_scores=cfg.baselines.ood_scores,
            rotations=[f"{a:g}" for a in cfg.rotations],
            corruptions={n: [str(s) for s in cfg.severities] for n in cfg.corruptions},
            epsilons=[label for label, _ in cfg.epsilons],
            conformal=cfg.baselines.conformal is not None,
            fidelity=fidelity_runs(cfg),
            likelihood=cfg.likelihood,
        )
        check_paths(gates, expected)
    return gates


def posterior_tags(posteriors: Sequence[Posterior]) -> dict[str, Posterior]:
    """Posteriors keyed by tags (the method-name prefixes when there are several): each file's
    stem made safe (the method name for one not read from a file), ``-2``, ``-3`` … where they
    repeat; all must belong to one checkpoint."""
    if not posteriors:
        raise BayescliError("evaluation needs at least one posterior (`posteriors`)")
    first = posteriors[0].meta
    for i, post in enumerate(posteriors):
        for key in ("model", "checkpoint_sha256"):
            if post.meta.get(key) != first.get(key):
                raise BayescliError(
                    f"posterior {i} belongs to a different model ({key} {post.meta.get(key)!r} vs "
                    f"{first.get(key)!r} in posterior 0); compare posteriors of one checkpoint"
                )
    tags: dict[str, Posterior] = {}
    for post in posteriors:
        path = getattr(post, "path", None)
        base = (re.sub(r"[^A-Za-z0-9_-]+", "-", Path(path).stem) if path else "") or post.method
        tag, n = base, 1
        while tag in tags:
            n += 1
            tag = f"{base}-{n}"
        tags[tag] = post
    return tags


def evaluate(
    posteriors: Sequence[Posterior] | Mapping[str, Posterior],
    data: Data | Mapping[str, Data],
    *,
    model: LoadedModel | Mapping[str, LoadedModel] | None = None,
    ood: Sequence[str | Data] = (),
    rotation: str | Sequence[float] | None = None,
    corruption: str | Sequence[str] | None = None,
    fgsm: str | Sequence[str | float] | None = None,
    fail_if: Sequence[str] = (),
    ggp_data: Data | Mapping[str, Data] | None = None,
    methods: str | Sequence[str] | None = None,
    ood_limit: int | None = None,
    ood_scores: str | Sequence[str] | None = None,
    fit_data: str | Data | None = None,
    fit_cache: Path | None = None,
    val_data: str | Data | None = None,
    conformal: float | None = None,
    fidelity_inputs: int = 32,
    severity: str | Sequence[int] = "1-5",
    corruption_root: Path | None = None,
    samples: int = 1000,
    ggp_points: int = 1000,
    ggp_mode: GGPMode | str = GGPMode.REFINED,
    data_root: Path = Path("data"),
    download: bool = False,
    num_workers: int = 0,
    skip_unreadable: bool = False,
    batch_size: int = 256,
    device: str | torch.device = "auto",
    precision: Precision | str | None = None,
    seed: int = 0,
) -> dict:
    """Compare MAP, temperature scaling and the posteriors' predictives on labelled test ``data``;
    returns the report dictionary (what ``bayescli evaluate`` writes, gates included).

    ``posteriors``: posteriors of one checkpoint, as a list (tagged by :func:`posterior_tags`)
    or a mapping tag → posterior; with several, method names get a ``TAG/`` prefix. ``data`` is
    prepared with the posteriors' preprocessing recipe; posteriors fitted with different recipes
    each need their own copy: pass a mapping tag → ``Data`` (and, if given, ``model`` likewise).
    ``model``: the network (``None``: each recipe's first posterior's :meth:`Posterior.load_model`).

    Suites (each off when empty): ``ood`` sets (``noise:uniform``, ``noise:gaussian``,
    ``patches``, data specs loaded under ``data_root`` with at most ``ood_limit`` inputs, or
    loaded ``Data``), ``rotation`` angles, ``corruption`` names at ``severity``, ``fgsm`` radii in
    pixel units, ``conformal`` miscoverage, ``fidelity_inputs`` link-fidelity inputs. ``fit_data``
    and ``val_data`` are the specs the OOD detectors and ``temp`` fit on (default: the fitting
    data and its validation split); ``ggp_data`` the points the ``ggp-*`` methods fit the GP on
    (a mapping tag → ``Data``, or one set for all; default: a seeded subset of ``ggp_points``
    inputs of each posterior's recorded fitting data). ``fail_if`` gates ``"PATH OP NUMBER"``
    are checked before any work and recorded under ``report["gates"]`` (a gate whose condition
    holds has ``failed: true``). ``methods`` and ``ood_scores`` default to those of the
    posteriors' likelihood; multi-label (bernoulli) posteriors get the multi-label report
    (:mod:`bayescli.evaluation.multilabel`); posteriors of both kinds in one call are refused. The
    other options are those of ``bayescli evaluate``. ``precision`` of the backbone's feature
    passes (``None``: the one the posteriors were fitted at, which must then agree) is recorded as
    ``report["precision"]``.
    """
    cfg = evaluation_config(
        methods=methods,
        ood=ood,
        ood_limit=ood_limit,
        ood_scores=ood_scores,
        fit_data=fit_data,
        fit_cache=fit_cache,
        val_data=val_data,
        conformal=conformal,
        fidelity_inputs=fidelity_inputs,
        rotation=rotation,
        corruption=corruption,
        severity=severity,
        corruption_root=corruption_root,
        fgsm=fgsm,
        samples=samples,
        ggp_points=ggp_points,
        ggp_mode=ggp_mode,
        data_root=data_root,
        download=download,
        num_workers=num_workers,
        skip_unreadable=skip_unreadable,
        batch_size=batch_size,
        device=device,
        precision=precision,
        seed=seed,
    )
    posts = dict(posteriors) if isinstance(posteriors, Mapping) else posterior_tags(list(posteriors))
    if not posts:
        raise BayescliError("evaluation needs at least one posterior (`posteriors`)")
    cfg = for_likelihood(cfg, likelihood_of(posts))
    gates = check_gate_paths(fail_if, cfg, list(posts))
    chosen = _precision(cfg, posts)
    # one model and test set per preprocessing recipe: each posterior sees its own inputs
    recipes: dict[str, dict[str, Posterior]] = {}
    for tag, post in posts.items():
        recipes.setdefault(preprocess_key(post), {})[tag] = post
    several = len(recipes) > 1
    groups = []
    for members in recipes.values():
        first = next(iter(members))
        loaded = _for_tag(model, first, "model", several)
        if loaded is None:
            loaded = members[first].load_model()
        loaded = dataclasses.replace(loaded, precision=chosen)  # the caller's model is left as given
        test = _for_tag(data, first, "data", several)
        if test is None:
            raise BayescliError(f"no test data for posterior {first}; give it in `data`")
        if loaded.likelihood != cfg.likelihood:
            raise BayescliError(
                f"posterior {first} is for a {cfg.likelihood} classifier but {loaded.checkpoint} is "
                f"{loaded.likelihood}; evaluate a posterior with the checkpoint it was fitted on"
            )
        test.check_labels(loaded.classifier.num_classes, cfg.likelihood)
        groups.append((members, loaded, test))
    if ggp_data is not None and any(m.predictive is Predictive.GGP for m in cfg.methods):
        given = {tag: _for_tag(ggp_data, tag, "ggp_data", False) for tag in posts}
        cfg.ggp_data = {tag: points for tag, points in given.items() if points is not None}
    report = run_grouped(groups, cfg)
    report["precision"] = chosen.value
    paths = [getattr(post, "path", None) for post in posts.values()]
    if all(paths):
        report["posterior_file"] = str(paths[0])
        report["posterior_files"] = {tag: str(p) for tag, p in zip(posts, paths, strict=True)}
    outcomes = check_gates(report["results"], gates)
    if outcomes:
        report["gates"] = outcomes
    return report


def _precision(cfg: EvalConfig, posts: Mapping[str, Posterior]) -> Precision:
    """The precision of the evaluation's feature passes: ``cfg.precision``, else the one the
    posteriors were fitted at (one pass serves them all, so they must agree)."""
    chosen = {resolve_precision(cfg.precision, post.meta) for post in posts.values()}
    if len(chosen) > 1:
        names = " and ".join(sorted(p.value for p in chosen))
        raise BayescliError(
            f"the posteriors were fitted at precisions {names}; give one `precision` for the feature pass"
        )
    precision = check_precision(chosen.pop(), cfg.device)
    for tag, post in posts.items():
        if post.needs_inputs:
            require_last_layer_precision(precision, f"posterior {tag} ({post.method}, subset all)")
    return precision


def _for_tag(value: T | Mapping[str, T] | None, tag: str, name: str, several: bool) -> T | None:
    """``value`` for the posterior ``tag``: its mapping entry, or the one value (refused when the
    posteriors use several preprocessing recipes: one prepared set cannot serve them all)."""
    if isinstance(value, Mapping):
        return value.get(tag)
    if value is not None and several:
        raise BayescliError(
            f"the posteriors were fitted with different preprocessing; give `{name}` as a mapping "
            "tag → one prepared for each posterior's recipe"
        )
    return value
