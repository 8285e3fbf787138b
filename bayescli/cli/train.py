"""``bayescli train``: train a builtin model and write a safetensors checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bayescli.cli import common as c
from bayescli.errors import BayescliError
from bayescli.options import TrainConfig, VIMethod

TRAIN_METHODS = ["map", *(m.value for m in VIMethod)]


def parse_settings(items: list[str]) -> dict[str, str]:
    """``["kl_weight=2e-7", "family=ensemble"]`` → ``{"kl_weight": "2e-7", ...}``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BayescliError(f"--set takes NAME=VALUE, e.g. --set kl_weight=2e-7; got '{item}'")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def typed_settings(config: type, settings: dict[str, str]) -> dict[str, object]:
    """Convert ``--set`` strings to the types of ``config``'s fields (bool, int, float or str)."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(config)}
    out: dict[str, object] = {}
    for key, text in settings.items():
        if key not in fields:
            raise BayescliError(
                f"--set {key}: {config.__name__} has no such setting; "
                f"choose from {', '.join(sorted(fields))}"
            )
        # The declared type (a string under postponed annotations) decides, not the default,
        # which may be None ("use the method's default").
        declared = str(fields[key].type)
        kind = next((t for t in ("bool", "int", "float") if t in declared.replace("|", " ").split()), "str")
        try:
            if text.lower() == "none" and "None" in declared:
                out[key] = None
            elif kind == "bool":
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[key] = text.lower() in ("true", "1")
            elif kind == "int":
                out[key] = int(text)
            elif kind == "float":
                out[key] = float(text)
            else:
                out[key] = text
        except ValueError:
            raise BayescliError(f"--set {key}={text}: expected a {kind}") from None
    return out


def train(
    out: Annotated[Path, typer.Option(help="Checkpoint to write (.safetensors).")],
    model: Annotated[str, typer.Option(help="builtin:small-cnn or builtin:mlp.")] = "builtin:small-cnn",
    method: Annotated[
        str, typer.Option(help=f"Objective: {', '.join(TRAIN_METHODS)} (VI methods also write a posterior).")
    ] = "map",
    posterior_out: Annotated[
        Path | None,
        typer.Option(help="Posterior file of a VI method (default: OUT with -METHOD.safetensors)."),
    ] = None,
    setting: Annotated[
        list[str] | None,
        typer.Option("--set", help="VI hyperparameter NAME=VALUE (repeatable), e.g. --set kl_weight=2e-7."),
    ] = None,
    data: Annotated[str, typer.Option(help="Training data spec.")] = "digits:train",
    val: Annotated[str | None, typer.Option(help="Validation data spec (default: the val split).")] = None,
    epochs: Annotated[int | None, typer.Option(min=1, help="Default: the method's.")] = None,
    lr: Annotated[float | None, typer.Option(min=0.0, help="Default: the method's.")] = None,
    weight_decay: Annotated[float, typer.Option(min=0.0)] = TrainConfig.weight_decay,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Default: the method's.")] = None,
    data_root: c.DataRoot = Path("data"),
    download: c.Download = False,
    limit: c.Limit = None,
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
    """
    from bayescli.data import DataSpec, validation_spec
    from bayescli.train import save_checkpoint, train_classifier

    c.setup(quiet, as_json, seed)
    if out.suffix != ".safetensors":
        raise typer.BadParameter("checkpoints are written as .safetensors", param_hint="--out")
    if method not in TRAIN_METHODS:
        raise typer.BadParameter(f"choose one of {', '.join(TRAIN_METHODS)}", param_hint="--method")
    if method == "map" and setting:
        raise typer.BadParameter("--set applies to VI methods", param_hint="--set")
    if posterior_out is not None and posterior_out.suffix != ".safetensors":
        raise typer.BadParameter("posterior files are .safetensors", param_hint="--posterior-out")
    train_data = c.load(data, data_root, download, limit, seed, None, num_workers, skip_unreadable)
    val_spec = val or (validation_spec(data) if DataSpec.parse(data).split == "train" else None)
    val_data = (
        c.load(val_spec, data_root, download, None, seed, None, num_workers, skip_unreadable)
        if val_spec
        else None
    )
    given = {"epochs": epochs, "lr": lr, "batch_size": batch_size}
    given = {k: v for k, v in given.items() if v is not None}
    dev = c.resolve_device(device)
    post = None
    if method == "map":
        cfg = TrainConfig(**given, weight_decay=weight_decay, seed=seed)
        clf, meta = train_classifier(model, train_data, val_data, cfg, dev)
    else:
        from bayescli.cli.fit_vi import vi_method

        entry = vi_method(VIMethod(method))
        settings = {"seed": seed, **given, **typed_settings(entry.config, parse_settings(setting or []))}
        vi_cfg = entry.config(**settings)
        clf, meta, post = entry.train(model, train_data, val_data, vi_cfg, dev)
    save_checkpoint(out, clf.cpu(), meta)
    summary: dict = {"method": method}
    if post is not None:
        from bayescli.models import load_classifier

        post_path = posterior_out or out.with_name(f"{out.stem}-{method}.safetensors")
        c.record_provenance(post, load_classifier(model, out), train_data)
        post.save(post_path)
        summary |= {"posterior": str(post_path), **post.summary()}
    summary |= {
        "checkpoint": str(out),
        "model": model,
        "data": train_data.spec,
        "train_accuracy": meta["train_accuracy"],
        "val_accuracy": meta["val_accuracy"],
        "final_loss": meta["train_loss"][-1],
    }
    c.show(
        quiet,
        as_json,
        c.table("trained", ["", "value"], [[k, v] for k, v in summary.items()]),
        payload=summary,
    )
