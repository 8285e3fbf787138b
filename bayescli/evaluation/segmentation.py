"""``evaluate`` on segmentation data: the report ``bayescli evaluate --data seg:FILE.npz`` writes.

One pass over the test images per set: the network's logits and the carried features
(:meth:`~bayescli.models.dense.DenseClassifier.dense_features`) of a batch feed every method —
``map`` (the network's softmax), ``temp`` (``softmax(f / T)``, ``T`` fitted by NLL over the valid
pixels of validation images) and each ``glm-LINK`` of each dense posterior (the per-pixel GLM
predictive, :func:`~bayescli.predictive.dense.dense_predict`). Per method, the per-pixel metrics
(:class:`~bayescli.metrics.segmentation.SegmentationMetrics`: pixel accuracy, mean and per-class
IoU, NLL, Brier, ECE, reliability bins) and, on images with an ``anomaly`` mask (the test set's
own, or ``ood`` sets), pixel-level anomaly detection (:class:`AnomalySegmentationMetrics`: AUROC,
AP, FPR95 with their binning error bounds) per score: ``max_prob`` and ``entropy`` for every
method, ``energy`` for ``map``/``temp`` (it needs logits), ``mutual_information`` for ``glm-mc``
(``H[E p] − E H[p]`` over its samples). Memory: one batch of features and predictions; the
metrics keep sums and histograms only, except ``temp``'s validation logits (``[M, K]`` for the
``M`` valid validation pixels).

``results``: ``in_distribution.METHOD`` (``iou`` keyed by class name) and
``anomaly.SET.METHOD.SCORE`` (``pixels`` and ``anomalous`` beside the scores); ``--fail-if``
paths address both (:func:`expected_dense_results`).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Mapping, Sequence

import torch

from bayescli import devices
from bayescli._version import __version__
from bayescli.data.segmentation import SegmentationData, check_mask
from bayescli.errors import require
from bayescli.evaluation.gates import check_gates, check_paths, parse_gate
from bayescli.evaluation.methods import Method, expand_methods, parse_methods
from bayescli.evaluation.runner import SCHEMA_VERSION, describe_posterior, ood_name
from bayescli.evaluation.temperature import fit_temperature
from bayescli.metrics.classification import ECE_BINS, entropy_of_log
from bayescli.metrics.segmentation import (
    PROTOCOL,
    AnomalySegmentationMetrics,
    SegmentationMetrics,
    anomaly_scores,
)
from bayescli.models.dense import DenseClassifier, as_dense
from bayescli.models.specs import LoadedModel
from bayescli.options import Link, Predictive
from bayescli.posterior.base import Posterior
from bayescli.posterior.dense_laplace import valid_rows
from bayescli.predictive.dense import dense_predict

DENSE_METHODS = "map,glm-probit,glm-bridge"
SCORES = ("max_prob", "entropy", "energy", "mutual_information")
# the classification --ood-scores names that have a per-pixel counterpart
SCORE_NAMES = {"msp": "max_prob", "entropy": "entropy", "energy": "energy", "mi": "mutual_information"}
PIXEL_METRICS = ("pixels", "pixel_accuracy", "mean_iou", "nll", "brier", "ece", "mmc", "entropy")
_LINKS = (Link.PROBIT, Link.BRIDGE, Link.MC, Link.SODPP, Link.NONE)


def dense_methods(text: str | None, tags: Sequence[str]) -> list[Method]:
    """The methods of ``text`` (default :data:`DENSE_METHODS`) for posteriors ``tags``; refuses, in
    one line, a method without a per-pixel form (any predictive but ``glm``, the ``beta`` link)."""
    methods = parse_methods(text or DENSE_METHODS)
    for m in methods:
        require(
            m.predictive in (None, Predictive.GLM) and (m.link is None or m.link in _LINKS),
            f"method '{m.name}' has no per-pixel form; segmentation evaluates map, temp and "
            "glm-probit, glm-bridge, glm-mc, glm-sodpp, glm-none",
        )
    return expand_methods(methods, list(tags))


def method_scores(method: Method, chosen: Sequence[str] | None = None) -> list[str]:
    """The anomaly scores ``method`` reports (module docs), restricted to ``chosen``."""
    baseline = method.predictive is None
    names = ["max_prob", "entropy"]
    names += ["energy"] if baseline else []
    names += ["mutual_information"] if method.link is Link.MC else []
    return [s for s in names if chosen is None or s in chosen]


def parse_dense_scores(text: str | None) -> list[str] | None:
    """``--ood-scores`` for segmentation: ``msp,entropy,energy,mi`` (or the report's names)."""
    if text is None:
        return None
    out = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        score = SCORE_NAMES.get(name, name)
        require(
            score in SCORES,
            f"unknown anomaly score '{name}' for segmentation; choose from {', '.join(SCORE_NAMES)}",
        )
        out.append(score)
    return out


def expected_dense_results(
    methods: Sequence[Method],
    class_names: Sequence[str],
    anomaly_sets: Sequence[str],
    scores: Sequence[str] | None,
) -> dict:
    """The skeleton of ``results`` (leaves ``None``) that :func:`evaluate_segmentation` writes,
    for checking ``--fail-if`` paths before any work."""
    row = {**dict.fromkeys(PIXEL_METRICS), "iou": dict.fromkeys(class_names)}
    tree: dict = {"in_distribution": {m.name: dict(row) for m in methods}}
    if anomaly_sets:
        leaf = {
            "auroc": None,
            "ap": None,
            "fpr95": None,
            "error_bound": dict.fromkeys(("auroc", "ap", "fpr95")),
        }
        tree["anomaly"] = {
            s: {
                m.name: {
                    "pixels": None,
                    "anomalous": None,
                    **{sc: dict(leaf) for sc in method_scores(m, scores)},
                }
                for m in methods
            }
            for s in anomaly_sets
        }
    return tree


class _Pass:
    """One method's streamed metrics over a set: per-pixel metrics and, with anomaly masks, the
    anomaly detection of its scores."""

    def __init__(self, k: int, ignore_index: int | None, anomaly: bool) -> None:
        self.metrics = SegmentationMetrics(k, ignore_index)
        self.anomaly = AnomalySegmentationMetrics() if anomaly else None


def _outputs(
    method: Method,
    posts: Mapping[str, Posterior],
    logits: torch.Tensor,
    carried: torch.Tensor,
    temperature: float,
    samples: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(log_probs [B, K, H, W] float64, probs, anomaly scores [B, H, W])`` of ``method``."""
    if method.predictive is None:
        z = logits / temperature if method.name == "temp" else logits
        log_probs = z.double().log_softmax(1)
        return log_probs, log_probs.exp(), anomaly_scores(log_probs, logits=z)
    pred = dense_predict(posts[method.posterior], carried, method.link, samples, gen, method.correction)
    mi = None
    if pred.expected_entropy is not None:
        mi = entropy_of_log(pred.log_probs.movedim(1, -1)) - pred.expected_entropy.double()
    return pred.log_probs, pred.probs, anomaly_scores(pred.log_probs, mutual_information=mi)


def _run(
    dense: DenseClassifier,
    data: SegmentationData,
    methods: Sequence[Method],
    posts: Mapping[str, Posterior],
    temperature: float,
    scores: Sequence[str] | None,
    samples: int,
    seed: int,
    batch_size: int,
    device: torch.device,
    metrics: bool,
    timings: dict[str, float],
) -> dict[str, _Pass]:
    """One pass over ``data``: each method's :class:`_Pass` (``metrics``: also the per-pixel ones);
    the backbone's time is added to ``timings["forward"]``."""
    anomaly = data.anomaly is not None
    passes = {m.name: _Pass(dense.num_classes, data.ignore_index, anomaly) for m in methods}
    gen = devices.generator(device, seed)
    for start in range(0, len(data), batch_size):
        part = data.subset(slice(start, start + batch_size))
        x, mask = next(part.batches(len(part)))
        x = x.to(device)
        tick = time.perf_counter()
        with torch.no_grad():
            logits, carried = dense(x), dense.dense_features(x)
        timings["forward"] += time.perf_counter() - tick
        for m in methods:
            log_probs, probs, sc = _outputs(m, posts, logits, carried, temperature, samples, gen)
            if metrics and mask is not None:
                passes[m.name].metrics.update(mask.to(device), log_probs=log_probs, probs=probs)
            if anomaly:
                kept = {s: v for s, v in sc.items() if s in method_scores(m, scores)}
                passes[m.name].anomaly.update(kept, part.anomaly.to(device))
    return passes


def fit_pixel_temperature(
    dense: DenseClassifier, val: SegmentationData, device: torch.device, batch_size: int
) -> dict:
    """``T`` minimising the NLL of ``softmax(f / T)`` over ``val``'s valid pixels (their logits
    ``[M, K]`` held in memory); the protocol's ``temperature`` block."""
    rows, labels = [], []
    for start in range(0, len(val), batch_size):
        x, mask = next(val.subset(slice(start, start + batch_size)).batches(batch_size))
        with torch.no_grad():
            z, y = valid_rows(dense(x.to(device)), mask, val.ignore_index)
        rows.append(z)
        labels.append(y)
    fit = fit_temperature(torch.cat(rows), torch.cat(labels))
    return {**fit.info(), "val_points_are": "valid pixels", "data": val.info}


def evaluate_segmentation(
    posteriors: Mapping[str, Posterior],
    model: LoadedModel,
    test: SegmentationData,
    *,
    methods: str | None = None,
    ood: Sequence[SegmentationData] = (),
    val: SegmentationData | None = None,
    ood_scores: str | None = None,
    fail_if: Sequence[str] = (),
    samples: int = 1000,
    seed: int = 0,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
) -> dict:
    """The segmentation report (module docs) of dense posteriors ``posteriors`` (tag → posterior, one
    checkpoint: ``model``) on labelled ``test``; ``ood`` sets must carry anomaly masks; ``val`` is
    where ``temp`` fits ``T`` (required with ``temp``). Gates are checked before any pass and
    recorded under ``gates``."""
    start = time.perf_counter()
    device = torch.device(device)
    for tag, post in posteriors.items():
        require(
            "dense" in post.meta,
            f"posterior {tag} was fitted on a classifier's features, not a segmentation net's pixels; "
            "fit it with fit-laplace --data seg:FILE.npz",
        )
    chosen = parse_dense_scores(ood_scores)
    plan = dense_methods(methods, list(posteriors))
    require(test.mask is not None, f"{test.spec} has no masks; evaluation needs labelled pixels")
    for o in ood:
        require(
            o.anomaly is not None,
            f"{o.spec} has no 'anomaly' array; an anomaly set needs per-pixel 0/1 labels",
        )
    sets = ([test] if test.anomaly is not None else []) + list(ood)
    names = [ood_name(s.spec) for s in sets]
    require(len(set(names)) == len(names), f"anomaly sets named twice: {', '.join(names)}")
    gates = [parse_gate(g) for g in fail_if]
    if gates:
        check_paths(gates, expected_dense_results(plan, model.class_names, names, chosen))
    require(
        val is not None or all(m.name != "temp" for m in plan),
        "temp fits T on validation pixels; pass --val-data seg:FILE.npz",
    )
    for data in (test, *ood, *([val] if val is not None else [])):
        problem = model.input_problem(data.input_shape, data.spec)
        require(problem is None, problem or "")
    dense = as_dense(model.classifier.to(device), next(test.batches(2))[0].to(device), str(model.spec))
    k = dense.num_classes
    require(len(model.class_names) == k, f"the model has {k} classes but names {len(model.class_names)}")
    for data in (test, *ood, *([val] if val is not None else [])):
        if data.mask is not None:
            check_mask(data.mask, k, data.ignore_index, data.spec)
    posts = {tag: post.to(device) for tag, post in posteriors.items()}
    timings: dict[str, float] = {"forward": 0.0}
    protocol: dict = {
        "task": "segmentation",
        "ece_bins": ECE_BINS,
        "brier": "sum over classes, mean over valid pixels",
        "methods": [m.name for m in plan],
        "ignore_index": test.ignore_index,
        "pixel_protocol": PROTOCOL,
        "samples": samples,
        "seed": seed,
    }
    temperature = 1.0
    if any(m.name == "temp" for m in plan):
        tick = time.perf_counter()
        protocol["temperature"] = fit_pixel_temperature(dense, val, device, batch_size)
        temperature = protocol["temperature"]["temperature"]
        timings["temperature"] = time.perf_counter() - tick
    results: dict = {"in_distribution": {}}
    tick = time.perf_counter()
    passes = _run(
        dense, test, plan, posts, temperature, chosen, samples, seed, batch_size, device, True, timings
    )
    timings["in_distribution"] = time.perf_counter() - tick
    for m in plan:
        row = passes[m.name].metrics.compute()
        row["iou"] = dict(zip(model.class_names, row["iou"], strict=True))
        results["in_distribution"][m.name] = row
    if sets:
        results["anomaly"] = {}
        protocol["anomaly"] = {
            "sets": names,
            "positive": "anomalous pixels",
            "orientation": "higher = more anomalous",
        }
    for name, data in zip(names, sets, strict=True):
        tick = time.perf_counter()
        if data is test:
            per = passes
        else:
            per = _run(
                dense,
                data,
                plan,
                posts,
                temperature,
                chosen,
                samples,
                seed,
                batch_size,
                device,
                False,
                timings,
            )
        cells = {}
        for m in plan:
            computed = per[m.name].anomaly.compute()
            protocol["anomaly"]["binning"] = computed["binning"]
            cells[m.name] = {
                "pixels": computed["pixels"],
                "anomalous": computed["anomalous"],
                **computed["scores"],
            }
        results["anomaly"][name] = cells
        timings[f"anomaly:{name}"] = time.perf_counter() - tick
    timings["total"] = time.perf_counter() - start
    first = next(iter(posteriors.values()))
    report = {
        "schema_version": SCHEMA_VERSION,
        "kind": "evaluation",
        "task": "segmentation",
        "likelihood": "categorical",
        "map_accuracy": results["in_distribution"].get("map", {}).get("pixel_accuracy"),
        "bayescli_version": __version__,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "device": str(device),
            "threads": torch.get_num_threads(),
        },
        "model": {**model.describe(), **dense.describe()},
        "posterior": describe_posterior(first),
        "posteriors": {tag: describe_posterior(p) for tag, p in posteriors.items()},
        "data": test.info,
        "protocol": protocol,
        "results": results,
        "timings": timings,
        "warnings": [],
    }
    outcomes = check_gates(results, gates)
    if outcomes:
        report["gates"] = outcomes
    return report
