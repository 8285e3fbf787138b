"""``bayescli evaluate`` and ``bayescli report``: suites, JSON report, HTML, CI gates."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bayescli import progress
from bayescli.cli import common as c
from bayescli.options import (
    DEFAULT_METHODS,
    DEFAULT_OOD_SCORES,
    MULTILABEL_METHODS,
    MULTILABEL_OOD_SCORES,
    GGPMode,
)


def evaluate_cmd(
    posterior: Annotated[
        list[Path],
        typer.Option(
            help="Posterior file from fit-laplace or fit-vi (repeatable: several posteriors of the same "
            "checkpoint are compared on one backbone pass; method names get a FILE-STEM/ prefix)."
        ),
    ],
    data: Annotated[str, typer.Option(help="Labelled in-distribution test data, e.g. digits:test.")],
    out: Annotated[Path | None, typer.Option(help="Report JSON to write.")] = None,
    html_out: Annotated[Path | None, typer.Option("--html", help="Also write the HTML report.")] = None,
    methods: Annotated[
        str | None,
        typer.Option(
            help="map, temp (temperature-scaled MAP) and/or PREDICTIVE-LINK (glm-bridge-norm / "
            f"glm-bridge-none pick a bridge correction), comma-separated [default: {DEFAULT_METHODS}; "
            f"multi-label posteriors: {MULTILABEL_METHODS}, links none, probit, mc, beta]."
        ),
    ] = None,
    ood: Annotated[
        list[str] | None,
        typer.Option(help="OOD set (repeatable): noise:uniform, noise:gaussian, patches or a data spec."),
    ] = None,
    ood_limit: Annotated[
        int | None, typer.Option(min=1, help="Inputs per OOD set (default: as many as the test set).")
    ] = None,
    ood_scores: Annotated[
        str | None,
        typer.Option(
            help="OOD scores, comma-separated: msp, entropy, alpha0, mi, maxlogit, energy, mahalanobis, "
            "rel-mahalanobis, knn, vim, react, odin (needs input gradients) "
            f"[default: {DEFAULT_OOD_SCORES}]; "
            "multi-label posteriors: max-sigmoid, total-entropy, joint-energy, mi-sum, mi-max, knn "
            f"[default: {MULTILABEL_OOD_SCORES}]."
        ),
    ] = None,
    fit_data: Annotated[
        str | None,
        typer.Option(
            help="In-distribution data the detectors fit on (default: the posterior's fitting data)."
        ),
    ] = None,
    fit_cache: Annotated[
        Path | None, typer.Option(help="Cache file for the fitting data's features (reused when it matches).")
    ] = None,
    val_data: Annotated[
        str | None,
        typer.Option(help="Labelled data the temp method fits T on (default: the fitting data's val split)."),
    ] = None,
    conformal: Annotated[
        float | None,
        typer.Option(
            parser=c.number("--conformal", 1e-6, 1 - 1e-6),
            help="Run split conformal sets at miscoverage ALPHA (calibrated on a seeded half of --data).",
        ),
    ] = None,
    fidelity_inputs: Annotated[
        int,
        typer.Option(
            min=0,
            help="Test inputs for the link-fidelity check (a seeded subset; KL to MC, 2000 draws); 0 = off.",
        ),
    ] = 32,
    rotation: Annotated[str | None, typer.Option(help="Angles START:STOP:STEP, e.g. 0:180:15.")] = None,
    corruption: Annotated[str | None, typer.Option(help="all or NAME,NAME,...")] = None,
    severity: Annotated[str, typer.Option(help="1-5 or 1,3,5.")] = "1-5",
    corruption_root: Annotated[
        Path | None, typer.Option(help="Folder with official CIFAR-10-C/-100-C/MNIST-C .npy files.")
    ] = None,
    fgsm: Annotated[str | None, typer.Option(help="FGSM ε list in pixel units, e.g. 0,2/255,8/255.")] = None,
    fail_if: Annotated[
        list[str] | None,
        typer.Option("--fail-if", help='Gate "PATH OP NUMBER" (repeatable); exit 1 if it holds.'),
    ] = None,
    samples: Annotated[int, typer.Option(min=1, help="Samples for mc / bnn methods.")] = 1000,
    ggp_points: Annotated[int, typer.Option(min=1, help="Fitting points for ggp-* methods.")] = 1000,
    ggp_mode: Annotated[
        GGPMode, typer.Option(help="GGP expansion point for ggp-* methods.")
    ] = GGPMode.REFINED,
    checkpoint: c.CheckpointOverride = None,
    model_spec: c.ConfirmModel = None,
    trust_model_code: c.TrustModelCode = False,
    preprocess: c.PredictPreprocessOpt = None,
    mean: c.Mean = None,
    std: c.Std = None,
    resize: c.Resize = None,
    crop: c.Crop = None,
    interpolation: c.InterpolationOpt = None,
    data_root: c.DataRoot = Path("data"),
    download: c.Download = False,
    limit: c.Limit = None,
    ignore_index: c.IgnoreIndex = 255,
    num_workers: c.NumWorkers = 0,
    skip_unreadable: c.SkipUnreadable = False,
    batch_size: c.BatchSize = 256,
    precision: c.PrecisionOpt = None,
    device: c.Device = "auto",
    seed: c.Seed = 0,
    quiet: c.Quiet = False,
    as_json: c.Json = False,
) -> int:
    """Compare MAP, temperature scaling and Laplace / VI predictives; write one JSON report and gate on it.

    Suites: in-distribution (with calibration metrics and link fidelity), OOD (Bayesian scores
    beside MaxLogit, energy, Mahalanobis, KNN, ViM, ReAct, ODIN), conformal sets, rotation,
    corruption and FGSM.

    Example: bayescli evaluate --posterior posterior.safetensors --data digits:test
    --methods map,temp,glm-probit,glm-bridge --ood noise:uniform --ood patches
    --ood-scores msp,energy,mahalanobis,knn,mi --conformal 0.1 --rotation 0:180:15 --out report.json
    --html report.html --fail-if "ood.patches.glm-probit.max_prob.auroc < 0.8"

    On segmentation data (seg:FILE.npz, with a posterior fitted on seg: data): per-pixel accuracy, mean and
    per-class IoU, NLL, Brier, ECE and reliability bins per method (map, temp, glm-LINK), and pixel-level
    anomaly detection (AUROC, AP, FPR95 by max_prob, entropy, energy, mutual information) on the
    data's own 'anomaly' masks and on --ood seg:FILE sets.

    Example: bayescli evaluate --posterior seg-laplace.safetensors --data seg:scenes-test.npz
    --methods map,temp,glm-probit,glm-mc
    --fail-if "anomaly.seg:scenes-test.npz.glm-probit.entropy.auroc < 0.7"
    """
    from bayescli.data.registry import is_segmentation

    if is_segmentation(data):
        return _evaluate_dense(dict(locals()))
    from bayescli.evaluation.evaluate import check_gate_paths, evaluate, evaluation_config
    from bayescli.evaluation.multilabel import for_likelihood, likelihood_of
    from bayescli.evaluation.report import write_report
    from bayescli.evaluation.runner import load_ggp_data, preprocess_key
    from bayescli.io import peek_metadata, write_json
    from bayescli.metrics.classification import low_accuracy_warning
    from bayescli.options import Predictive
    from bayescli.posterior.base import load_posterior

    c.setup(quiet, as_json, seed)
    options = {
        "methods": methods,
        "ood": list(ood or []),
        "ood_limit": ood_limit,
        "ood_scores": ood_scores,
        "fit_data": fit_data,
        "fit_cache": fit_cache,
        "val_data": val_data,
        "conformal": conformal,
        "fidelity_inputs": fidelity_inputs,
        "rotation": rotation,
        "corruption": corruption,
        "severity": severity,
        "corruption_root": corruption_root,
        "fgsm": fgsm,
        "samples": samples,
        "ggp_points": ggp_points,
        "ggp_mode": ggp_mode,
        "data_root": data_root,
        "download": download,
        "num_workers": num_workers,
        "skip_unreadable": skip_unreadable,
        "batch_size": batch_size,
        "precision": precision,
        "seed": seed,
    }
    cfg = evaluation_config(**options, device=c.resolve_device(device, sharded=True))
    # gates and options are checked before any posterior, model or data is loaded; the files'
    # headers say which report (softmax or multi-label) the gates will read
    kinds = {str(peek_metadata(p).get("likelihood", "categorical")) for p in posterior}
    if len(kinds) == 1:
        cfg = for_likelihood(cfg, kinds.pop())
        check_gate_paths(fail_if or [], cfg, c.file_tags(posterior, ["posterior"] * len(posterior)))
    posts = c.tagged_posteriors([load_posterior(p, cfg.device) for p in posterior], posterior)
    likelihood_of(posts)  # softmax and multi-label posteriors mixed: refused before models and data load
    # one model and test set per preprocessing recipe: each posterior sees its own inputs
    recipes: dict[str, dict] = {}
    overrides = c.preprocess_overrides(preprocess, mean, std, resize, crop, interpolation)
    for tag, post in posts.items():
        recipes.setdefault(preprocess_key(post), {})[tag] = post
    models, tests, ggp_data = {}, {}, {}
    for members in recipes.values():
        model = next(iter(members.values())).load_model(
            checkpoint, model=model_spec, trust_model_code=trust_model_code, preprocess=overrides
        )
        test = c.load(data, data_root, download, limit, seed, model.preprocess, num_workers, skip_unreadable)
        for tag, post in members.items():
            models[tag], tests[tag] = model, test
            if any(m.predictive is Predictive.GGP for m in cfg.methods):
                ggp_data[tag] = load_ggp_data(post, model, cfg)
    first = next(iter(posts))
    model, test = models[first], tests[first]
    with progress.session("evaluate"):
        report = evaluate(
            posts, tests, model=models, fail_if=fail_if or [], ggp_data=ggp_data, device=cfg.device, **options
        )
    if overrides:
        report["protocol"]["preprocess_overrides"] = overrides.to_meta()
    if report["map_accuracy"] is not None:
        warning = low_accuracy_warning(
            report["map_accuracy"], model.classifier.num_classes, f"the test data {data}"
        )
        c.warn(warning)
    if test.skipped:
        c.warn(f"skipped {len(test.skipped)} unreadable images of {data} (listed in the report's data)")
    outcomes = report.get("gates", [])
    if out is not None and c.is_main_process():
        write_json(out, report)
    if html_out is not None and c.is_main_process():
        write_report(report, html_path=html_out)
    res = report["results"]
    multilabel = report.get("likelihood") == "bernoulli"
    # the headline metric of each method on a shifted set: accuracy, or mAP for multi-label
    headline = "map" if multilabel else "accuracy"
    shown = MULTILABEL_TABLE if multilabel else SOFTMAX_TABLE
    tables = [
        c.metrics_table(
            f"in-distribution: {test.spec}",
            {m: {k: v[k] for k in shown} for m, v in res["in_distribution"].items()},
        ),
        *_footnotes(report),
    ]
    if "ood" in res:
        for name, per in res["ood"].items():
            # a null cell: a detector that could not be fitted (a warning says why)
            scores = list(dict.fromkeys(s for r in per.values() for s in r if s != "mmc"))
            mean = "mean_max_sigmoid" if multilabel else "mmc"
            scores = [s for s in scores if s != mean]
            rows = [[m, *((r.get(s) or {}).get("auroc") for s in scores), r[mean]] for m, r in per.items()]
            label = "mean max sigmoid" if multilabel else "MMC"
            tables.append(c.table(f"OOD {name}: AUROC by score", ["method", *scores, label], rows))
    if "conformal" in res and multilabel:
        rows = [
            [m, r["coverage"], r["min_label_coverage"], r["mean_size"], r["singleton"], r["empty"]]
            for m, per in res["conformal"].items()
            for r in per.values()
        ]
        tables.append(
            c.table(
                f"per-label conformal sets (lac), alpha = {conformal}",
                ["method", "mean coverage", "min label coverage", "mean size", "singleton", "empty"],
                rows,
            )
        )
    elif "conformal" in res:
        rows = [
            [
                m,
                score,
                r["coverage"],
                _interval(r.get("coverage_ci")),
                r["mean_size"],
                r["topk_same_size"]["mean_size"],
                r["topk_same_size"]["coverage"],
            ]
            for m, per in res["conformal"].items()
            for score, r in per.items()
        ]
        tables.append(
            c.table(
                f"conformal sets, alpha = {conformal}",
                ["method", "score", "coverage", "95% CI", "mean size", "top-k size", "top-k coverage"],
                rows,
            )
        )
    if "link_fidelity" in res:
        fid = res["link_fidelity"]
        note = any("undefined" in r for r in fid.values())  # a null row says why
        rows = [
            [link, r.get("kl_mean"), r.get("kl_max"), r.get("nll"), r.get("noise_floor")]
            + ([r.get("undefined", "")] if note else [])
            for link, r in fid.items()
        ]
        columns = ["link", "mean", "max", "NLL", "MC noise floor"] + (["note"] if note else [])
        title = "link fidelity: KL(reference ‖ link) (reference: MC, or a native Dirichlet's mean)"
        tables.append(c.table(title, columns, rows))
    for suite in ("rotation", "fgsm"):
        if suite in res:
            keys = list(res[suite])
            rows = [[m, *(res[suite][k][m][headline] for k in keys)] for m in res["in_distribution"]]
            tables.append(c.table(f"{suite}: {headline}", ["method", *keys], rows))
    if "corruption" in res:
        rows = []
        for m in res["in_distribution"]:
            per = [s[m][headline] for sev in res["corruption"].values() for s in sev.values()]
            rows.append([m, sum(per) / len(per)])
        tables.append(c.table(f"corruption: mean {headline}", ["method", headline], rows))
    tables.append(c.table("timings (s)", ["", "seconds"], [[k, v] for k, v in report["timings"].items()]))
    for g in outcomes:
        tables.append(
            f"[{'red' if g['failed'] else 'green'}]{'FAILED' if g['failed'] else 'passed'}: "
            f"{g['condition']} ({_value(g['value'], '.4f')})"
        )
    for line in report["warnings"]:
        c.warn(line)
    c.show(quiet, as_json, *tables, payload=report)
    failed = [g for g in outcomes if g["failed"]]
    if failed:
        typer.echo(
            "gate failed: " + "; ".join(f"{g['condition']} ({_value(g['value'], '.4g')})" for g in failed),
            err=True,
        )
        return 1
    return 0


# options of the classification evaluation that have no per-pixel counterpart (yet)
_NOT_DENSE = {
    "ood_limit": "--ood-limit",
    "fit_data": "--fit-data",
    "fit_cache": "--fit-cache",
    "conformal": "--conformal",
    "rotation": "--rotation",
    "corruption": "--corruption",
    "corruption_root": "--corruption-root",
    "fgsm": "--fgsm",
    "html_out": "--html",
    # images and masks must be resized alike; the model's own normalisation applies as recorded
    "preprocess": "--preprocess",
    "mean": "--mean",
    "std": "--std",
    "resize": "--resize",
    "crop": "--crop",
    "precision": "--precision",
}


def _evaluate_dense(o: dict) -> int:
    """``evaluate`` on ``seg:`` data (:func:`bayescli.evaluation.segmentation.evaluate_segmentation`)."""
    from bayescli.data.registry import is_segmentation, load_segmentation
    from bayescli.errors import BayescliError
    from bayescli.evaluation.segmentation import evaluate_segmentation
    from bayescli.io import write_json
    from bayescli.posterior.base import load_posterior

    c.setup(o["quiet"], o["as_json"], o["seed"])
    for name, flag in _NOT_DENSE.items():
        if o[name] is not None:
            raise BayescliError(f"{flag} does not apply to segmentation data (seg:)")
    for spec in o["ood"] or []:
        if not is_segmentation(spec):
            raise BayescliError(
                f"--ood {spec}: anomaly sets for segmentation are seg:FILE.npz files with an 'anomaly' array"
            )
    ignore = None if o["ignore_index"] < 0 else o["ignore_index"]
    dev = c.resolve_device(o["device"])
    paths = list(o["posterior"])
    posts = c.tagged_posteriors([load_posterior(p, dev) for p in paths], paths)
    first = next(iter(posts.values()))
    model = first.load_model(o["checkpoint"], model=o["model_spec"], trust_model_code=o["trust_model_code"])
    test = load_segmentation(o["data"], ignore, o["limit"], o["seed"])
    ood = [load_segmentation(spec, ignore) for spec in o["ood"] or []]
    methods = o["methods"]
    val_spec = o["val_data"]
    if val_spec is None and methods is not None and "temp" in methods.split(","):
        val_spec = (first.meta.get("validation_data") or {}).get("spec")
    if val_spec is not None and not is_segmentation(val_spec):
        raise BayescliError(f"--val-data {val_spec} is not segmentation data (seg:FILE.npz)")
    val = None if val_spec is None else load_segmentation(val_spec, ignore)
    report = evaluate_segmentation(
        posts,
        model,
        test,
        methods=methods,
        ood=ood,
        val=val,
        ood_scores=o["ood_scores"],
        fail_if=o["fail_if"] or [],
        samples=o["samples"],
        seed=o["seed"],
        batch_size=o["batch_size"],
        device=dev,
    )
    if o["out"] is not None:
        write_json(o["out"], report)
    res = report["results"]
    shown = ("pixel_accuracy", "mean_iou", "nll", "brier", "ece", "mmc")
    pixels = next(iter(res["in_distribution"].values()))["pixels"]
    tables = [
        c.metrics_table(
            f"per-pixel, in-distribution: {test.spec} ({pixels} valid pixels)",
            {m: {k: v[k] for k in shown} for m, v in res["in_distribution"].items()},
        ),
        c.table(
            "IoU per class",
            ["method", *model.class_names],
            [[m, *v["iou"].values()] for m, v in res["in_distribution"].items()],
        ),
    ]
    if "temperature" in report["protocol"]:
        t = report["protocol"]["temperature"]
        where = t["data"]["spec"]
        tables.append(f"temp: T = {t['temperature']:.4g} fitted on {t['val_points']} valid pixels of {where}")
    for name, per in res.get("anomaly", {}).items():
        scores = list(dict.fromkeys(s for r in per.values() for s in r if s not in ("pixels", "anomalous")))
        rows = [
            [
                m,
                *(
                    f"{r[s]['auroc']:.4f} / {r[s]['ap']:.4f} / {r[s]['fpr95']:.4f}" if s in r else ""
                    for s in scores
                ),
            ]
            for m, r in per.items()
        ]
        tables.append(c.table(f"anomaly segmentation {name}: AUROC / AP / FPR95", ["method", *scores], rows))
    tables.append(c.table("timings (s)", ["", "seconds"], [[k, v] for k, v in report["timings"].items()]))
    outcomes = report.get("gates", [])
    for g in outcomes:
        tables.append(
            f"[{'red' if g['failed'] else 'green'}]{'FAILED' if g['failed'] else 'passed'}: "
            f"{g['condition']} ({_value(g['value'], '.4f')})"
        )
    c.show(o["quiet"], o["as_json"], *tables, payload=report)
    failed = [g for g in outcomes if g["failed"]]
    if failed:
        typer.echo(
            "gate failed: " + "; ".join(f"{g['condition']} ({_value(g['value'], '.4g')})" for g in failed),
            err=True,
        )
        return 1
    return 0


SOFTMAX_TABLE = ("accuracy", "nll", "ece", "adaptive_ece", "classwise_ece", "brier", "mmc", "aurc")
MULTILABEL_TABLE = ("map", "micro_f1", "macro_f1", "hamming_loss", "subset_accuracy", "nll", "ece", "brier")


def _footnotes(report: dict) -> list[str]:
    """Lines under the in-distribution table for what the reader must not take at face value."""
    from rich.markup import escape

    lines = []
    temperature = report["protocol"].get("temperature") or {}
    if temperature.get("overlaps_fitting_data"):
        lines.append(
            "[yellow]temp: T tuned on fitting data[/yellow] "
            + escape(
                f"({temperature['data'].get('spec')} overlaps the fitting data of "
                f"{', '.join(temperature['overlaps_fitting_data'])}); pass a disjoint --val-data"
            )
        )
    groups = report["protocol"].get("preprocessing") or []
    for group in groups:
        pre = group["preprocess"]
        pixels = (
            f", resize {pre.get('resize')}, crop {pre.get('crop')}"
            if pre.get("resize") or pre.get("crop")
            else ""
        )
        also = " (and map, temp, the detectors)" if group is groups[0] else ""
        lines.append(
            escape(
                f"preprocessing of {', '.join(group['posteriors'])}{also}: "
                f"mean {pre.get('mean')}, std {pre.get('std')}{pixels}"
            )
        )
    return lines


def _interval(ci: list[float] | None) -> str:
    """A coverage interval as ``[lo, hi]`` (4 decimals), or an empty cell."""
    return "" if ci is None else f"[{ci[0]:.4f}, {ci[1]:.4f}]"


def _value(value: float | None, fmt: str) -> str:
    return "no value: see the warnings" if value is None else f"value {value:{fmt}}"


def report_cmd(
    report: Annotated[Path, typer.Argument(help="Report JSON written by evaluate.")],
    out: Annotated[Path | None, typer.Option(help="HTML page to write.")] = None,
    png_dir: Annotated[
        Path | None, typer.Option(help="Also write each figure as PNG into this folder.")
    ] = None,
) -> None:
    """Draw reliability diagrams, shift curves and ROC curves from a report.

    Example: bayescli report report.json --out report.html --png-dir figures
    """
    from bayescli.evaluation.report import write_report
    from bayescli.io import read_json

    data = read_json(report)
    if not isinstance(data, dict) or data.get("kind") != "evaluation":
        raise typer.BadParameter(f"{report} is not a bayescli evaluation report", param_hint="REPORT")
    if out is None and png_dir is None:
        out = report.with_suffix(".html")
    for path in write_report(data, out, png_dir):
        typer.echo(f"wrote {path}")
