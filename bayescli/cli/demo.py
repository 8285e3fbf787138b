"""``bayescli demo``: the whole pipeline on the bundled digits data."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bayescli.cli import common as c
from bayescli.features import extract_features
from bayescli.metrics import classification_summary
from bayescli.models import load_classifier
from bayescli.train import TrainConfig, save_checkpoint, train_classifier


def demo(
    out_dir: Annotated[Path, typer.Option(help="Where checkpoint, posterior and reports go.")] = Path("demo-output"),
    device: c.Device = "auto",
    seed: c.Seed = 0,
    quiet: c.Quiet = False,
    as_json: c.Json = False,
) -> None:
    """Train a small CNN on digits, then run the pipeline on the test split.

    Example: bayescli demo --out-dir demo-output
    """
    c.setup(quiet, as_json, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = c.device_of(device)
    train_data = c.load("digits:train", Path("data"), False, None, seed)
    val_data = c.load("digits:val", Path("data"), False, None, seed)
    test_data = c.load("digits:test", Path("data"), False, None, seed)
    ckpt = out_dir / "model.safetensors"
    clf, meta = train_classifier("builtin:small-cnn", train_data, val_data, TrainConfig(seed=seed), dev)
    save_checkpoint(ckpt, clf.cpu(), meta)
    model = load_classifier("builtin:small-cnn", ckpt)
    feats = extract_features(model, test_data, device=dev)
    probs = feats.logits.softmax(-1)
    results = {"map": classification_summary(probs, feats.labels)}
    payload = {"checkpoint": str(ckpt), "test": test_data.info, "results": results}
    c.show(quiet, as_json, c.metrics_table(f"digits test ({len(test_data)} inputs)", results), payload=payload)
