"""``bayescli predict``: predictive probabilities (and Dirichlets) from a posterior file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bayescli._version import __version__
from bayescli.cli import common as c
from bayescli.errors import BayescliError
from bayescli.options import DEFAULT_CORRECTION, BridgeCorrection, GGPMode, Link, Predictive

MAX_SAVED_COV = 200_000_000  # N·K² floats written by --save-logits


def predict_cmd(
    posterior: Annotated[Path, typer.Option(help="Posterior file from fit-laplace.")],
    data: Annotated[str, typer.Option(help="Data spec, e.g. digits:test or npz:batch.npz.")],
    out: Annotated[
        Path | None,
        typer.Option(
            help="Write .json (summary + rows), .jsonl (the summary, then one line per input, "
            "streamed) or .safetensors (arrays)."
        ),
    ] = None,
    predictive: Annotated[
        Predictive, typer.Option(help="glm (linearised) or bnn (sampled network).")
    ] = Predictive.GLM,
    link: Annotated[
        Link | None,
        typer.Option(
            help="How logit Gaussians become probabilities [default: probit; bridge, i.e. the "
            "Dirichlet mean, for a posterior whose native output is a Dirichlet (dirichlet-fvi)]. "
            "Multi-label (bernoulli) posteriors take none, probit, mc or beta (a Beta per label)."
        ),
    ] = None,
    bridge: Annotated[
        bool, typer.Option("--bridge", help="Laplace-bridge Dirichlet output (= --link bridge).")
    ] = False,
    fit_dirichlet: Annotated[
        bool, typer.Option("--dirichlet", help="With --link mc: fit a Dirichlet to the samples.")
    ] = False,
    correction: Annotated[BridgeCorrection, typer.Option(help="Bridge correction.")] = DEFAULT_CORRECTION,
    samples: Annotated[int, typer.Option(min=1, help="Samples for mc / bnn.")] = 1000,
    ggp_points: Annotated[
        int, typer.Option(min=1, help="Fitting points for --predictive ggp (seeded subset).")
    ] = 1000,
    ggp_mode: Annotated[
        GGPMode, typer.Option(help="GGP expansion point: map (f*) or refined (Newton to the mode).")
    ] = GGPMode.REFINED,
    save_logits: Annotated[
        bool, typer.Option("--save-logits", help="Also write logit mean and covariance (.safetensors).")
    ] = False,
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
    """Predict with a Laplace posterior; MAP is shown next to it when labels are known.

    Example: bayescli predict --posterior posterior.safetensors --data digits:test
    --link probit --out pred.json
    """
    from bayescli.io import save_tensors, write_json, write_jsonl
    from bayescli.metrics.classification import classification_summary, map_log_probabilities
    from bayescli.predictive.fidelity import GAUSSIAN_IMAGE
    from bayescli.predictive.ggp import fit_ggp, ggp_fit_spec
    from bayescli.predictive.glm import map_probabilities, predict
    from bayescli.predictive.outputs import (
        dirichlet_fields,
        multilabel_rows,
        multilabel_scores,
        per_label_fields,
        prediction_rows,
    )

    c.setup(quiet, as_json, seed)
    if bridge:
        if link not in (None, Link.BRIDGE):
            raise typer.BadParameter("--bridge implies --link bridge", param_hint="--link")
        link = Link.BRIDGE
    if fit_dirichlet and link is not Link.MC:  # the default link is never mc
        raise typer.BadParameter("--dirichlet needs --link mc", param_hint="--dirichlet")
    if out is not None and out.suffix not in (".json", ".jsonl", ".safetensors"):
        raise typer.BadParameter("use a .json, .jsonl or .safetensors file", param_hint="--out")
    if save_logits and (out is None or out.suffix != ".safetensors"):
        raise typer.BadParameter("--save-logits needs --out FILE.safetensors", param_hint="--save-logits")
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
        precision=precision,
    )
    native = post.native_dirichlet
    if link is None:
        link = post.default_link
    # a link other than the bridge reads a native Dirichlet through its Gaussian image
    image = native and link is not Link.BRIDGE and predictive is not Predictive.BNN
    approximation = GAUSSIAN_IMAGE if image else None
    if approximation is not None and link is Link.MC:
        c.warn(
            f"--link mc on a {post.method} posterior samples the {GAUSSIAN_IMAGE}, not the "
            "Dirichlet: for α_k < 1 its variances ≈ 1/α_k make the least likely classes dominate "
            "E[softmax(z)] (accuracy can fall far below the Dirichlet mean's); the default "
            "--link bridge is the posterior's predictive"
        )
    ggp = None
    if predictive is Predictive.GGP:
        refine = ggp_mode is GGPMode.REFINED
        points = c.load(
            ggp_fit_spec(post),
            data_root,
            download,
            ggp_points,
            seed,
            model.preprocess,
            num_workers,
            skip_unreadable,
        )
        ggp = fit_ggp(post, model, points, refine, batch_size, c.resolve_device(device))
    pred = predict(
        post,
        feats,
        predictive,
        link,
        samples,
        seed,
        model.classifier,
        test,
        correction,
        fit_dirichlet,
        batch_size,
        ggp,
    )
    # a multi-label posterior's probabilities are per label (a sigmoid each), scored per label
    multilabel = post.likelihood == "bernoulli"
    summarise = multilabel_scores if multilabel else classification_summary
    map_probs = map_probabilities(feats.logits, post.likelihood)
    method = f"{predictive.value}-{link.value}" + (" (gaussian image)" if approximation else "")
    if multilabel:  # NLLs from the log-odds: MAP's logits, each link's own
        own = pred.per_label.log_odds if pred.per_label is not None else None
        results = {
            "map": summarise(map_probs, feats.labels, feats.logits),
            method: summarise(pred.probs, feats.labels, own),
        }
    else:  # NLLs from each side's own float64 log-probabilities (exact on saturated inputs)
        results = {
            "map": summarise(map_probs, feats.labels, map_log_probabilities(feats.logits)),
            method: summarise(pred.probs, feats.labels, pred.log_probs),
        }
    extra = dirichlet_fields(pred.alpha) if pred.alpha is not None else {}
    if pred.per_label is not None:
        extra = per_label_fields(pred.per_label)
        if "mutual_information" in extra:
            results[method]["mean_mutual_information"] = float(extra["mutual_information"].mean())
    note = None
    if pred.alpha is not None:
        results[method]["mean_alpha0"] = float(extra["alpha0"].mean())
        results[method]["mean_mutual_information"] = float(extra["mutual_information"].mean())
        from bayescli.metrics.classification import ALPHA0_DEGENERATE, near_zero_variance_warning
        from bayescli.posterior.selection import chose_map, chosen_label

        delta = post.summary().get("prior_precision")
        sel = post.selection
        note = near_zero_variance_warning(
            method,
            results[method]["mean_alpha0"],
            results[method]["mean_mutual_information"],
            delta if isinstance(delta, int | float) and not isinstance(delta, bool) else None,
            chose_map(sel),
            chosen_label(sel),
            float((extra["alpha0"].double() > ALPHA0_DEGENERATE).double().mean()),
        )
        c.warn(note)
    report = {
        "schema_version": 1,
        "kind": "prediction",
        "bayescli_version": __version__,
        "posterior": str(posterior),
        "posterior_summary": c.posterior_summary(post),
        "data": test.info,
        **c.preprocess_record(model, overrides),
        "likelihood": post.likelihood,
        "precision": model.precision.value,
        "predictive": predictive.value,
        "link": link.value,
        "samples": samples if link is Link.MC or predictive is Predictive.BNN else None,
        "bridge_correction": correction.value if link is Link.BRIDGE and not native else None,
        "approximation": approximation,
        "ggp": ggp.info if ggp is not None else None,
        "seed": seed,
        "results": results,
        "timings": pred.timings,
    }
    if note is not None:
        report["warnings"] = [note]
    row_extra = {k: extra[k] for k in ("alpha", "alpha0", "mutual_information") if k in extra}
    rows = multilabel_rows if multilabel else prediction_rows
    if out is not None and out.suffix == ".jsonl":
        write_jsonl(out, report, rows(pred.probs, feats.labels, model.class_names, row_extra))
    elif out is not None and out.suffix == ".json":
        all_rows = list(rows(pred.probs, feats.labels, model.class_names, row_extra))
        write_json(out, {**report, "rows": all_rows})
    elif out is not None:
        tensors = {"probs": pred.probs, **extra}
        if feats.labels is not None:
            tensors["labels"] = feats.labels
        if pred.std is not None:
            tensors["probs_std"] = pred.std
        if save_logits:
            tensors["logit_mean"] = pred.logits.mean
            if pred.logits.kind == "diag":
                tensors["logit_var"] = pred.logits.var
            elif pred.logits.mean.numel() * pred.logits.num_classes > MAX_SAVED_COV:
                raise BayescliError(
                    f"--save-logits would write {pred.logits.mean.numel() * pred.logits.num_classes:,} "
                    "covariance entries; use --limit or a smaller batch of inputs"
                )
            else:
                tensors["logit_cov"] = pred.logits.covariance()
        save_tensors(out, tensors, report)
    c.show(
        quiet,
        as_json,
        c.metrics_table(f"{test.spec}: {len(test)} inputs", results),
        c.table("timings (s)", ["", "seconds"], [[k, v] for k, v in pred.timings.items()]),
        payload=report,
    )
