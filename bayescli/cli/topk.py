"""``bayescli topk``: uncertainty-aware top-k sets from the Laplace-bridge Dirichlet."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bayescli._version import __version__
from bayescli.cli import common as c
from bayescli.options import DEFAULT_CORRECTION, BridgeCorrection, Link, Predictive


def topk_cmd(
    posterior: Annotated[Path, typer.Option(help="Posterior file from fit-laplace.")],
    data: Annotated[str, typer.Option(help="Data spec, e.g. digits:test.")],
    out: Annotated[Path | None, typer.Option(help="Write sets and summary as JSON.")] = None,
    threshold: Annotated[
        float, typer.Option(parser=c.number("--threshold", 1e-9, 1 - 1e-9), help="Overlap level T in (0, 1).")
    ] = 0.05,
    max_k: Annotated[int, typer.Option(min=1, help="Largest set returned.")] = 10,
    correction: Annotated[BridgeCorrection, typer.Option(help="Bridge correction.")] = DEFAULT_CORRECTION,
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
    num_workers: c.NumWorkers = 0,
    skip_unreadable: c.SkipUnreadable = False,
    batch_size: c.BatchSize = 256,
    precision: c.PrecisionOpt = None,
    device: c.Device = "auto",
    seed: c.Seed = 0,
    quiet: c.Quiet = False,
    as_json: c.Json = False,
) -> None:
    """Return, per input, the set of classes the model cannot tell apart (Algorithm 1).

    Example: bayescli topk --posterior posterior.safetensors --data digits:test
    --threshold 0.05 --max-k 10 --out topk.json
    """
    from bayescli.io import write_json
    from bayescli.predictive.glm import predict
    from bayescli.predictive.topk import topk_summary, uncertainty_topk

    c.setup(quiet, as_json, seed)
    overrides = c.preprocess_overrides(preprocess, mean, std, resize, crop, interpolation)
    post, model, test, feats = c.prepare_prediction(
        posterior,
        checkpoint,
        data,
        data_root,
        download,
        limit,
        seed,
        batch_size,
        device,
        num_workers,
        skip_unreadable,
        model=model_spec,
        trust_model_code=trust_model_code,
        preprocess=overrides,
        softmax_only="topk",
        precision=precision,
    )
    pred = predict(
        post,
        feats,
        Predictive.GLM,
        Link.BRIDGE,
        seed=seed,
        classifier=model.classifier,
        data=test,
        correction=correction,
    )
    sets = uncertainty_topk(pred.alpha, threshold, max_k)
    summary = topk_summary(sets, pred.probs, feats.labels, max_k)
    names = model.class_names
    report = {
        "schema_version": 1,
        "kind": "topk",
        "bayescli_version": __version__,
        "posterior_summary": c.posterior_summary(post),
        "data": test.info,
        **c.preprocess_record(model, overrides),
        "precision": model.precision.value,
        "threshold": threshold,
        "max_k": max_k,
        "bridge_correction": correction.value,
        "summary": summary,
    }
    if out is not None:
        labels = feats.labels.tolist() if feats.labels is not None else None
        per_input = [
            {
                "index": i,
                "classes": classes,
                "names": [names[j] for j in classes],
                "k": len(classes),
                **({"label": labels[i]} if labels is not None else {}),
            }
            for i, classes in enumerate(s.tolist() for s in sets)
        ]
        write_json(out, {**report, "sets": per_input})
    rows = [[k, v] for k, v in summary.items() if not isinstance(v, dict)]
    rows += [[f"top-{k} accuracy (fixed)", v] for k, v in summary.get("fixed_topk_accuracy", {}).items()]
    hist = c.table("set sizes", ["k", "inputs"], [[k, v] for k, v in summary["k_histogram"].items()])
    c.show(
        quiet,
        as_json,
        c.table(f"uncertainty-aware top-k, T={threshold}", ["", "value"], rows),
        hist,
        payload=report,
    )
