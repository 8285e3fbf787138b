"""Run the evaluation suites and assemble the report (schema ``report.schema.json``).

The backbone runs once per input set (test set, each OOD set, each angle, corruption and ε);
all methods share its features. Shifted sets are lazy views of the test set: rotations and
corruptions are applied batch by batch while streaming (in the DataLoader workers), FGSM batch by
batch in the main process, so no suite holds the pixels of a whole set. Results are nested as
``results.<suite>[.<set>].<method>.<metric>`` so that ``--fail-if`` paths read naturally.
"""

from __future__ import annotations

import platform
import time
from dataclasses import replace
from functools import partial

import torch

from bayescli import parallel
from bayescli._version import __version__
from bayescli.data import Data, load_data
from bayescli.data.corruptions import APPROXIMATIONS, OfficialSource, corrupt, parameter_set
from bayescli.data.shifts import SYNTHETIC_OOD, rotate, synthetic_ood
from bayescli.errors import BayescliError
from bayescli.evaluation import multilabel as ml
from bayescli.evaluation.attacks import fgsm
from bayescli.evaluation.baselines import (
    Baselines,
    calibration_extras,
    conformal_suite,
    fidelity_suite,
    overlaps,
)
from bayescli.evaluation.config import EvalConfig, fidelity_runs
from bayescli.evaluation.methods import Method, MethodOutput, expand_methods, run_method
from bayescli.metrics.classification import (
    ALPHA0_DEGENERATE,
    PROTOCOL,
    TIE_REPORT,
    accuracy,
    classification_summary,
    near_zero_variance_warning,
    ood_metrics,
    reliability,
    selective,
    tie_note,
    tied_fraction,
)
from bayescli.models.features import Features, check_input_shape, extract_features
from bayescli.models.preprocess import Preprocess
from bayescli.models.specs import Classifier, LoadedModel
from bayescli.options import Predictive
from bayescli.posterior.base import Posterior
from bayescli.posterior.selection import chose_map, chosen_label
from bayescli.predictive.ggp import fit_ggp, ggp_fit_spec
from bayescli.progress import stage, track

SCHEMA_VERSION = 3
# A method whose argmax differs from MAP's on more than this fraction of the test inputs is flagged:
# its accuracy is then another classifier's, not MAP's with better uncertainty.
ARGMAX_CHANGE_WARNING = 0.005


