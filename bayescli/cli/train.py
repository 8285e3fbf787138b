"""``bayescli train``: train a builtin model and write a safetensors checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bayescli.cli import common as c
from bayescli.errors import BayescliError
from bayescli.fitting.registry import method_entry, trainable
from bayescli.options import TrainConfig

# kept in step with bayescli.training.classifier.LIKELIHOODS (not imported: torch loads lazily)
LIKELIHOODS = ["categorical", "bernoulli"]


def train_methods(likelihood: str | None = None) -> list[str]:
    """``--method``'s objectives: MAP and every registry method with a from-scratch trainer (that
    trains ``likelihood``, when given; MAP trains both)."""
    return ["map", *trainable(likelihood)]


def parse_settings(items: list[str]) -> dict[str, str]:
    """``["kl_weight=2e-7", "family=ensemble"]`` → ``{"kl_weight": "2e-7", ...}``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BayescliError(f"--set takes NAME=VALUE, e.g. --set kl_weight=2e-7; got '{item}'")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def train(
    out: Annotated[Path, typer.Option(help="Checkpoint to write (.safetensors).")],
    model: Annotated[str, typer.Option(help="builtin:small-cnn or builtin:mlp.")] = "builtin:small-cnn",
    method: Annotated[
        str,
        typer.Option(help=f"Objective: {', '.join(train_methods())} (VI methods also write a posterior)."),
    ] = "map",
    posterior_out: Annotated[
        Path | None,
        typer.Option(help="Posterior file of a VI method (default: OUT with -METHOD.safetensors)."),
    ] = None,
    setting: Annotated[
        list[str] | None,
        typer.Option("--set", help="VI hyperparameter NAME=VALUE (repeatable), e.g. --set kl_weight=2e-7."),
    ] = None,
    likelihood: Annotated[
        str,
        typer.Option(
            help="categorical (softmax, one class per input) or bernoulli (a sigmoid per class, "
            f"multi-label data y [N, K]; --method {' or '.join(train_methods('bernoulli'))})."
        ),
    ] = "categorical",
    data: Annotated[str, typer.Option(help="Training data spec.")] = "digits:train",
    val: Annotated[str | None, typer.Option(help="Validation data spec (default: the val split).")] = None,
    epochs: Annotated[int | None, typer.Option(min=1, help="Default: the method's.")] = None,
    lr: Annotated[
        float | None, typer.Option(parser=c.number("--lr", 0.0), help="Default: the method's.")
    ] = None,
    weight_decay: Annotated[
        float, typer.Option(parser=c.number("--weight-decay", 0.0))
    ] = TrainConfig.weight_decay,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Default: the method's.")] = None,
    data_root: c.DataRoot = Path("data"),
    download: c.Download = False,
    limit: c.Limit = None,
    ignore_index: c.IgnoreIndex = 255,
    num_workers: c.NumWorkers = 0,
    skip_unreadable: c.SkipUnreadable = False,
    device: c.Device = "auto",
    seed: c.Seed = 0,
    quiet: c.Quiet = False,
    as_json: c.Json = False,
) -> None:
    """Train a small builtin classifier (for demos and tests), by MAP or a VI objective.

    Example: bayescli train --model builtin:small-cnn --data digits:train --out model.safetensors

    Example: bayescli train --method mnvi --data digits:train --out mnvi-cnn.safetensors
    --set kl_weight=2e-7

    Example: bayescli train --likelihood bernoulli --data composed-digits:train --out multi.safetensors

    Example: bayescli train --model builtin:small-segnet --data seg:scenes.npz:train --out seg.safetensors
    """
    from bayescli.data import DataSpec, validation_spec
    from bayescli.data.registry import is_segmentation
    from bayescli.training.classifier import check_likelihood, save_checkpoint, train_classifier

    c.setup(quiet, as_json, seed)
    if out.suffix != ".safetensors":
        raise typer.BadParameter("checkpoints are written as .safetensors", param_hint="--out")
    if method not in train_methods():
        raise typer.BadParameter(f"choose one of {', '.join(train_methods())}", param_hint="--method")
    if method == "map" and setting:
        raise typer.BadParameter("--set applies to VI methods", param_hint="--set")
    if likelihood not in LIKELIHOODS:
        raise typer.BadParameter(f"choose one of {', '.join(LIKELIHOODS)}", param_hint="--likelihood")
    if method not in train_methods(likelihood):
        trains = " and ".join(method_entry(method).train_likelihoods)
        raise typer.BadParameter(
            f"--method {method} trains {trains} models only; use --method "
            f"{' or '.join(train_methods(likelihood))}",
            param_hint="--likelihood",
        )
    if posterior_out is not None and posterior_out.suffix != ".safetensors":
        raise typer.BadParameter("posterior files are .safetensors", param_hint="--posterior-out")
    if is_segmentation(data):
        if method != "map" or likelihood != "categorical":
            raise BayescliError(
                "segmentation data (seg:) trains by --method map with --likelihood categorical"
            )
        _train_segmentation(
            model,
            data,
            val,
            out,
            epochs,
            lr,
            weight_decay,
            batch_size,
            limit,
            ignore_index,
            device,
            seed,
            quiet,
            as_json,
        )
        return
    data_opts = c.data_options(
        data_root=data_root,
        download=download,
        limit=limit,
        seed=seed,
        num_workers=num_workers,
        skip_unreadable=skip_unreadable,
    )
    train_data = data_opts.load(data, None)
    val_spec = val or (validation_spec(data) if DataSpec.parse(data).split == "train" else None)
    val_data = data_opts.load(val_spec, None, limit=False) if val_spec else None
    for loaded in (train_data, val_data):
        if loaded is not None:
            # before any training: also guards the VI trainers, which are categorical
            check_likelihood(likelihood, loaded)
    given = {"epochs": epochs, "lr": lr, "batch_size": batch_size}
    given = {k: v for k, v in given.items() if v is not None}
    dev = c.resolve_device(device)
    post = None
    if method == "map":
        cfg = TrainConfig(**given, weight_decay=weight_decay, seed=seed)
        clf, meta = train_classifier(model, train_data, val_data, cfg, dev, likelihood)
    else:
        from bayescli.fitting.pipeline import load_setting_data
        from bayescli.fitting.registry import create_settings, parse_setting, train_function

        typed = {k: parse_setting(method, k, v) for k, v in parse_settings(setting or []).items()}
        vi_settings = create_settings(method, seed=seed, **given, **typed)
        vi_settings = load_setting_data(vi_settings, data_opts, None)
        clf, meta, post = train_function(method)(model, train_data, val_data, vi_settings, dev)
    save_checkpoint(out, clf.cpu(), meta)
    summary: dict = {"method": method, "likelihood": likelihood}
    if post is not None:
        from bayescli.fitting.pipeline import record_provenance
        from bayescli.models.specs import load_classifier

        post_path = posterior_out or out.with_name(f"{out.stem}-{method}.safetensors")
        record_provenance(post, load_classifier(model, out), train_data, val_data)
        post.save(post_path)
        summary |= {"posterior": str(post_path), **post.summary()}
    summary |= {
        "checkpoint": str(out),
        "model": model,
        "data": train_data.spec,
        "train_accuracy": meta["train_accuracy"],
        "val_accuracy": meta["val_accuracy"],
        **{k: meta[k] for k in ("train_subset_accuracy", "val_subset_accuracy") if k in meta},
        "final_loss": meta["train_loss"][-1],
    }
    c.show(
        quiet,
        as_json,
        c.table("trained", ["", "value"], [[k, v] for k, v in summary.items()]),
        payload=summary,
    )


