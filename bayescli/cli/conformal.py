"""``bayescli conformal``: split conformal prediction sets from any method's probabilities."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bayescli._version import __version__
from bayescli.cli import common as c

if TYPE_CHECKING:  # annotations only: the CLI builds its help without loading torch
    from bayescli.data import Data
    from bayescli.models.features import Features
    from bayescli.models.specs import LoadedModel
    from bayescli.posterior.base import Posterior


def _report(post: Posterior, test: Data, result: dict, precision: str) -> dict:
    """The conformal report: its header (``precision`` of the feature passes), then the suite's
    ``result`` (single- or multi-label)."""
    return {
        "schema_version": 1,
        "kind": "conformal",
        "bayescli_version": __version__,
        "posterior_summary": c.posterior_summary(post),
        "data": test.info,
        "precision": precision,
        **result,
    }


def conformal_cmd(
    posterior: Annotated[Path, typer.Option(help="Posterior file from fit-laplace.")],
    data: Annotated[str, typer.Option(help="Data to build sets for, e.g. digits:test.")],
    calibration_data: Annotated[
        str | None,
        typer.Option(
            help="Labelled calibration data, disjoint from --data (default: its source's val split)."
        ),
    ] = None,
    method: Annotated[
        str, typer.Option(help="map, temp or PREDICTIVE-LINK (e.g. glm-probit, glm-mc, glm-bridge-norm).")
    ] = "glm-probit",
    score: Annotated[
        str, typer.Option(help="Non-conformity score: lac, aps, aps-random (randomised) or raps.")
    ] = "lac",
    alpha: Annotated[
        float,
        typer.Option(parser=c.number("--alpha", 1e-6, 1 - 1e-6), help="Miscoverage: sets cover 1 - ALPHA."),
    ] = 0.1,
    raps_lambda: Annotated[
        float,
        typer.Option(parser=c.number("--raps-lambda", 0.0), help="RAPS penalty per rank beyond --raps-kreg."),
    ] = 0.01,
    raps_kreg: Annotated[int, typer.Option(min=0, help="RAPS: ranks without penalty.")] = 5,
    val_data: Annotated[
        str | None,
        typer.Option(help="Labelled data temp fits T on (default: the calibration data, split in half)."),
    ] = None,
    samples: Annotated[int, typer.Option(min=1, help="Samples for mc / bnn methods.")] = 1000,
    out: Annotated[Path | None, typer.Option(help="Write the summary and every input's set as JSON.")] = None,
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
    batch_size: c.BatchSize = 256,
    precision: c.PrecisionOpt = None,
    device: c.Device = "auto",
    seed: c.Seed = 0,
    quiet: c.Quiet = False,
    as_json: c.Json = False,
) -> None:
    """Split conformal prediction sets that hold the label with probability 1 - ALPHA.

    Any method's probabilities (map, temp, Laplace links); calibrated on labelled data disjoint
    from --data; shown beside uncertainty-aware top-k at the same mean set size. A multi-label
    (bernoulli) posterior gets per-label sets of values {0, 1} (score lac), each label covered
    with probability 1 - ALPHA.

    Example: bayescli conformal --posterior posterior.safetensors --data digits:test
    --calibration-data digits:val --method glm-probit --score aps-random --alpha 0.1 --out sets.json
    """
    from bayescli.data import validation_spec
    from bayescli.errors import BayescliError
    from bayescli.evaluation.baselines import standalone_conformal
    from bayescli.evaluation.config import EvalConfig
    from bayescli.io import write_json
    from bayescli.models.features import extract_features
    from bayescli.predictive.conformal import ConformalConfig, ConformalScore

    c.setup(quiet, as_json, seed)
    try:
        score_kind = ConformalScore(score)
    except ValueError:
        raise BayescliError(
            f"unknown score '{score}'; use one of {', '.join(s.value for s in ConformalScore)}"
        ) from None
    ccfg = ConformalConfig(score_kind, alpha, raps_lambda, raps_kreg)
    overrides = c.preprocess_overrides(preprocess, mean, std, resize, crop, interpolation)
    post, model, test, feats = c.prepare_prediction(
        posterior, checkpoint, data, data_root, download, limit, seed, batch_size, device,
        model=model_spec, trust_model_code=trust_model_code, preprocess=overrides, precision=precision,
    )  # fmt: skip
    multilabel = post.likelihood == "bernoulli"
    if multilabel and score_kind is not ConformalScore.LAC:
        raise BayescliError(
            f"score '{score}' ranks classes of one label; multi-label (bernoulli) posteriors take score lac "
            "(per-label sets)"
        )
    cal_spec = calibration_data or validation_spec(data)
    if cal_spec == test.spec:
        raise BayescliError(f"--calibration-data {cal_spec} is the test data; use a disjoint split")
    cal = c.data_options(data_root=data_root, download=download, seed=seed).load(cal_spec, model.preprocess)
    c.check_labels(cal, model.classifier.num_classes, post.likelihood)
    dev = c.resolve_device(device)
    cal_feats = extract_features(model, cal, batch_size, dev)
    if multilabel:
        _multilabel(
            post, model, method, test, feats, cal, cal_feats, alpha, samples, seed, out, quiet, as_json
        )
        return
    if not c.low_accuracy(feats.logits, feats.labels):  # else the test data's warning said it
        c.warn_low_accuracy(cal_feats.logits, cal_feats.labels, f"the calibration data {cal.spec}")
    cfg = EvalConfig(methods=[], samples=samples, seed=seed, batch_size=batch_size, data_root=data_root,
                     download=download, device=dev)  # fmt: skip
    result, sets = standalone_conformal(
        post, model, method, test, feats, cal, cal_feats, ccfg, val_data or cal_spec, cfg
    )
    report = {**_report(post, test, result, model.precision.value), **c.preprocess_record(model, overrides)}
    if out is not None:
        names = model.class_names
        labels = feats.labels.tolist() if feats.labels is not None else None
        sets = sets.cpu()  # one copy, then per-input rows on the host
        members = [row.nonzero().squeeze(1).tolist() for row in sets]
        per_input = [
            {
                "index": i,
                "classes": classes,
                "names": [names[j] for j in classes],
                **({"label": labels[i]} if labels is not None else {}),
            }
            for i, classes in enumerate(members)
        ]
        write_json(out, {**report, "sets": per_input})
    summary = result["summary"]
    topk = summary["topk_same_size"]
    rows = [
        [k, f"[{v[0]:.4f}, {v[1]:.4f}]" if k == "coverage_ci" else v]
        for k, v in summary.items()
        if not isinstance(v, dict)
    ]
    rows += [[f"top-k at same size: {k}", v] for k, v in topk.items()]
    if "temperature" in result:
        rows.append(["temperature", result["temperature"]["temperature"]])
    hist = c.table("set sizes", ["size", "inputs", "coverage"], [
        [s, n, summary.get("coverage_by_size", {}).get(s)] for s, n in summary["size_histogram"].items()
    ])  # fmt: skip
    c.show(
        quiet,
        as_json,
        c.table(f"split conformal: {method}, {score}, alpha = {alpha}", ["", "value"], rows),
        hist,
        payload=report,
    )


def _multilabel(
    post: Posterior,
    model: LoadedModel,
    method: str,
    test: Data,
    feats: Features,
    cal: Data,
    cal_feats: Features,
    alpha: float,
    samples: int,
    seed: int,
    out: Path | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Per-label sets of a multi-label posterior: summary table, per-label coverage, ``--out`` JSON
    with every input's set of values per label."""
    from bayescli.evaluation.multilabel import standalone_conformal
    from bayescli.io import write_json

    names = model.class_names
    result, sets = standalone_conformal(
        post, model.classifier, names, method, test, feats, cal, cal_feats, alpha, samples, seed
    )
    report = _report(post, test, result, model.precision.value)
    if out is not None:
        labels = feats.labels.tolist() if feats.labels is not None else None
        members = sets.cpu().tolist()  # [N][K][2] booleans
        per_input = [
            {
                "index": i,
                "sets": {name: [v for v in (0, 1) if cell[v]] for name, cell in zip(names, row, strict=True)},
                **({"label": labels[i]} if labels is not None else {}),
            }
            for i, row in enumerate(members)
        ]
        write_json(out, {**report, "sets": per_input})
    summary = result["summary"]
    per_label = summary["per_label"]
    rows = [[k, v] for k, v in summary.items() if not isinstance(v, dict)]
    columns = [k for k in ("threshold", "coverage", "mean_size", "singleton", "empty") if k in per_label]
    labels_table = c.table(
        "per label", ["label", *columns], [[n, *(per_label[k][n] for k in columns)] for n in names]
    )
    title = f"per-label split conformal: {result['method']}, lac, alpha = {alpha}"
    c.show(quiet, as_json, c.table(title, ["", "value"], rows), labels_table, payload=report)
