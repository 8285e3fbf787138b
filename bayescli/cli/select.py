"""``bayescli select``: fit every post-hoc method on one backbone pass and rank them on held-out data."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bayescli import progress
from bayescli.cli import common as c
from bayescli.cli.fit_options import ValData, ValSplit
from bayescli.fitting.registry import select_defaults

SELECT_CRITERIA = ("nll", "ece", "brier", "auroc")


def select_cmd(
    ctx: typer.Context,
    data: Annotated[str, typer.Option(help="Fitting data spec, e.g. digits:train (required).")],
    model: Annotated[
        str, typer.Option(help="timm:NAME, torchvision:NAME, builtin:NAME, hf:FOLDER or py:module:factory.")
    ],
    out_dir: Annotated[
        Path, typer.Option(help="Directory for <method>.safetensors, best, leaderboard.json.")
    ],
    checkpoint: Annotated[
        Path | None, typer.Option(help="Weights (.safetensors or a state-dict file).")
    ] = None,
    val_data: ValData = None,
    val_split: ValSplit = None,
    ood: Annotated[
        list[str] | None,
        typer.Option(help="OOD data spec (repeatable): AUROC of each method's max-probability score."),
    ] = None,
    select_by: Annotated[
        str,
        typer.Option(
            help="nll, ece, brier or auroc (mean over the --ood sets: the choice then uses OOD data). "
            "Each method also tunes its key hyperparameter by it (by nll when ranking by auroc).",
            rich_help_panel="Validation",
        ),
    ] = "nll",
    methods: Annotated[
        str | None,
        typer.Option(help=f"Comma-separated registry methods (default: {','.join(select_defaults())})."),
    ] = None,
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
    """Which posterior should I use for this model? Fit each method, rank them on held-out data.

    Example: bayescli select --model builtin:small-cnn --checkpoint model.safetensors
    --data digits:train --val-data digits:val --ood noise:uniform --out-dir select/
    """
    from bayescli.data.shifts import SYNTHETIC_OOD, synthetic_ood
    from bayescli.errors import BayescliError
    from bayescli.fitting.fit_source import FitSource
    from bayescli.fitting.pipeline import check_labels, resolve_validation
    from bayescli.fitting.select import SelectOptions, select

    c.setup(quiet, as_json, seed)
    if select_by not in SELECT_CRITERIA:
        raise typer.BadParameter(f"choose one of {', '.join(SELECT_CRITERIA)}", param_hint="--select-by")
    if val_data is None and val_split is None:
        raise BayescliError("select chooses on held-out data: pass --val-data SPEC or --val-split FRACTION")
    names = [m.strip() for m in methods.split(",") if m.strip()] if methods else select_defaults()
    options = SelectOptions(names, select_by, seed=seed)
    models, data_opts = c.option_groups(ctx.params)
    dev = c.resolve_device(device)
    loaded = models.load()
    loaded.require_categorical("select")
    fit_data = data_opts.load(data, loaded.preprocess)
    check_labels(fit_data, loaded.classifier.num_classes)
    fit_data, val = resolve_validation(loaded, fit_data, data_opts, val=val_data, val_split=val_split)
    ood_sets = {
        spec: synthetic_ood(spec, val, len(val), seed)
        if spec in SYNTHETIC_OOD
        else data_opts.load(spec, loaded.preprocess, limit=False).drop_labels()
        for spec in ood or []
    }
    source = FitSource(loaded, fit_data, val, dev, batch_size)

    def fitted(name: str, row: dict) -> None:
        if row.get("warning"):
            c.warn(f"{name}: {row['warning']}")

    with c.low_accuracy_seen() as seen, progress.session("select"):
        board, _ = select(
            source, ood_sets, options, data_options=data_opts, out_dir=out_dir, on_fitted=fitted
        )
    for message in dict.fromkeys(str(w) for w in seen):
        c.warn(message)
    ood_cols = list(board["ood"])
    columns = [
        "method",
        "accuracy",
        "nll",
        "ece",
        "brier",
        *(f"AUROC {o}" for o in ood_cols),
        "chosen",
        "tuned by",
        "fit s",
    ]
    rows = [["MAP", *(board["map"][k] for k in ("accuracy", "nll", "ece", "brier"))]]
    rows[0] += [board["map"]["auroc"][o] for o in ood_cols] + ["", "", None]
    for name, row in board["methods"].items():
        hyper = row["hyperparameters"]
        chosen = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in hyper.items()
            if k not in ("validated", "map_point", "map_fallback")
        )
        if hyper.get("map_fallback"):
            chosen = "MAP point (no value beat MAP)"
        elif hyper.get("map_point"):
            chosen = f"MAP end ({chosen})"
        rows.append(
            [
                name + (" ★" if name == board["best"] else ""),
                *(row[k] for k in ("accuracy", "nll", "ece", "brier")),
                *(row["auroc"][o] for o in ood_cols),
                chosen,
                row["tuned_by"] or "not tuned",
                row["fit_seconds"],
            ]
        )
    note = (
        f"best by validation {select_by}: {board['best']}"
        + (" (chosen using the OOD sets)" if board["used_ood_for_choice"] else "")
        + ("" if board["best_beats_map"] else f"; it does not beat MAP's {select_by}")
        + f"; methods tuned by validation {board['tuned_by']}"
        + f"; wrote {out_dir}/leaderboard.json and best.safetensors"
    )
    c.show(quiet, as_json, c.table(f"select on {val.spec}", columns, rows), note, payload=board)
