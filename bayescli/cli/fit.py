"""``bayescli fit-laplace``: fit a Laplace approximation and write a posterior file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bayescli.cli import common as c
from bayescli.errors import BayescliError
from bayescli.options import Backend, CurvatureType, HessianStructure, Link, Predictive, Subset


def parse_prior(text: str) -> float | str:
    if text in ("auto", "val-nll"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise BayescliError(
            f"--prior-precision must be a positive number, auto or val-nll; got '{text}'"
        ) from None
    if not value > 0:
        raise BayescliError(f"--prior-precision must be positive, got {value}")
    return value


def fit_laplace_cmd(
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
        str, typer.Option(help="A positive number, auto (marginal likelihood) or val-nll.")
    ] = "auto",
    val_data: Annotated[
        str | None, typer.Option(help="Validation spec for val-nll (default: the val split).")
    ] = None,
    predictive: Annotated[Predictive, typer.Option(help="Predictive used by val-nll.")] = Predictive.GLM,
    link: Annotated[Link, typer.Option(help="Link used by val-nll.")] = Link.PROBIT,
    refine_mode: Annotated[
        int, typer.Option(min=0, help="Newton/L-BFGS steps to the GLM mode before fitting (last layer).")
    ] = 0,
    head: c.Head = None,
    model_args: c.ModelArg = None,
    output: c.Output = None,
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
            "data match)."
        ),
    ] = None,
    data_root: c.DataRoot = Path("data"),
    download: c.Download = False,
    limit: c.Limit = None,
    num_workers: c.NumWorkers = 0,
    skip_unreadable: c.SkipUnreadable = False,
    batch_size: c.BatchSize = 256,
    device: c.Device = "auto",
    seed: c.Seed = 0,
    quiet: c.Quiet = False,
    as_json: c.Json = False,
) -> None:
    """Fit a Laplace approximation to a trained classifier.

    Example: bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors
    --data digits:train --hessian kron --prior-precision auto --out posterior.safetensors
    """
    import torch

    from bayescli import parallel
    from bayescli.data import validation_spec
    from bayescli.features import FeatureStream, LogitPass, extract_features, logit_pass
    from bayescli.metrics import low_accuracy_warning
    from bayescli.posterior.laplace import fit_laplace
    from bayescli.predictive.tuning import tune_prior_val_nll

    c.setup(quiet, as_json, seed)
    if out.suffix != ".safetensors":
        raise typer.BadParameter("posterior files are .safetensors", param_hint="--out")
    prior = parse_prior(prior_precision)
    if prior == "val-nll" and predictive is Predictive.GGP:
        raise typer.BadParameter("val-nll tuning uses the glm or bnn predictive", param_hint="--predictive")
    dev = c.resolve_device(device, sharded=True)
    pre = c.preprocess_from_options(preprocess, model, mean, std, resize, crop, interpolation)
    loaded, fit_data = c.load_model_and_data(
        model, checkpoint, head, checkpoint_key, pre, data, data_root, download, limit, seed,
        num_workers, skip_unreadable, model_args=model_args, output=output,
    )  # fmt: skip
    world = parallel.world()
    full_data = fit_data
    if world.distributed:
        if subset is Subset.ALL or refine_mode:
            raise BayescliError(
                "under torchrun only last-layer fits without --refine-mode are sharded; run one process"
            )
        fit_data = fit_data.subset(parallel.local_rows(len(fit_data)))
        if feature_cache is not None:  # each process caches its own shard
            feature_cache = feature_cache.with_name(
                f"{feature_cache.name}.rank{world.rank}-of-{world.size}"
            )
    batches = features = None
    if subset is Subset.ALL:
        # MAP accuracy and the input/output checks from the network's logits: whole-network fits
        # need no feature/head split (the logits may not even be linear in the head's weights)
        stream: FeatureStream | LogitPass = logit_pass(loaded, fit_data, batch_size, dev)
        batches = fit_data.batches(batch_size)
    else:
        # One backbone pass, streamed: the last-layer fit sums its statistics batch by batch.
        stream = FeatureStream(loaded, fit_data, batch_size, dev, cache=feature_cache)
        features = stream.pairs()
    clf = loaded.classifier.to(dev)
    initial = 1.0 if prior == "val-nll" else prior  # val-nll replaces it below
    post = fit_laplace(
        clf,
        batches=batches,
        subset=subset,
        structure=hessian,
        curvature=curvature,
        backend=backend,
        prior_precision=initial,
        batch_size=max(batch_size, 1024),
        seed=seed,
        refine_steps=refine_mode,
        features=features,
    )
    if prior == "val-nll":
        spec = val_data or validation_spec(data)
        val = c.load(spec, data_root, download, None, seed, loaded.preprocess, num_workers, skip_unreadable)
        c.check_labels(val, clf.num_classes)
        val_feats = extract_features(loaded, val, batch_size, dev)
        tune_prior_val_nll(post, val_feats, predictive, link, classifier=clf, val_data=val)
    map_accuracy = stream.accuracy
    if world.distributed:  # what every process saw: skipped files and MAP accuracy over all shards
        full_data.add_unreadable(parallel.gather_objects(fit_data.unreadable))
        if map_accuracy is not None:
            correct, n = parallel.all_reduce_sum(torch.tensor([stream.correct, stream.n])).tolist()
            map_accuracy = correct / n
    c.record_provenance(post, loaded, full_data)
    post.meta["backend"] = backend.value
    post.meta["processes"] = world.size
    if world.is_main:
        post.save(out)
    parallel.barrier()
    summary = {
        "posterior": str(out),
        "subset": subset.value,
        "hessian": hessian.value,
        "curvature": curvature.value,
        "parameters": post.gaussian.num_params,
        "n_data": post.n_data,
        "prior_precision": post.prior_precision,
        "prior_method": post.meta["prior"]["method"],
        "log_marglik": post.log_marglik() if post.log_likelihood is not None else None,
        "fit_seconds": post.meta["fit_seconds"],
        "forward_seconds": stream.seconds,
        "preprocess": loaded.preprocess.source,
        **c.model_facts(loaded),
    }
    if full_data.skipped:
        summary["skipped_unreadable"] = len(full_data.skipped)
        c.warn(
            f"skipped {len(full_data.skipped)} unreadable images of {data} (listed in the posterior's data)"
        )
    if map_accuracy is not None:
        summary["map_accuracy"] = map_accuracy
        c.warn(low_accuracy_warning(summary["map_accuracy"], clf.num_classes, f"the fitting data {data}"))
    c.warn(post.meta["prior"].get("warning"))
    if "refinement" in post.meta:
        ref = post.meta["refinement"]
        summary |= {
            "refine_steps_taken": ref["steps_taken"],
            "objective_at_map": ref["objective_at_map"],
            "objective_refined": ref["objective_refined"],
        }
    c.show(
        quiet,
        as_json,
        c.table("Laplace posterior", ["", "value"], [[k, v] for k, v in summary.items()]),
        payload=summary,
    )
