"""``bayescli train``: train a builtin model and write a safetensors checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bayescli.cli import common as c
from bayescli.options import TrainConfig


def train(
    out: Annotated[Path, typer.Option(help="Checkpoint to write (.safetensors).")],
    model: Annotated[str, typer.Option(help="builtin:small-cnn or builtin:mlp.")] = "builtin:small-cnn",
    data: Annotated[str, typer.Option(help="Training data spec.")] = "digits:train",
    val: Annotated[str | None, typer.Option(help="Validation data spec (default: the val split).")] = None,
    epochs: Annotated[int, typer.Option(min=1)] = TrainConfig.epochs,
    lr: Annotated[float, typer.Option(min=0.0)] = TrainConfig.lr,
    weight_decay: Annotated[float, typer.Option(min=0.0)] = TrainConfig.weight_decay,
    batch_size: c.BatchSize = TrainConfig.batch_size,
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
    """Train a small builtin classifier (for demos and tests).

    Example: bayescli train --model builtin:small-cnn --data digits:train --out model.safetensors
    """
    from bayescli.data import DataSpec, validation_spec
    from bayescli.train import save_checkpoint, train_classifier

    c.setup(quiet, as_json, seed)
    if out.suffix != ".safetensors":
        raise typer.BadParameter("checkpoints are written as .safetensors", param_hint="--out")
    train_data = c.load(data, data_root, download, limit, seed, None, num_workers, skip_unreadable)
    val_spec = val or (validation_spec(data) if DataSpec.parse(data).split == "train" else None)
    val_data = (
        c.load(val_spec, data_root, download, None, seed, None, num_workers, skip_unreadable)
        if val_spec
        else None
    )
    cfg = TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, weight_decay=weight_decay, seed=seed)
    clf, meta = train_classifier(model, train_data, val_data, cfg, c.resolve_device(device))
    save_checkpoint(out, clf.cpu(), meta)
    summary = {
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
