"""Post-hoc baselines inside ``evaluate``: temperature scaling, OOD detectors, conformal sets
and the link-fidelity check, on the same backbone pass as the Bayesian methods.

Which score goes where (``results.ood.<set>.<method>.<score>``):

* every method: ``max_prob`` (MSP) and ``neg_entropy``; Dirichlet methods ``alpha0`` and
  ``neg_mutual_information``; sampling methods ``neg_mutual_information``;
* ``map`` and ``temp`` (they have logits, ``f`` and ``f/T``): ``max_logit``, ``energy``;
* ``map`` (they read the network, not a predictive): ``mahalanobis``, ``rel_mahalanobis``,
  ``knn``, ``vim``, ``react``, ``odin``.

Detector statistics are fitted on the posterior's fitting data (or ``fit_data``), the
temperature on a validation split; never on the OOD sets.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bayescli.data import Data, DataSpec, load_data
from bayescli.data.registry import DEFAULT_SPLIT_SEED
from bayescli.errors import BayescliError
from bayescli.evaluation import detectors as det
from bayescli.evaluation.config import BaselineConfig, EvalConfig
from bayescli.evaluation.methods import Method, MethodOutput
from bayescli.evaluation.temperature import TemperatureFit, fit_temperature
from bayescli.metrics.classification import adaptive_ece, classwise_ece, mce
from bayescli.models.features import Features, extract_features
from bayescli.models.specs import LoadedModel
from bayescli.options import DEFAULT_CORRECTION, Link, Predictive
from bayescli.posterior.base import Posterior
from bayescli.predictive import conformal as cp
from bayescli.predictive.fidelity import (
    FIDELITY_SAMPLES,
    KL_WARNING,
    MC_REFERENCE,
    fidelity_inputs,
    fidelity_samples,
    link_fidelity,
    reference_name,
    subset_index,
)
from bayescli.predictive.glm import logit_gaussian, predict

LOGIT_SCORES = ("max_logit", "energy")
FITTED = ("mahalanobis", "rel_mahalanobis", "knn", "vim", "react")
CALIBRATION_FRACTION = 0.5


def _fit_spec(posterior: Posterior, bc: BaselineConfig) -> tuple[str | Data, int | None, int]:
    """Spec (or loaded data), limit and limit seed of the fitting data (``fit_data`` or the
    recorded one)."""
    if bc.fit_data is not None:
        return bc.fit_data, None, 0
    info = posterior.meta.get("data") or {}
    if not info.get("spec"):
        raise BayescliError(
            "the posterior records no fitting data; give the detectors' fitting data (`fit_data`)"
        )
    return str(info["spec"]), info.get("limit"), int(info.get("limit_seed", 0))


def _rows(info: dict) -> range | None:
    """The split's rows that ``info`` keeps by an index range (``None``: all of them)."""
    rows = info.get("rows")
    if rows is None:
        return None
    lo, hi = rows
    return range(*slice(lo, hi).indices(int(info.get("rows_of") or 0)))


def overlaps(fit: dict | None, other: dict) -> bool:
    """Whether the data described by ``other`` (a ``Data.info``, or ``{"spec": …}``) may share
    rows with the fitting data recorded as ``fit``.

    Different sources count as disjoint; the same source overlaps unless the two are different
    splits of one seeded partition (same split seed) or disjoint index ranges of one split. A
    whole source (split ``all``) overlaps each of its splits. Unknown fitting data: no claim.
    Sets given in memory (the Python API's ``python:NAME``) overlap only under the same name.
    """
    if not fit or not fit.get("spec") or not other.get("spec"):
        return False
    if str(fit["spec"]).startswith("python:") or str(other["spec"]).startswith("python:"):
        return fit["spec"] == other["spec"]
    a, b = DataSpec.parse(str(fit["spec"])), DataSpec.parse(str(other["spec"]))
    if (a.name, a.path) != (b.name, b.path):
        return False
    split_a, split_b = fit.get("split", a.split), other.get("split", b.split)
    if split_a in (None, "all") or split_b in (None, "all"):
        return True
    seed_a = int(fit.get("split_seed", DEFAULT_SPLIT_SEED))
    seed_b = int(other.get("split_seed", DEFAULT_SPLIT_SEED))
    if split_a != split_b:
        return seed_a != seed_b  # another seed partitions the source differently
    rows_a = _rows(fit)
    rows_b = _rows(other) if "rows" in other else _spec_rows(b, fit)
    if rows_a is None or rows_b is None or not fit.get("rows_of"):
        return True
    return max(rows_a.start, rows_b.start) < min(rows_a.stop, rows_b.stop)