class Evaluator:
    """Holds the posteriors, model and timings while the suites run.

    ``posteriors`` maps a tag (used as the method-name prefix when there are several) to a
    posterior of ``model``; every method of ``cfg.methods`` runs once per posterior.
    """

    def __init__(
        self,
        posteriors: dict[str, Posterior],
        model: LoadedModel,
        cfg: EvalConfig,
        prefix: bool | None = None,
        fitted: dict[str, dict | None] | None = None,
        test: dict | None = None,
    ) -> None:
        self.posts, self.model, self.cfg = posteriors, model, cfg
        self.bernoulli = cfg.likelihood == "bernoulli"  # multi-label: a sigmoid per class
        self.prefix = len(posteriors) > 1 if prefix is None else prefix
        self.methods = expand_methods(cfg.methods, list(posteriors), self.prefix)
        self.timings: dict[str, float] = {"forward": 0.0, "attack": 0.0}
        self.n_forward = 0
        self.map_accuracy: float | None = None  # on the first labelled set (the clean test set)
        self.last_features: Features | None = None
        self.ggp: dict[str, object] = {}
        for tag in {m.posterior for m in self.methods if m.predictive is Predictive.GGP}:
            post = posteriors[tag]
            start = time.perf_counter()
            points = cfg.ggp_data[tag] if tag in cfg.ggp_data else load_ggp_data(post, model, cfg)
            self.ggp[tag] = fit_ggp(
                post, model, points, cfg.ggp_mode == "refined", cfg.batch_size, cfg.device
            )
            self.timings[f"ggp_fit.{tag}" if self.prefix else "ggp_fit"] = time.perf_counter() - start
        if fitted is None:
            fitted = {tag: post.meta.get("data") for tag, post in posteriors.items()}
        self.baselines = Baselines(next(iter(posteriors.values())), model, cfg, fitted, test)
        self.temperature = self.baselines.temperature.temperature if self.baselines.temperature else None

    def outputs(self, data: Data, detect: bool = False) -> dict[str, MethodOutput]:
        """Every method's output on ``data`` (one backbone pass); ``detect`` adds the OOD
        detectors' scores."""
        world = parallel.world()
        local = data
        if world.distributed:
            # Batch-aligned shards: each process reads the batches one process would, so seeded
            # per-batch shifts (noise corruptions) draw the same numbers.
            local = data.subset(parallel.local_rows(len(data), align=self.cfg.batch_size))
        attack_before = self.timings["attack"]
        outs = {}
        with parallel.together():  # an error on any process (say, an unreadable file) ends all
            whole = all(post.needs_inputs for post in self.posts.values())
            feats = extract_features(
                self.model, local, self.cfg.batch_size, self.cfg.device, whole_network=whole
            )
            # an FGSM view attacks while streaming: its seconds are counted under "attack"
            self.timings["forward"] += feats.seconds - (self.timings["attack"] - attack_before)
            for m in self.methods:
                post = self.posts[m.posterior] if m.posterior else None
                if self.bernoulli:
                    out = ml.run_multilabel_method(
                        m, post, feats, self.model.classifier, local, self.cfg.samples, self.cfg.seed
                    )
                else:
                    out = run_method(
                        m,
                        post,
                        feats,
                        self.model.classifier,
                        local,
                        self.cfg.samples,
                        self.cfg.seed,
                        self.ggp.get(m.posterior),
                        self.temperature,
                    )
                for key, sec in out.seconds.items():
                    self.timings[f"{m.name}.{key}"] = self.timings.get(f"{m.name}.{key}", 0.0) + sec
                outs[m.name] = out
            if detect:
                self.baselines.score(outs, feats, local)
        if world.distributed:
            feats, outs = _gathered(feats, outs)
            data.add_unreadable(parallel.gather_objects(local.unreadable))
        if self.map_accuracy is None and feats.labels is not None and not self.bernoulli:
            self.map_accuracy = accuracy(feats.logits, feats.labels)
        self.n_forward += len(data)
        self.last_features = feats
        return outs

    def summaries(self, data: Data) -> dict[str, dict]:
        """Per-method accuracy, NLL, Brier, ECE, MMC, entropy (multi-label: the metrics of
        :func:`~bayescli.evaluation.multilabel.shift_summary`) on a shifted copy of the test set."""
        if self.bernoulli:
            return {
                name: ml.shift_summary(o.probs, data.y, data.class_names, o.log_odds)
                for name, o in self.outputs(data).items()
            }
        return {
            name: classification_summary(o.probs, data.y, o.log_probs)
            for name, o in self.outputs(data).items()
        }


def _gathered(feats: Features, outs: dict[str, MethodOutput]) -> tuple[Features, dict[str, MethodOutput]]:
    """Every process's rows of ``feats`` and ``outs`` in dataset order (metrics such as AUROC
    need all of them)."""
    labels = None if feats.labels is None else parallel.gather(feats.labels)
    whole = Features(parallel.gather(feats.phi), parallel.gather(feats.logits), labels, feats.seconds)
    return whole, {
        name: MethodOutput(
            parallel.gather(o.probs),
            {k: None if v is None else parallel.gather(v) for k, v in o.scores.items()},
            o.seconds,
            None if o.log_probs is None else parallel.gather(o.log_probs),
        )
        for name, o in outs.items()
    }


def _tie_notes(
    where: str, clean: dict[str, MethodOutput], outs: dict[str, MethodOutput], rows: dict
) -> list[str]:
    """Record in each method's ``max_prob`` row of ``rows`` the share of the pooled test and OOD
    inputs whose float32 max probability ties (``float32_tied_fraction``: saturated at 1.0, where a
    max-prob AUROC on float32 probabilities is an artefact of the ties; ``max_prob`` here is ranked
    in log space); one note line naming every score, and float32 max probability, whose ties
    exceed ``TIE_REPORT`` on ``where``."""
    tied: dict[str, float] = {}
    saturated: dict[str, float] = {}
    for name, o in outs.items():
        pooled = torch.cat([clean[name].probs.max(-1).values.cpu(), o.probs.max(-1).values.cpu()])
        share = tied_fraction(pooled.float())
        if isinstance(rows[name].get("max_prob"), dict):
            rows[name]["max_prob"]["float32_tied_fraction"] = share
        if share > TIE_REPORT:
            saturated[name] = share
        for score, res in rows[name].items():
            if isinstance(res, dict) and res.get("tied_fraction", 0) > TIE_REPORT:
                tied[f"{name} {score}"] = res["tied_fraction"]
    return [tie_note(where, tied, saturated)] if tied or saturated else []


