"""``bayescli inspect``: how a checkpoint is read, before anything is fitted on it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from bayescli.cli import common as c


def flatten(info: dict, prefix: str = "") -> list[list[Any]]:
    """``{"a": {"b": 1}}`` → ``[["a.b", 1]]``: nested facts as table rows (lists joined)."""
    rows: list[list[Any]] = []
    for key, value in info.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows += flatten(value, f"{name}.")
        elif isinstance(value, list | tuple):
            rows.append([name, ", ".join(str(v) for v in value) if value else "—"])
        elif value != {}:
            rows.append([name, value])
    return rows


def inspect_cmd(
    model: Annotated[
        str, typer.Option(help="timm:NAME, torchvision:NAME, builtin:NAME, hf:FOLDER or py:module:factory.")
    ],
    checkpoint: Annotated[
        Path | None,
        typer.Option(help="The checkpoint as saved (not needed for hf:FOLDER)."),
    ] = None,
    data: Annotated[
        str | None, typer.Option(help="Optional data spec: adds the MAP accuracy and the output check.")
    ] = None,
    head: c.Head = None,
    model_args: c.ModelArg = None,
    output: c.Output = None,
    checkpoint_key: c.CheckpointKey = None,
    preprocess: c.PreprocessOpt = None,
    mean: c.Mean = None,
    std: c.Std = None,
    resize: c.Resize = None,
    crop: c.Crop = None,
    interpolation: c.InterpolationOpt = None,
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
    """Show what bayescli reads from a checkpoint: format, container entry, prefixes mapped, factory
    arguments and hyper-parameters used, head, feature dimension, class count, output kind and
    preprocessing; with --data also the MAP accuracy (and the low-accuracy warning). Every fit
    records the same facts in its posterior file.

    A segmentation model (a checkpoint `bayescli train` wrote on seg: data, or any model with --data
    seg:FILE.npz) is described as a dense per-pixel classifier: its 1×1-conv head, K, C and whether the
    head's output reaches the logits through upsampling/cropping only (the split check).

    Example: bayescli inspect --model py:mynet:Net --checkpoint lightning.ckpt --data mnist:test --limit 500

    Example: bayescli inspect --model builtin:small-segnet --checkpoint seg.safetensors --data seg:test.npz
    """
    from bayescli.data.registry import is_segmentation
    from bayescli.metrics.classification import low_accuracy_warning
    from bayescli.models.features import FeatureStream
    from bayescli.models.specs import load_classifier

    c.setup(quiet, as_json, seed)
    dev = c.resolve_device(device)
    pre = c.preprocess_from_options(preprocess, model, mean, std, resize, crop, interpolation)
    loaded = load_classifier(
        model,
        checkpoint,
        head,
        checkpoint_key=checkpoint_key,
        preprocess=pre,
        model_args=model_args or [],
        output=output,
    )
    loaded.precision = precision or loaded.precision
    seen: dict[str, Any] = {}
    if is_segmentation(data) or (data is None and loaded.metadata.get("task") == "segmentation"):
        from bayescli.data.registry import load_segmentation
        from bayescli.fitting.dense import inspect_dense

        ignore = None if ignore_index < 0 else ignore_index
        seg = None if data is None else load_segmentation(data, ignore, limit, seed)
        facts = inspect_dense(loaded, seg, dev, seed)
        if facts["dense"]["split_check"].startswith("failed"):
            c.warn(facts["dense"]["split_check"])
        info = {**loaded.describe(), **facts, "class_names": loaded.class_names}
        for key in (
            "head",
            "head_kind",
            "feature_dim",
            "num_classes",
            "output",
            "output_kind",
            "last_layer_exact",
        ):
            info.pop(key, None)  # the classification view of the head: the dense block replaces it
        names = info.pop("class_names")
        rows = flatten(info) + [["class_names", ", ".join(names)]]
        c.show(
            quiet, as_json, c.table(f"{model}", ["", "value"], rows), payload={**info, "class_names": names}
        )
        return
    if data is not None:
        opts = c.data_options(
            data_root=data_root,
            download=download,
            limit=limit,
            seed=seed,
            num_workers=num_workers,
            skip_unreadable=skip_unreadable,
        )
        test = opts.load(data, loaded.preprocess)
        c.check_labels(test, loaded.classifier.num_classes, loaded.likelihood)
        stream = FeatureStream(loaded, test, batch_size, dev, whole_network=True)
        for _ in stream:  # the first batch checks the head split and the output kind
            pass
        seen = {"data": data, "inputs": stream.n, "precision": stream.precision.value}
        if not loaded.classifier.last_layer_exact:
            c.warn("the logits are not linear in the head's weights: only --subset all methods apply")
        if stream.accuracy is not None:
            seen["map_accuracy"] = stream.accuracy
            multilabel = loaded.likelihood == "bernoulli"
            c.warn(low_accuracy_warning(stream.accuracy, loaded.classifier.num_classes, data, multilabel))
    # described after the pass: the output kind is only known once the network has run
    info: dict[str, Any] = {**loaded.describe(), "class_names": loaded.class_names, **seen}
    names = info.pop("class_names")
    rows = flatten(info)
    rows.append(["class_names", ", ".join(names[:10]) + (f", … ({len(names)})" if len(names) > 10 else "")])
    c.show(quiet, as_json, c.table(f"{model}", ["", "value"], rows), payload={**info, "class_names": names})
