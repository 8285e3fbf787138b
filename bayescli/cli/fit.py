"""``bayescli fit-laplace``: fit a Laplace approximation and write a posterior file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bayescli.cli import common as c
from bayescli.cli.fit_options import Criterion, SelectBy, ValData, ValSplit, show_fit
from bayescli.options import Backend, CurvatureType, HessianStructure, Link, Predictive, Subset


def fit_laplace_cmd(
    ctx: typer.Context,
    data: Annotated[str, typer.Option(help="Fitting data spec, e.g. digits:train (required).")],
    model: Annotated[
        str, typer.Option(help="timm:NAME, torchvision:NAME, builtin:NAME, hf:FOLDER or py:module:factory.")
    ],
    out: Annotated[Path, typer.Option(help="Posterior file to write (.safetensors).")],
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            help=".safetensors (preferred) or state-dict .pt/.pth. "
            "Not needed for hf:FOLDER models (their weights file is used)."
        ),
    ] = None,
    subset: Annotated[Subset, typer.Option(help="Which weights get a posterior.")] = Subset.LAST_LAYER,
    hessian: Annotated[HessianStructure, typer.Option(help="Curvature structure.")] = HessianStructure.KRON,
    curvature: Annotated[
        CurvatureType, typer.Option(help="ggn (exact), ggn-mc (1 MC label) or ef.")
    ] = CurvatureType.GGN,
    backend: Annotated[Backend, typer.Option(help="Curvature engine for the last layer.")] = Backend.AUTO,
    prior_precision: Annotated[
        str | None,
        typer.Option(
            help="A positive number, auto (marginal likelihood) or val-nll. Default: chosen on held-out "
            "data when there is any (--val-data, --val-split, or the validation split a bayescli train "
            "checkpoint records), else auto."
        ),
    ] = None,
    val_data: ValData = None,
    val_split: ValSplit = None,
    select_by: SelectBy = Criterion.NLL,
    predictive: Annotated[
        Predictive, typer.Option(help="Predictive scored on held-out data (glm or bnn).")
    ] = Predictive.GLM,
    link: Annotated[Link, typer.Option(help="Link scored on held-out data.")] = Link.PROBIT,
    refine_mode: Annotated[
        int, typer.Option(min=0, help="Newton/L-BFGS steps to the GLM mode before fitting (last layer).")
    ] = 0,
    head: c.Head = None,
    model_args: c.ModelArg = None,
    output: c.Output = None,
    likelihood: c.Likelihood = None,
    preprocess: c.PreprocessOpt = None,
    mean: c.Mean = None,
    std: c.Std = None,
    resize: c.Resize = None,
    crop: c.Crop = None,
    interpolation: c.InterpolationOpt = None,
    checkpoint_key: c.CheckpointKey = None,
    feature_cache: Annotated[
        Path | None,
        typer.Option(
            help="Directory caching the fitting features in shards (reused while checkpoint, head and "
            "data match).",
            rich_help_panel="Data",
        ),
    ] = None,
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
) -> None:
    """Fit a Laplace approximation to a trained classifier.

    Example: bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors
    --data digits:train --val-data digits:val --hessian kron --out posterior.safetensors

    On segmentation data (seg:FILE.npz) the posterior is the last-layer Laplace of the dense 1×1-conv head
    over the valid pixels (diag, kron or full), δ by validation NLL per pixel or the marginal likelihood.

    Example: bayescli fit-laplace --model builtin:small-segnet --checkpoint seg.safetensors
    --data seg:scenes.npz:train --hessian kron --out seg-laplace.safetensors
    """
    from bayescli.data.registry import is_segmentation
    from bayescli.fitting.laplace import LaplaceSettings
    from bayescli.fitting.pipeline import fit_from_specs

    c.setup(quiet, as_json, seed)
    if out.suffix != ".safetensors":
        raise typer.BadParameter("posterior files are .safetensors", param_hint="--out")
    settings = LaplaceSettings(
        subset=subset,
        hessian=hessian,
        curvature=curvature,
        backend=backend,
        prior_precision=prior_precision,
        predictive=predictive,
        link=link,
        select_by=select_by,
        refine_steps=refine_mode,
        seed=seed,
    )
    models, data_opts = c.option_groups(ctx.params)
    if is_segmentation(data):
        _fit_dense(models, data, settings, ctx.params, out, quiet, as_json)
        return
    dev = c.resolve_device(device, sharded=True)
    with c.low_accuracy_seen() as seen:
        run = fit_from_specs(
            "laplace",
            models,
            data,
            settings=settings,
            data_options=data_opts,
            val=val_data,
            val_split=val_split,
            select_required=prior_precision == "val-nll",
            device=dev,
            batch_size=batch_size,
            feature_cache=feature_cache,
            out=out,
        )
    post = run.posterior
    summary = {
        "posterior": str(out),
        "subset": subset.value,
        "hessian": hessian.value,
        "curvature": curvature.value,
        "parameters": post.gaussian.num_params,
        "n_data": post.n_data,
        "prior_precision": post.prior_precision,
        "prior_method": post.prior_record["method"],
        "log_marglik": post.log_marglik() if post.log_likelihood is not None else None,
        "fit_seconds": post.meta["fit_seconds"],
        "forward_seconds": run.forward_seconds,
        "preprocess": run.model.preprocess.source,
        **c.model_facts(run.model),
    }
    if run.data.skipped:
        summary["skipped_unreadable"] = len(run.data.skipped)
        c.warn(
            f"skipped {len(run.data.skipped)} unreadable images of {data} (listed in the posterior's data)"
        )
    if "refinement" in post.meta:
        ref = post.meta["refinement"]
        summary |= {
            "refine_steps_taken": ref["steps_taken"],
            "objective_at_map": ref["objective_at_map"],
            "objective_refined": ref["objective_refined"],
        }
    show_fit(run, seen, summary, "Laplace posterior", quiet, as_json)


def _fit_dense(
    models: object, data: str, settings: object, params: dict, out: Path, quiet: bool, as_json: bool
) -> None:
    """``fit-laplace`` on ``seg:`` data (:func:`bayescli.fitting.dense.fit_dense_from_specs`)."""
    from bayescli.errors import BayescliError
    from bayescli.fitting.dense import fit_dense_from_specs
    from bayescli.fitting.pipeline import NOT_VALIDATED

    for name in ("feature_cache", "resize", "crop", "precision"):
        if params[name] is not None:  # resizing would have to treat images and masks alike
            flag = "--" + name.replace("_", "-")
            raise BayescliError(f"{flag} does not apply to segmentation data (seg:)")
    ignore = None if params["ignore_index"] < 0 else params["ignore_index"]
    loaded = models.load()
    run = fit_dense_from_specs(
        loaded,
        data,
        settings,
        ignore_index=ignore,
        val=params["val_data"],
        val_split=params["val_split"],
        limit=params["limit"],
        seed=params["seed"],
        device=c.resolve_device(params["device"]),
        batch_size=params["batch_size"],
        out=out,
    )
    post = run.posterior
    summary = {
        "posterior": str(out),
        "task": "segmentation",
        "subset": post.subset.value,
        "hessian": settings.hessian.value,
        "curvature": settings.curvature.value,
        "parameters": post.gaussian.num_params,
        "valid_pixels": post.n_data,
        "ignore_index": ignore,
        "prior_precision": post.prior_precision,
        "prior_method": post.prior_record.get("method"),
        "log_marglik": post.log_marglik(),
        "fit_seconds": post.meta["fit_seconds"],
        "head": post.meta["dense"]["head"],
        **run.facts(),
    }
    warnings = [w for w in (post.prior_record.get("warning"),) if w]
    if run.val is None and summary["prior_method"] != "fixed":
        warnings.append(NOT_VALIDATED)
    for message in warnings:
        c.warn(message)
    summary["warnings"] = warnings
    c.show(
        quiet,
        as_json,
        c.table(
            "Laplace posterior (segmentation)",
            ["", "value"],
            [[k, v] for k, v in summary.items() if k != "warnings"],
        ),
        payload=summary,
    )