def _in_distribution(data: Data, outs: dict[str, MethodOutput]) -> dict:
    res = {}
    for name, o in outs.items():
        res[name] = {
            **classification_summary(o.probs, data.y, o.log_probs),
            **calibration_extras(o.probs, data.y),
            **selective(o.probs, data.y, log_probs=o.log_probs),
            "reliability": reliability(o.probs, data.y),
        }
    return res


def argmax_changes(
    in_distribution: dict, outs: dict[str, MethodOutput], map_logits: torch.Tensor
) -> list[str]:
    """Add ``argmax_changed_fraction`` (the share of inputs whose predicted class differs from
    the MAP network's) to every method's in-distribution row; one warning line per method above
    ``ARGMAX_CHANGE_WARNING``."""
    ref = map_logits.argmax(-1).cpu()
    lines = []
    for name, o in outs.items():
        changed = (o.probs.argmax(-1).cpu() != ref).double().mean().item()
        row = in_distribution[name]
        row["argmax_changed_fraction"] = changed
        if changed > ARGMAX_CHANGE_WARNING:
            lines.append(
                f"{name} changes the predicted class of {changed:.2%} of the test inputs from MAP's "
                f"(> {ARGMAX_CHANGE_WARNING:.1%}; accuracy {row['accuracy']:.4f}): its link moves "
                "decisions, not only confidences"
            )
    return lines


def degenerate_posteriors(
    methods: list[Method], outs: dict[str, MethodOutput], posteriors: dict[str, Posterior]
) -> list[str]:
    """One warning per Dirichlet (bridge) method whose mean ``α₀`` explodes or whose mean mutual
    information vanishes on the test set: a posterior with logit variances ≈ 0 (see
    :func:`~bayescli.metrics.classification.near_zero_variance_warning`)."""
    lines = []
    for m in methods:
        scores = outs[m.name].scores
        if scores.get("alpha0") is None or m.posterior is None:
            continue
        alpha0 = scores["alpha0"].double().mean().item()
        neg_mi = scores.get("neg_mutual_information")
        mi = None if neg_mi is None else -neg_mi.double().mean().item()
        post = posteriors[m.posterior]
        delta = post.summary().get("prior_precision")
        known = isinstance(delta, int | float) and not isinstance(delta, bool)
        sel = post.selection
        line = near_zero_variance_warning(
            m.name,
            alpha0,
            mi,
            delta if known else None,
            chose_map(sel),
            chosen_label(sel),
            (scores["alpha0"].double() > ALPHA0_DEGENERATE).double().mean().item(),
        )
        if line is not None:
            lines.append(line)
    return lines


def _attack(
    x: torch.Tensor, y: torch.Tensor, classifier: Classifier, eps: float, timings: dict, likelihood: str
) -> torch.Tensor:
    """FGSM on one batch, on the classifier's device (the attacked batch stays there)."""
    t0 = time.perf_counter()
    dev = next(classifier.parameters()).device
    out = fgsm(classifier, x.to(dev), y.to(dev), eps, len(x), likelihood)
    timings["attack"] += time.perf_counter() - t0
    return out


def load_ood(
    spec: str | Data, reference: Data, cfg: EvalConfig, preprocess: Preprocess | None = None
) -> Data:
    """An OOD set shaped like ``reference``: synthetic, any data spec (test split by default), or
    a loaded set (its labels are dropped: OOD inputs have none of the model's classes)."""
    if isinstance(spec, Data):
        data = spec
    elif spec in SYNTHETIC_OOD:
        return synthetic_ood(spec, reference, cfg.ood_limit or len(reference), cfg.seed)
    else:
        data = load_data(
            spec,
            cfg.data_root,
            cfg.download,
            cfg.ood_limit,
            cfg.seed,
            preprocess=preprocess,
            num_workers=cfg.num_workers,
            skip_unreadable=cfg.skip_unreadable,
        )
    if data.input_shape != reference.input_shape:
        raise BayescliError(
            f"OOD set {data.spec} has inputs {list(data.input_shape)} but the model takes "
            f"{list(reference.input_shape)}; use a set of the same shape or noise:/patches"
        )
    return data.drop_labels(reference.class_names)