def _train_segmentation(
    model: str,
    data: str,
    val: str | None,
    out: Path,
    epochs: int | None,
    lr: float | None,
    weight_decay: float,
    batch_size: int | None,
    limit: int | None,
    ignore_index: int,
    device: str,
    seed: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """``train`` on ``seg:`` data: a MAP segmentation net (:mod:`bayescli.training.segmentation`)."""
    from bayescli.data import DataSpec, validation_spec
    from bayescli.data.registry import is_segmentation, load_segmentation
    from bayescli.training.classifier import save_checkpoint
    from bayescli.training.segmentation import train_segmenter

    ignore = None if ignore_index < 0 else ignore_index
    train_data = load_segmentation(data, ignore, limit, seed)
    val_spec = val or (validation_spec(data) if DataSpec.parse(data).split == "train" else None)
    if val_spec is not None and not is_segmentation(val_spec):
        raise BayescliError(f"--val {val_spec} is not segmentation data; pass seg:FILE.npz")
    val_data = load_segmentation(val_spec, ignore) if val_spec else None
    given = {"epochs": epochs, "lr": lr, "batch_size": batch_size}
    cfg = TrainConfig(
        **{k: v for k, v in given.items() if v is not None}, weight_decay=weight_decay, seed=seed
    )
    clf, meta = train_segmenter(model, train_data, val_data, cfg, c.resolve_device(device))
    save_checkpoint(out, clf.cpu(), meta)
    summary = {
        "method": "map",
        "task": meta["task"],
        "checkpoint": str(out),
        "model": model,
        "data": train_data.spec,
        "num_classes": meta["num_classes"],
        "ignore_index": ignore,
        "train_pixel_accuracy": meta["train_accuracy"],
        "val_pixel_accuracy": meta["val_accuracy"],
        "final_loss": meta["train_loss"][-1],
    }
    c.show(
        quiet,
        as_json,
        c.table("trained", ["", "value"], [[k, v] for k, v in summary.items()]),
        payload=summary,
    )