def _spec_rows(spec: DataSpec, like: dict) -> range | None:
    """``spec``'s index range over a split as long as the one ``like`` records."""
    if spec.rows is None or not like.get("rows_of"):
        return None
    return range(*slice(*spec.rows).indices(int(like["rows_of"])))


def default_val_spec(fit_spec: str, fitted: dict[str, dict | None], test: dict | None = None) -> str:
    """The labelled data ``temp`` fits ``T`` on by default: the fitting source's ``val`` split,
    or its ``train`` split when ``val`` overlaps a posterior's fitting data (``fitted``: tag →
    recorded fitting data) and ``train`` does not, nor the test data. Overlap left is flagged."""
    parsed = DataSpec.parse(fit_spec)
    candidates = [str(parsed.with_split(split)) for split in ("val", "train")]
    for spec in candidates:
        info = {"spec": spec}
        if not any(overlaps(f, info) for f in fitted.values()) and not (test and overlaps(test, info)):
            return spec
    return candidates[0]


class Baselines:
    """Fits what the requested baselines need, once, and scores every input set.

    ``fitted`` (tag → recorded fitting data) names every posterior of the comparison, so that the
    temperature's validation data can be checked against (and by default chosen apart from) all
    of their fitting data; ``test`` is the test data's description.
    """

    def __init__(
        self,
        posterior: Posterior,
        model: LoadedModel,
        cfg: EvalConfig,
        fitted: dict[str, dict | None] | None = None,
        test: dict | None = None,
    ) -> None:
        self.model, self.cfg, self.bc = model, cfg, cfg.baselines
        fitted = {"posterior": posterior.meta.get("data")} if fitted is None else fitted
        self.timings: dict[str, float] = {}
        self.temperature: TemperatureFit | None = None
        self.temperature_overlap: list[str] = []  # tags whose fitting data T's data overlaps
        self.detectors: dict[str, object] = {}
        self.failed: dict[str, str] = {}  # detector → why it could not be fitted (its cells are null)
        self.warnings: list[str] = []
        self.fit_info: dict | None = None
        names = {m.name for m in cfg.methods}
        wanted = [s for s in FITTED if s in self.bc.ood_scores] if cfg.ood and "map" in names else []
        if not wanted and "temp" not in names:
            return
        if wanted:
            spec, limit, limit_seed = _fit_spec(posterior, self.bc)
            fit = self._features(spec, limit, limit_seed, self.bc.fit_cache, "fit_forward")
            self.fit_info = fit[0].info
            self._fit_detectors(wanted, *fit)
        if "temp" in names:
            val = self.bc.val_data
            if val is None:
                fit_spec = _fit_spec(posterior, self.bc)[0]
                if isinstance(fit_spec, Data):
                    raise BayescliError(
                        "temp needs labelled validation data (`val_data`) beside fitting data given in memory"
                    )
                val = default_val_spec(fit_spec, fitted, test)
            data, feats = self._features(val, None, 0, None, "val_forward")
            self.temperature_overlap = [tag for tag, f in fitted.items() if overlaps(f, data.info)]
            if self.temperature_overlap:
                self.warnings.append(
                    f"temp: T was tuned on {data.spec}, which overlaps the fitting data of "
                    + ", ".join(f"{t} ({(fitted[t] or {}).get('spec')})" for t in self.temperature_overlap)
                    + "; its calibration is not out-of-sample (pass a disjoint --val-data)"
                )
            if feats.labels is None:
                raise BayescliError(
                    f"{data.spec} has no labels; temperature scaling needs labelled validation data "
                    "(`val_data`)"
                )
            start = time.perf_counter()
            self.temperature = fit_temperature(feats.logits, feats.labels)
            self.temperature_data = data.info
            self.timings["temperature_fit"] = time.perf_counter() - start

    def _features(
        self, spec: str | Data, limit: int | None, seed: int, cache: Path | None, key: str
    ) -> tuple[Data, Features]:
        cfg = self.cfg
        if isinstance(spec, Data):  # given loaded (the Python API's in-memory data)
            data = spec
        else:
            data = load_data(spec, cfg.data_root, cfg.download, limit, seed, preprocess=self.model.preprocess)
        data.check_labels(self.model.classifier.num_classes, cfg.likelihood)
        feats = extract_features(self.model, data, cfg.batch_size, cfg.device, cache)
        self.timings[key] = feats.seconds
        return data, feats

    def _fit_detectors(self, wanted: list[str], data: Data, feats: Features) -> None:
        head = self.model.classifier.head
        weight = head.weight.detach().to(feats.phi.dtype)
        bias = (
            head.bias.detach().to(feats.phi.dtype) if head.bias is not None else weight.new_zeros(len(weight))
        )
        k = self.model.classifier.num_classes
        needs_labels = {"mahalanobis", "rel_mahalanobis"} & set(wanted)
        if needs_labels and feats.labels is None:
            raise BayescliError(
                f"{data.spec} has no labels; {', '.join(sorted(needs_labels))} need labelled fitting data "
                "(`fit_data`)"
            )
        makers = {
            "mahalanobis": lambda: det.Mahalanobis.fit(feats.phi, feats.labels, k, self.bc.ridge),
            "rel_mahalanobis": lambda: det.RelativeMahalanobis.fit(feats.phi, feats.labels, k, self.bc.ridge),
            "knn": lambda: det.KNN.fit(feats.phi, self.bc.knn_k, self.bc.knn_bank, self.cfg.seed),
            "vim": lambda: det.ViM.fit(feats.phi, weight, bias),
            "react": lambda: det.ReAct.fit(feats.phi, weight, bias, self.bc.react_percentile),
        }
        for name in wanted:
            start = time.perf_counter()
            try:
                self.detectors[name] = makers[name]()
            except (BayescliError, torch.linalg.LinAlgError) as err:
                # one detector that cannot be fitted leaves empty cells, not an aborted report
                self.failed[name] = " ".join(str(err).split())
                why = self.failed[name]
                self.warnings.append(
                    f"{name} could not be fitted on {data.spec} ({why}); its OOD cells are null"
                )
            self.timings[f"fit.{name}"] = time.perf_counter() - start

    def score(self, outs: dict[str, MethodOutput], feats: Features, data: Data) -> None:
        """Add the detectors' scores to ``outs`` and keep only the selected scores."""
        selected = set(self.bc.ood_scores)
        for name, out in outs.items():
            if name in ("map", "temp"):
                t = 1.0 if name == "map" else self.temperature.temperature
                logits = feats.logits / t
                if "max_logit" in selected:
                    out.scores["max_logit"] = det.max_logit(logits)
                if "energy" in selected:
                    out.scores["energy"] = det.energy(logits)
            if name == "map":
                for key in self.failed:
                    out.scores[key] = None
                for key, detector in self.detectors.items():
                    start = time.perf_counter()
                    out.scores[key] = detector.score(feats.phi)
                    self._add(f"score.{key}", time.perf_counter() - start)
                if "odin" in selected:
                    start = time.perf_counter()
                    out.scores["odin"] = det.odin(
                        self.model.classifier,
                        data.inputs(slice(None)),
                        self.bc.odin_temperature,
                        self.bc.odin_epsilon,
                        self.cfg.batch_size,
                        self.cfg.device,
                    )
                    self._add("score.odin", time.perf_counter() - start)
            out.scores = {k: v for k, v in out.scores.items() if k in selected}

    def _add(self, key: str, seconds: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + seconds

    def ood_protocol(self) -> dict:
        """Which scores, where, with which hyperparameters and fitting data."""
        params: dict = {"energy": {"temperature": 1.0}} if "energy" in self.bc.ood_scores else {}
        params |= {name: d.params() for name, d in self.detectors.items()}
        params |= {name: {"failed": why} for name, why in self.failed.items()}
        if "odin" in self.bc.ood_scores:
            params["odin"] = {
                "temperature": self.bc.odin_temperature,
                "epsilon": self.bc.odin_epsilon,
                "space": "pixel (ε/std per channel in the model's normalised input space)",
                "clipped": False,
            }
        return {
            "scores": list(self.bc.ood_scores),
            "applies": "max_prob, neg_entropy: every method; alpha0, neg_mutual_information: Dirichlet "
            "and sampling methods; max_logit, energy: map and temp (logits f and f/T); "
            "mahalanobis, rel_mahalanobis, knn, vim, react, odin: map (the network's features)",
            "detectors": params,
            "fit_data": self.fit_info,
        }

    def temperature_protocol(self) -> dict | None:
        if self.temperature is None:
            return None
        return {
            **self.temperature.info(),
            "data": self.temperature_data,
            "data_from": "--val-data" if self.bc.val_data else "default",
            "overlaps_fitting_data": list(self.temperature_overlap),
        }


def calibration_extras(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Classwise ECE, adaptive (equal-mass) ECE and MCE beside the 15-bin ECE."""
    return {
        "classwise_ece": classwise_ece(probs, labels),
        "adaptive_ece": adaptive_ece(probs, labels),
        "mce": mce(probs, labels),
    }


def conformal_suite(
    clean: dict[str, MethodOutput],
    methods: list[Method],
    feats: Features,
    test: Data,
    posteriors: dict[str, Posterior],
    model: LoadedModel,
    cfg: EvalConfig,
) -> tuple[dict, dict]:
    """Split conformal sets for every method and score on a seeded half of the test set,
    calibrated on the other half, each beside uncertainty-aware top-k at the same mean set size
    (on the glm-bridge Dirichlet of the method's posterior; the first posterior for ``map`` and
    ``temp``). Returns ``(results, protocol)``."""
    alpha = cfg.baselines.conformal
    n = len(test)
    n_cal = int(n * CALIBRATION_FRACTION)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed))
    cal, ev = perm[:n_cal].sort().values, perm[n_cal:].sort().values
    y = test.y
    curves: dict[str, cp.TopkCurve] = {}
    for tag, post in posteriors.items():
        bridge = predict(
            post, feats, Predictive.GLM, Link.BRIDGE, seed=cfg.seed, classifier=model.classifier, data=test
        )
        curves[tag] = cp.TopkCurve(bridge.alpha[ev], y[ev])
    first = next(iter(posteriors))
    results: dict = {}
    for m in methods:
        out = clean[m.name]
        results[m.name] = {}
        for score in cp.ConformalScore:
            ccfg = cp.ConformalConfig(score, alpha)
            q_hat = cp.calibrate(out.probs[cal], y[cal], ccfg, cfg.seed)
            sets = cp.prediction_sets(out.probs[ev], q_hat, ccfg, cfg.seed + 1)
            row = {"threshold": q_hat, **cp.set_summary(sets, y[ev])}
            row["topk_same_size"] = curves[m.posterior or first].at_mean_size(row["mean_size"])
            results[m.name][score.value] = row
    protocol = {
        "alpha": alpha,
        "calibration": f"seeded {CALIBRATION_FRACTION:.0%} of the test set (seed {cfg.seed}); "
        "sets and coverage on the rest",
        "calibration_points": n_cal,
        "test_points": n - n_cal,
        "threshold": "ceil((n+1)(1-alpha))-th smallest calibration score",
        "coverage_ci": f"{cp.COVERAGE_LEVEL:.0%} Clopper-Pearson interval over the test points",
        "scores": {s.value: cp.ConformalConfig(s, alpha).info() for s in cp.ConformalScore},
        "topk": "uncertainty-aware top-k on the glm-bridge Dirichlet of the method's posterior (map, "
        "temp: the first), T chosen for the same mean set size",
    }
    return results, protocol


def fidelity_suite(
    posteriors: dict[str, Posterior],
    model: LoadedModel,
    feats: Features,
    test: Data,
    cfg: EvalConfig,
    prefix: bool | None = None,
) -> tuple[dict, dict, list[str]]:
    """``KL(reference ‖ link)`` (MC, or a native Dirichlet's mean) on a seeded subset of the test
    inputs (GLM logit Gaussians), for every
    link of every posterior (rows ``TAG/link`` when there are several); warnings for the links
    the requested methods use."""
    size = min(cfg.baselines.fidelity_inputs, len(test))
    idx = subset_index(len(test), size, cfg.seed)
    sub_feats = Features(
        feats.phi[idx], feats.logits[idx], None if feats.labels is None else feats.labels[idx]
    )
    used = {
        m.link.value
        if m.link is not Link.BRIDGE or m.correction is DEFAULT_CORRECTION
        else f"bridge-{m.correction.value}"
        for m in cfg.methods
        if m.link is not None
    }
    results: dict = {}
    inputs: dict[str, int] = {}
    samples: dict[str, int] = {}
    references: dict[str, str] = {}
    warnings: list[str] = []
    for tag, post in posteriors.items():
        lg = logit_gaussian(post, sub_feats, model.classifier, test.subset(idx), cfg.batch_size)
        keep = fidelity_inputs(len(lg), lg.num_classes, lg.kind, size, FIDELITY_SAMPLES)
        draws = fidelity_samples(keep, lg.num_classes, lg.kind, FIDELITY_SAMPLES)
        labels = None if sub_feats.labels is None else sub_feats.labels[:keep]
        rows, lines = link_fidelity(lg.slice(slice(0, keep)), labels, draws, cfg.seed, KL_WARNING, used)
        pre = f"{tag}/" if (len(posteriors) > 1 if prefix is None else prefix) else ""
        results |= {pre + link: row for link, row in rows.items()}
        warnings += [f"{tag}: {line}" if pre else line for line in lines]
        inputs[tag] = keep
        samples[tag] = draws
        references[tag] = reference_name(lg)
    reference = next(iter(references.values()), MC_REFERENCE)
    protocol = {
        "inputs": next(iter(inputs.values())) if len(inputs) == 1 and not prefix else inputs,
        "of": len(test),
        "selection": "seeded random subset of the test inputs (seed below)",
        "samples": next(iter(samples.values())) if len(samples) == 1 and not prefix else samples,
        "seed": cfg.seed,
        "predictive": "glm",
        "reference": reference if len(set(references.values())) == 1 else references,
        "divergence": "KL(reference || link), nats, mean over inputs",
        "warning_above": KL_WARNING,
    }
    return results, protocol, warnings


def standalone_conformal(
    posterior: Posterior,
    model: LoadedModel,
    method_name: str,
    test: Data,
    test_feats: Features,
    calibration: Data,
    cal_feats: Features,
    ccfg: cp.ConformalConfig,
    val_spec: str,
    cfg: EvalConfig,
) -> tuple[dict, torch.Tensor]:
    """``bayescli conformal``: calibrate ``method_name`` on ``calibration``, sets on ``test``.

    ``temp`` fits ``T`` on ``val_spec``; when that is the calibration data itself, a seeded half
    fits ``T`` and the other half calibrates (the threshold needs points ``T`` never saw).
    Returns the summary and the sets ``[N, K]``.
    """
    from bayescli.evaluation.methods import parse_methods, run_method

    methods = parse_methods(method_name)
    if len(methods) != 1:
        raise BayescliError(f"conformal sets take one method (`method`), got {method_name}")
    method = methods[0]
    if method.predictive is Predictive.GGP:
        raise BayescliError("ggp methods need their fitting points; use evaluate --conformal for them")
    if cal_feats.labels is None:
        raise BayescliError(f"{calibration.spec} has no labels; calibration needs labelled data")
    info: dict = {"method": method.name, **ccfg.info(), "calibration_data": calibration.info}
    temperature = None
    if method.name == "temp":
        if val_spec == calibration.spec:
            perm = torch.randperm(len(calibration), generator=torch.Generator().manual_seed(cfg.seed))
            fit_idx, cal_idx = perm[: len(perm) // 2].sort().values, perm[len(perm) // 2 :].sort().values
            fit = fit_temperature(cal_feats.logits[fit_idx], cal_feats.labels[fit_idx])
            calibration = calibration.subset(cal_idx, conformal_half="calibration")
            cal_feats = Features(cal_feats.phi[cal_idx], cal_feats.logits[cal_idx], cal_feats.labels[cal_idx])
            info["temperature"] = {**fit.info(), "data": f"seeded half of {val_spec} (seed {cfg.seed})"}
        else:
            data = load_data(val_spec, cfg.data_root, cfg.download, None, 0, preprocess=model.preprocess)
            feats = extract_features(model, data, cfg.batch_size, cfg.device)
            if feats.labels is None:
                raise BayescliError(
                    f"{val_spec} has no labels; temperature scaling needs labelled validation data "
                    "(`val_data`)"
                )
            fit = fit_temperature(feats.logits, feats.labels)
            info["temperature"] = {**fit.info(), "data": data.info}
        temperature = fit.temperature

    def probs(feats: Features, data: Data) -> torch.Tensor:
        out = run_method(
            method, posterior, feats, model.classifier, data, cfg.samples, cfg.seed, temperature=temperature
        )
        return out.probs

    q_hat = cp.calibrate(probs(cal_feats, calibration), cal_feats.labels, ccfg, cfg.seed)
    sets = cp.prediction_sets(probs(test_feats, test), q_hat, ccfg, cfg.seed + 1)
    summary = {
        "threshold": q_hat,
        "calibration_points": len(calibration),
        **cp.set_summary(sets, test_feats.labels),
    }
    bridge = predict(
        posterior,
        test_feats,
        Predictive.GLM,
        Link.BRIDGE,
        seed=cfg.seed,
        classifier=model.classifier,
        data=test,
    )
    summary["topk_same_size"] = cp.TopkCurve(bridge.alpha, test_feats.labels).at_mean_size(
        summary["mean_size"]
    )
    return {**info, "summary": summary}, sets