def ood_name(spec: str | Data) -> str:
    """The key of an OOD set in ``results.ood``: its spec, without a default ``:test`` split."""
    spec = spec.spec if isinstance(spec, Data) else spec
    return spec[:-5] if spec.endswith(":test") else spec


def load_ggp_data(post: Posterior, model: LoadedModel, cfg: EvalConfig) -> Data:
    """The points the ``ggp-*`` methods of ``post`` fit the GP on: a seeded subset of
    ``cfg.ggp_points`` inputs of its recorded fitting data, prepared with ``model``'s recipe."""
    return load_data(
        ggp_fit_spec(post),
        cfg.data_root,
        cfg.download,
        cfg.ggp_points,
        cfg.seed,
        preprocess=model.preprocess,
        num_workers=cfg.num_workers,
        skip_unreadable=cfg.skip_unreadable,
    )


def describe_posterior(post: Posterior) -> dict:
    """What a report says about one posterior."""
    return {
        "method": post.method,
        "subset": post.subset.value,
        **post.summary(),
        "fit_data": post.meta.get("data"),
        "preprocess": post.meta.get("preprocess"),
    }


def run_evaluation(
    posteriors: dict[str, Posterior],
    model: LoadedModel,
    test: Data,
    cfg: EvalConfig,
    prefix: bool | None = None,
    fitted: dict[str, dict | None] | None = None,
) -> dict:
    """All requested suites on ``test`` (labelled) for every posterior; returns the report dictionary.

    ``posteriors`` maps tags to posteriors of ``model`` (see :class:`Evaluator`); ``prefix`` and
    ``fitted`` are for one group of a larger comparison (see :func:`run_grouped`).
    """
    if test.y is None:
        raise BayescliError(f"{test.spec} has no labels; evaluation needs labelled test data")
    check_input_shape(model, test)
    stage("prepare methods (GGP fits, temperature, OOD detectors)")
    ev = Evaluator(posteriors, model, cfg, prefix, fitted, test.info)
    start = time.perf_counter()
    stage(f"in-distribution: backbone pass and predictives on {len(test)} test inputs")
    clean = ev.outputs(test, detect=bool(cfg.ood))
    clean_feats = ev.last_features
    if ev.bernoulli:
        results: dict = {"in_distribution": ml.in_distribution(clean, test.y, test.class_names)}
    else:
        results = {"in_distribution": _in_distribution(test, clean)}
    protocol: dict = {
        **PROTOCOL,
        **({"likelihood": "bernoulli", "multilabel": ml.protocol()} if ev.bernoulli else {}),
        "methods": [m.name for m in ev.methods],
        "mc_samples": cfg.samples,
        "selective_coverages": [0.5, 0.8, 0.9],
    }
    if ev.ggp:
        infos = {tag: g.info for tag, g in ev.ggp.items()}
        protocol["ggp"] = infos if ev.prefix else next(iter(infos.values()))
    if ev.baselines.temperature is not None:
        protocol["temperature"] = ev.baselines.temperature_protocol()
    warnings: list[str] = [
        f"the test data {test.spec} overlaps the fitting data {post.meta['data'].get('spec')} of "
        f"{tag}: its results there (conformal thresholds included) are in-sample"
        for tag, post in posteriors.items()
        if overlaps(post.meta.get("data"), test.info)
    ]
    if not ev.bernoulli:  # a multi-label output has no argmax nor Dirichlet
        warnings += argmax_changes(results["in_distribution"], clean, clean_feats.logits)
        warnings += degenerate_posteriors(ev.methods, clean, posteriors)
    if fidelity_runs(cfg):
        stage(f"link fidelity ({min(cfg.baselines.fidelity_inputs, len(test))} inputs)")
        t0 = time.perf_counter()
        results["link_fidelity"], protocol["link_fidelity"], lines = fidelity_suite(
            posteriors, model, clean_feats, test, cfg, ev.prefix
        )
        warnings += lines
        ev.timings["link_fidelity"] = time.perf_counter() - t0
    if cfg.baselines.conformal is not None:
        stage("conformal sets")
    if cfg.baselines.conformal is not None and ev.bernoulli:
        t0 = time.perf_counter()
        results["conformal"], protocol["conformal"] = ml.conformal_suite(
            clean, test.y, test.class_names, cfg.baselines.conformal, cfg.seed
        )
        ev.timings["conformal"] = time.perf_counter() - t0
    elif cfg.baselines.conformal is not None:
        t0 = time.perf_counter()
        results["conformal"], protocol["conformal"] = conformal_suite(
            clean, ev.methods, clean_feats, test, posteriors, model, cfg
        )
        ev.timings["conformal"] = time.perf_counter() - t0

    if cfg.ood:
        stage(f"OOD: {len(cfg.ood)} set{'s' if len(cfg.ood) != 1 else ''}")
        protocol["ood"] = {
            "positive": "in-distribution",
            "score_orientation": "higher = in-distribution",
            "limit": cfg.ood_limit,
            **ev.baselines.ood_protocol(),
        }
        if ev.bernoulli:
            protocol["ood"]["applies"] = (
                "max_sigmoid, neg_total_entropy, joint_energy: every method; neg_mi_sum, neg_mi_max: "
                "links mc and beta; knn: map (the network's features)"
            )
        results["ood"] = {}
        tie_notes: list[str] = []
        for spec in track(cfg.ood, len(cfg.ood), "OOD sets"):
            outs = ev.outputs(load_ood(spec, test, cfg, model.preprocess), detect=True)
            if ev.bernoulli:
                results["ood"][ood_name(spec)] = {
                    name: ml.ood_row(clean[name], o) for name, o in outs.items()
                }
                continue
            results["ood"][ood_name(spec)] = {
                name: {
                    "mmc": float(o.probs.max(-1).values.double().mean()),
                    **{
                        # null: a detector that could not be fitted (see warnings)
                        score: None if s is None else ood_metrics(clean[name].scores[score], s)
                        for score, s in o.scores.items()
                    },
                }
                for name, o in outs.items()
            }
            tie_notes += _tie_notes(ood_name(spec), clean, outs, results["ood"][ood_name(spec)])
        warnings += tie_notes

    if cfg.rotations:
        stage(f"rotation: {len(cfg.rotations)} angles")
        protocol["rotation"] = {"angles": cfg.rotations, "interpolation": "bilinear", "fill": 0}
        results["rotation"] = {}
        for angle in track(cfg.rotations, len(cfg.rotations), "rotations"):
            rotated = test.map_inputs(partial(rotate, angle=angle)).subset(slice(None), rotation=angle)
            results["rotation"][f"{angle:g}"] = ev.summaries(rotated)

    if cfg.corruptions:
        stage(f"corruption: {len(cfg.corruptions)} corruptions × {len(cfg.severities)} severities")
        official = cfg.corruption_root is not None
        protocol["corruption"] = {
            "source": f"official files under {cfg.corruption_root}"
            if official
            else "generated (approximation)",
            "corruptions": cfg.corruptions,
            "severities": cfg.severities,
            "parameters": "official" if official else parameter_set(*test.input_shape[-2:]),
            "seeding": None if official else "per batch: seed·1000 + severity and the batch's first row",
            "substitutes": {}
            if official
            else {k: v for k, v in APPROXIMATIONS.items() if k in cfg.corruptions},
        }
        results["corruption"] = {}
        jobs = [(c, s) for c in cfg.corruptions for s in cfg.severities]
        for name, sev in track(jobs, len(jobs), "corruptions"):
            if official:
                n_test = len(test.source)
                data = test.with_source(OfficialSource(cfg.corruption_root, name, sev, n_test))
            else:
                data = test.map_inputs(partial(corrupt, name=name, severity=sev), seed=cfg.seed * 1000 + sev)
            data = data.subset(slice(None), corruption=name, severity=sev)
            results["corruption"].setdefault(name, {})[str(sev)] = ev.summaries(data)

    if cfg.epsilons:
        stage(f"FGSM: {len(cfg.epsilons)} ε")
        protocol["fgsm"] = {
            "space": "pixel [0, 1]",
            "target": "MAP network (white-box)",
            "epsilons": {k: v for k, v in cfg.epsilons},
        }
        results["fgsm"] = {}
        clf = model.classifier
        for label, eps in track(cfg.epsilons, len(cfg.epsilons), "FGSM"):
            attack = partial(_attack, classifier=clf, eps=eps, timings=ev.timings, likelihood=cfg.likelihood)
            data = test.map_inputs(attack, labels=True, workers=False).subset(slice(None), fgsm_eps=eps)
            results["fgsm"][label] = ev.summaries(data)

    warnings = ev.baselines.warnings + warnings
    ev.timings |= ev.baselines.timings
    ev.timings["total"] = time.perf_counter() - start
    ev.timings["forward_inputs"] = ev.n_forward
    return {
        "schema_version": SCHEMA_VERSION,
        "map_accuracy": ev.map_accuracy,
        "kind": "evaluation",
        "likelihood": cfg.likelihood,
        "bayescli_version": __version__,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "device": str(cfg.device),
            "threads": torch.get_num_threads(),
        },
        "model": model.describe(),
        "posterior": describe_posterior(next(iter(posteriors.values()))),
        "posteriors": {tag: describe_posterior(p) for tag, p in posteriors.items()},
        "data": test.info,
        "protocol": protocol,
        "results": results,
        "timings": ev.timings,
        "warnings": warnings,
    }


def preprocess_key(post: Posterior) -> str:
    """A posterior's preprocessing recipe as a comparable key (``""``: the checkpoint's own)."""
    import json

    return json.dumps(post.meta.get("preprocess"), sort_keys=True) if post.meta.get("preprocess") else ""


def run_grouped(groups: list[tuple[dict[str, Posterior], LoadedModel, Data]], cfg: EvalConfig) -> dict:
    """One report for posteriors of one checkpoint fitted with different preprocessing.

    Each group (its posteriors, the model with their recipe, the test data prepared by it) gets its
    own backbone passes, so every posterior sees inputs prepared as when it was fitted; ``map``,
    ``temp`` and the OOD detectors run in the first group (the first posterior's recipe). Results
    are merged under the ``TAG/`` method names a single run would use.
    """
    if len(groups) == 1:
        return run_evaluation(*groups[0], cfg)
    tags = [tag for posts, _, _ in groups for tag in posts]
    fitted = {tag: post.meta.get("data") for posts, _, _ in groups for tag, post in posts.items()}
    rest = replace(cfg, methods=[m for m in cfg.methods if m.predictive is not None])
    reports = []
    for i, (posts, model, test) in enumerate(groups):
        if i and not rest.methods:
            continue
        reports.append(run_evaluation(posts, model, test, cfg if i == 0 else rest, True, fitted))
    report = reports[0]
    for other in reports[1:]:
        _merge(report["results"], other["results"])
        for key, value in other["protocol"].items():
            if key == "methods":
                report["protocol"]["methods"] += value
            elif key == "ggp":
                report["protocol"].setdefault("ggp", {}).update(value)
            elif key == "link_fidelity":
                fidelity = report["protocol"].setdefault("link_fidelity", value)
                for part in ("inputs", "samples"):  # per posterior tag in grouped reports
                    fidelity[part].update(value[part])
            else:
                report["protocol"].setdefault(key, value)
        for key, sec in other["timings"].items():
            report["timings"][key] = report["timings"].get(key, 0) + sec
        report["warnings"] += [w for w in other["warnings"] if w not in report["warnings"]]
        report["posteriors"] |= other["posteriors"]
    order = {name: i for i, name in enumerate(m.name for m in expand_methods(cfg.methods, tags))}
    report["protocol"]["methods"].sort(key=order.__getitem__)
    _order(report["results"], order)
    report["posteriors"] = {tag: report["posteriors"][tag] for tag in tags}
    report["protocol"]["preprocessing"] = [
        {
            "posteriors": list(posts),
            "preprocess": model.preprocess.to_meta(),
            "input_shape": list(test.input_shape),
        }
        for posts, model, test in groups
    ]
    return report


def _merge(into: dict, other: dict) -> None:
    """Add ``other``'s entries to ``into``, recursing where both hold a dictionary."""
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into.setdefault(key, value)


def _order(results: dict, order: dict[str, int]) -> None:
    """Put every ``{method: …}`` level of ``results`` in the methods' order, in place."""
    for key, value in list(results.items()):
        if isinstance(value, dict):
            if value and all(k in order for k in value):
                results[key] = {k: value[k] for k in sorted(value, key=order.__getitem__)}
            else:
                _order(value, order)
