"""Options shared by the subcommands, output helpers and process-wide CLI state."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from bayescli import progress
from bayescli.errors import AllRanksError, BayescliError
from bayescli.options import Interpolation, Precision, PreprocessPreset

if TYPE_CHECKING:  # the library is imported inside the functions: `--help` must not load torch
    import torch

    from bayescli.data import Data
    from bayescli.fitting.pipeline import DataOptions, ModelOptions
    from bayescli.models.preprocess import Preprocess
    from bayescli.models.specs import LoadedModel
    from bayescli.posterior.base import Posterior

# Wide enough for the metric tables when stdout is a file or pipe (rich would use 80 columns).
stdout = Console(width=None if sys.stdout.isatty() else 160)
state = {"debug": False}

Device = Annotated[
    str, typer.Option(help="auto (CUDA when available), cpu, cuda or cuda:N.", rich_help_panel="Runtime")
]
PrecisionOpt = Annotated[
    Precision | None,
    typer.Option(
        "--precision",
        help="Arithmetic of the backbone's feature pass: fp32, bf16 or fp16 (CUDA only); bf16/fp16 run "
        "it under autocast (conv nets channels_last), the head and posterior maths stay float32/64. "
        "Default: fp32 for a fit, the precision the posterior was fitted at for a prediction.",
        rich_help_panel="Runtime",
    ),
]
Seed = Annotated[
    int, typer.Option(help="Random seed (subsets, sampling, training).", rich_help_panel="Runtime")
]
BatchSize = Annotated[int, typer.Option(min=1, help="Inputs per batch.", rich_help_panel="Runtime")]
Quiet = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress bars or tables.", rich_help_panel="Runtime")
]
Json = Annotated[
    bool,
    typer.Option(
        "--json", help="Print a machine-readable JSON summary on stdout.", rich_help_panel="Runtime"
    ),
]
DataRoot = Annotated[Path, typer.Option(help="Where torchvision datasets live.", rich_help_panel="Data")]
Download = Annotated[
    bool, typer.Option("--download", help="Download torchvision datasets if missing.", rich_help_panel="Data")
]
Limit = Annotated[
    int | None, typer.Option(min=1, help="Use a seeded random subset of N inputs.", rich_help_panel="Data")
]
IgnoreIndex = Annotated[
    int,
    typer.Option(
        min=-1,
        help="Mask value of pixels no loss, curvature or metric counts (seg: data; -1: none).",
        rich_help_panel="Data",
    ),
]
NumWorkers = Annotated[
    int,
    typer.Option(
        min=0,
        help="DataLoader processes that read, decode and resize images (0: none).",
        rich_help_panel="Data",
    ),
]
SkipUnreadable = Annotated[
    bool,
    typer.Option(
        "--skip-unreadable",
        help="Skip image files that cannot be decoded (counted and listed in the output); "
        "default: stop, naming the file.",
        rich_help_panel="Data",
    ),
]
CheckpointOverride = Annotated[
    Path | None, typer.Option(help="Override the checkpoint path recorded in the posterior.")
]
PreprocessOpt = Annotated[
    PreprocessPreset | None,
    typer.Option(
        "--preprocess",
        help="Input recipe: timm / torchvision (the named model's pretrained config), imagenet, cifar, "
        "none. Default: the checkpoint's own (bayescli train) or none.",
        rich_help_panel="Preprocessing",
    ),
]
PredictPreprocessOpt = Annotated[
    PreprocessPreset | None,
    typer.Option(
        "--preprocess",
        help="Replace the input recipe recorded in the posterior (timm, torchvision, imagenet, cifar, "
        "none); --mean/--std/--resize/--crop/--interpolation change single parts of it, e.g. "
        "--resize 28 for images of another size. Recorded in the output.",
        rich_help_panel="Preprocessing",
    ),
]
Mean = Annotated[
    str | None,
    typer.Option(
        help="Per-channel mean, e.g. 0.485,0.456,0.406 (overrides).", rich_help_panel="Preprocessing"
    ),
]
Std = Annotated[
    str | None,
    typer.Option(
        help="Per-channel std, e.g. 0.229,0.224,0.225 (overrides).", rich_help_panel="Preprocessing"
    ),
]
Resize = Annotated[
    int | None,
    typer.Option(
        min=1, help="Resize the shorter side to N px (aspect kept).", rich_help_panel="Preprocessing"
    ),
]
Crop = Annotated[
    int | None,
    typer.Option(min=1, help="Centre-crop N×N px after resizing.", rich_help_panel="Preprocessing"),
]
InterpolationOpt = Annotated[
    Interpolation | None,
    typer.Option("--interpolation", help="Resize filter.", rich_help_panel="Preprocessing"),
]
CheckpointKey = Annotated[
    str | None,
    typer.Option(
        help="Entry of a wrapped checkpoint holding the weights, e.g. state_dict or ema.",
        rich_help_panel="Model",
    ),
]
Head = Annotated[
    str | None,
    typer.Option(
        help="Name of the classification head: a linear layer or a 1×1 convolution before global "
        "pooling (default: found by get_classifier()/classifier/fc/head, else the last linear layer).",
        rich_help_panel="Model",
    ),
]
ModelArg = Annotated[
    list[str] | None,
    typer.Option(
        "--model-arg",
        help="NAME=VALUE passed to the model factory (repeatable; typed by its signature, else JSON), "
        "e.g. --model-arg hidden=64.",
        rich_help_panel="Model",
    ),
]
Output = Annotated[
    str | None,
    typer.Option(
        "--output",
        help="Which element of a tuple/list/dict/dataclass output holds the logits (index or key); "
        "default: the one tensor with one column per class.",
        rich_help_panel="Model",
    ),
]
Likelihood = Annotated[
    str | None,
    typer.Option(
        "--likelihood",
        help="What the checkpoint was trained with: categorical (softmax) or bernoulli (a sigmoid per "
        "class, multi-label); default: what the checkpoint records, else categorical.",
        rich_help_panel="Model",
    ),
]
ConfirmModel = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="The model spec the posterior names; required to import py: code a file names "
        "(a file never chooses code to run by itself).",
    ),
]
TrustModelCode = Annotated[
    bool,
    typer.Option(
        "--trust-model-code",
        help="Import the py: model code named in the posterior file without --model (only for files "
        "you trust).",
    ),
]


def is_main_process() -> bool:
    """Rank 0 under torchrun (read from the launcher's environment), or a plain process."""
    import os

    return os.environ.get("RANK", "0") == "0"


def setup(quiet: bool, as_json: bool, seed: int | None = None) -> None:
    """Apply the common options: progress bars off for --quiet/--json and on ranks > 0, seed torch."""
    progress.set_enabled(not (quiet or as_json) and is_main_process())
    if seed is not None:
        import torch

        torch.manual_seed(seed)


def load(
    spec: str,
    root: Path,
    download: bool,
    limit: int | None,
    seed: int,
    preprocess: Preprocess | None = None,
    num_workers: int = 0,
    skip_unreadable: bool = False,
) -> Data:
    from bayescli.data import load_data

    return load_data(
        spec,
        root=root,
        download=download,
        limit=limit,
        seed=seed,
        preprocess=preprocess,
        num_workers=num_workers,
        skip_unreadable=skip_unreadable,
    )


def preprocess_from_options(
    preset: PreprocessPreset | None,
    model: str,
    mean: str | None,
    std: str | None,
    resize: int | None,
    crop: int | None,
    interpolation: Interpolation | None,
) -> Preprocess | None:
    """The input recipe given by ``--preprocess`` and its overrides (``None``: the checkpoint's)."""
    from bayescli.models.preprocess import resolve_preprocess

    return resolve_preprocess(
        preset, model, floats(mean, "--mean"), floats(std, "--std"), resize, crop, interpolation
    )


def preprocess_overrides(
    preset: PreprocessPreset | None,
    mean: str | None,
    std: str | None,
    resize: int | None,
    crop: int | None,
    interpolation: Interpolation | None,
) -> Any:
    """The prediction-time changes to a posterior's recorded recipe (a
    :class:`~bayescli.models.preprocess.PreprocessOverrides`, falsy when none was asked for)."""
    from bayescli.models.preprocess import PreprocessOverrides

    return PreprocessOverrides(
        preset, floats(mean, "--mean"), floats(std, "--std"), resize, crop, interpolation
    )


def preprocess_record(model: LoadedModel, overrides: Any) -> dict:
    """What a prediction report says about its inputs' recipe: the one used and, when asked for,
    the overrides of the posterior's recorded one."""
    record = {"preprocess": model.preprocess.to_meta()}
    if overrides:
        record["preprocess_overrides"] = overrides.to_meta()
    return record


def data_options(
    *,
    data_root: Path,
    download: bool,
    limit: int | None = None,
    seed: int = 0,
    num_workers: int = 0,
    skip_unreadable: bool = False,
) -> DataOptions:
    """The data option group (``--data-root``, ``--download``, ``--limit``, …) as one object."""
    from bayescli.fitting.pipeline import DataOptions

    return DataOptions(data_root, download, limit, seed, num_workers, skip_unreadable)


def model_options(
    *,
    model: str,
    checkpoint: Path | None,
    head: str | None = None,
    checkpoint_key: str | None = None,
    model_args: list[str] | None = None,
    output: str | None = None,
    preprocess: Preprocess | None = None,
    likelihood: str | None = None,
    precision: Precision | None = None,
) -> ModelOptions:
    """The model option group (``--model``, ``--checkpoint``, ``--head``, …) as one object
    (``precision`` ``None``: fp32, a fit's default)."""
    from bayescli.fitting.pipeline import ModelOptions

    return ModelOptions(
        model,
        checkpoint,
        head,
        checkpoint_key,
        list(model_args or []),
        output,
        preprocess,
        likelihood,
        precision or Precision.FP32,
    )


def option_groups(params: dict[str, Any]) -> tuple[ModelOptions, DataOptions]:
    """The model option group (with the preprocessing options) and the data option group, read by
    name from a command's parameters (``typer.Context.params``): the options are declared once
    here and every fitting command passes them on the same way."""
    pre = preprocess_from_options(
        params["preprocess"],
        params["model"],
        params["mean"],
        params["std"],
        params["resize"],
        params["crop"],
        params["interpolation"],
    )
    models = model_options(
        model=params["model"],
        checkpoint=params["checkpoint"],
        head=params["head"],
        checkpoint_key=params["checkpoint_key"],
        model_args=params["model_args"],
        output=params["output"],
        preprocess=pre,
        likelihood=params.get("likelihood"),
        precision=params.get("precision"),
    )
    data = data_options(
        data_root=params["data_root"],
        download=params["download"],
        limit=params["limit"],
        seed=params["seed"],
        num_workers=params["num_workers"],
        skip_unreadable=params["skip_unreadable"],
    )
    return models, data


def model_facts(loaded: LoadedModel) -> dict:
    """What a fit summary says about how the checkpoint was read: the head, a non-default output
    (selected element, log-probabilities), and the format, container, prefixes and arguments."""
    clf = loaded.classifier.describe()
    facts = {"head": clf["head"]}
    if clf["head_kind"] != "linear":
        facts["head_kind"] = clf["head_kind"]
    if clf["output"] is not None:
        facts["output"] = clf["output"]
    if clf["output_kind"] not in (None, "logits"):
        facts["output_kind"] = clf["output_kind"]
    return facts | {k: v for k, v in loaded.source.items() if v}


def floats(text: str | None, option: str) -> tuple[float, ...] | None:
    """``"0.5,1/255"`` → ``(0.5, 0.00392…)`` (numbers or fractions); a clear error otherwise."""
    from bayescli.numbers import parse_numbers

    return None if text is None else parse_numbers(text, option)


def number(option: str, lo: float | None = None, hi: float | None = None) -> Callable[[str | float], float]:
    """A Typer ``parser=`` for a float option that also takes fractions (``1/255``), as every number
    the CLI reads does, with the bounds ``[lo, hi]`` (Typer ignores ``min``/``max`` once a parser is
    given). Bad values exit 2 with a usage line naming the option."""
    from bayescli.numbers import parse_number

    def parse(text: str | float) -> float:
        try:
            value = parse_number(text, option)
        except BayescliError as exc:
            raise typer.BadParameter(str(exc)) from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            low, high = ("-inf" if lo is None else f"{lo:g}"), ("inf" if hi is None else f"{hi:g}")
            raise typer.BadParameter(f"{option} must be within [{low}, {high}]; got {text}")
        return value

    parse.__name__ = "number"  # the metavar --help shows
    return parse


def check_labels(data: Data, num_classes: int, likelihood: str = "categorical") -> None:
    """Raise if ``data``'s labels do not fit a ``num_classes``-way classifier of ``likelihood``."""
    from bayescli.fitting.pipeline import check_labels as check

    check(data, num_classes, likelihood)


# why a command refuses multi-label (bernoulli) classifiers, where it is not a missing feature
SOFTMAX_ONLY_REASONS = {
    "topk": "top-k sets rank the classes of one label, a single-label notion; for multi-label "
    "posteriors use `bayescli conformal` (per-label sets) or `bayescli predict`",
}


def prepare_prediction(
    posterior: Path,
    checkpoint: Path | None,
    data: str,
    root: Path,
    download: bool,
    limit: int | None,
    seed: int,
    batch_size: int,
    device: str,
    num_workers: int = 0,
    skip_unreadable: bool = False,
    *,
    model: str | None = None,
    trust_model_code: bool = False,
    softmax_only: str | None = None,
    preprocess: Any = None,
    precision: Precision | None = None,
):
    """Load a posterior, its model (hash-verified) and the data, and extract features once; the
    posterior, the network and the features all sit on ``device`` afterwards. ``model`` confirms
    the spec the file names (needed for ``py:`` code, see :func:`bayescli.models.args.check_file_spec`).
    ``softmax_only`` names a command that refuses multi-label (bernoulli) models. ``precision``
    of the feature pass (``None``: the one the posterior was fitted at). Labelled data with a low
    MAP accuracy prints a warning. ``preprocess`` (:func:`preprocess_overrides`) changes the
    recorded input recipe."""
    from bayescli.models.features import (
        check_precision,
        extract_features,
        require_last_layer_precision,
        resolve_precision,
    )
    from bayescli.posterior.base import load_posterior

    dev = resolve_device(device)
    post = load_posterior(posterior, dev)
    chosen = check_precision(resolve_precision(precision, post.meta), dev)
    if post.needs_inputs:
        require_last_layer_precision(chosen, f"{post.method} with subset '{post.subset.value}'")
    model = post.load_model(checkpoint, model=model, trust_model_code=trust_model_code, preprocess=preprocess)
    model.precision = chosen
    if softmax_only is not None:
        model.require_categorical(softmax_only, SOFTMAX_ONLY_REASONS.get(softmax_only))
    test = load(data, root, download, limit, seed, model.preprocess, num_workers, skip_unreadable)
    check_labels(test, model.classifier.num_classes, post.likelihood)
    feats = extract_features(model, test, batch_size, dev, whole_network=post.needs_inputs)
    warn_low_accuracy(feats.logits, feats.labels, f"the data {test.spec}")
    return post, model, test, feats


def posterior_summary(post: Posterior) -> dict:
    """The posterior facts every report repeats."""
    keys = ("model", "checkpoint", "checkpoint_sha256", "data", "num_classes")
    return {
        "method": post.method,
        "subset": post.subset.value,
        **post.summary(),
        **{k: post.meta.get(k) for k in keys},
    }


def tagged_posteriors(posts: list[Posterior], paths: list[Path]) -> dict[str, Posterior]:
    """Posteriors keyed by their file stems (made unique), after checking they share one checkpoint."""
    first = posts[0].meta
    for post, path in zip(posts, paths, strict=True):
        for key in ("model", "checkpoint_sha256"):
            if post.meta.get(key) != first.get(key):
                raise BayescliError(
                    f"{path} belongs to a different model ({key} {post.meta.get(key)!r} vs "
                    f"{first.get(key)!r} in {paths[0]}); compare posteriors of one checkpoint"
                )
    return dict(zip(file_tags(paths, [post.method for post in posts]), posts, strict=True))


def file_tags(paths: list[Path], fallbacks: list[str]) -> list[str]:
    """One tag per posterior file: its stem made safe (``fallbacks`` where nothing is left), with
    ``-2``, ``-3`` … where stems repeat. Method names in reports are ``TAG/method``."""
    import re

    tags: list[str] = []
    for path, fallback in zip(paths, fallbacks, strict=True):
        base = re.sub(r"[^A-Za-z0-9_-]+", "-", path.stem) or fallback
        tag, n = base, 1
        while tag in tags:
            n += 1
            tag = f"{base}-{n}"
        tags.append(tag)
    return tags


def warn(message: str | None) -> None:
    """Print a one-line warning on stderr (kept off stdout, which --json reserves), on rank 0."""
    if message and is_main_process():
        typer.echo(f"warning: {message}", err=True)


def library_warnings(fallback: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints each distinct :class:`~bayescli.errors.BayescliWarning`
    once as a ``warning:`` line (so a resize warning shows once per command, however many sets are
    loaded) and hands other warnings to ``fallback``. :class:`~bayescli.errors.LowAccuracyWarning`
    is dropped: the commands print their own, naming the role of the data (fitting, test)."""
    from bayescli.errors import BayescliWarning, LowAccuracyWarning

    shown: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if not issubclass(category, BayescliWarning):
            fallback(message, category, filename, lineno, file, line)
        elif not issubclass(category, LowAccuracyWarning) and str(message) not in shown:
            shown.add(str(message))
            warn(str(message))

    return show


@contextmanager
def low_accuracy_seen() -> Iterator[list]:
    """Collect the :class:`~bayescli.errors.LowAccuracyWarning` s issued inside the block (their
    ``accuracy`` and ``spec``) instead of showing them; other warnings pass through."""
    import warnings

    from bayescli.errors import LowAccuracyWarning

    seen: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("always", LowAccuracyWarning)
        outer = warnings.showwarning

        def show(message, category, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
            if issubclass(category, LowAccuracyWarning):
                seen.append(message)
            else:
                outer(message, category, *args, **kwargs)

        warnings.showwarning = show
        yield seen


def low_accuracy(logits: torch.Tensor, labels: torch.Tensor | None, where: str = "the data") -> str | None:
    """The low-MAP-accuracy warning for ``logits [N, K]``, ``labels [N]`` or multi-label ``[N, K]``
    (``None``: fine, or no labels)."""
    from bayescli.metrics.classification import low_accuracy_warning, map_correct

    if labels is None or not len(labels):
        return None
    accuracy = map_correct(logits, labels).mean().item()
    return low_accuracy_warning(accuracy, logits.shape[-1], where, multilabel=labels.dim() == 2)


def warn_low_accuracy(logits: torch.Tensor, labels: torch.Tensor | None, where: str) -> None:
    """Print :func:`low_accuracy`'s warning, if any (``where`` names the data and its role)."""
    warn(low_accuracy(logits, labels, where))


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.3e}"
    return "—" if value is None else str(value)


def table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*[fmt(v) for v in r])
    return t


def metrics_table(title: str, results: dict[str, dict[str, float]]) -> Table:
    """Rows = methods, columns = the union of metric names."""
    names: list[str] = []
    for m in results.values():
        names += [k for k in m if k not in names]
    return table(
        title, ["method", *names], [[method, *(m.get(n) for n in names)] for method, m in results.items()]
    )


def show(quiet: bool, as_json: bool, *renderables: Any, payload: Any = None) -> None:
    """Print tables unless quiet; with --json print ``payload`` as JSON instead (rank 0 only)."""
    if not is_main_process():
        return
    if as_json:
        from bayescli.io import to_json

        typer.echo(to_json(payload))
    elif not quiet:
        for r in renderables:
            stdout.print(r)


def resolve_device(spec: str, sharded: bool = False) -> torch.device:
    """``--device`` → a ``torch.device``, resolved once per command.

    Commands that share their work across torchrun's processes (``sharded=True``: fit-laplace,
    evaluate) join the process group here, explicitly, through :func:`bayescli.distributed.init`
    (each process gets ``cuda:LOCAL_RANK``); the others refuse to run on several processes rather
    than repeat their work on each.
    """
    from bayescli import distributed
    from bayescli.devices import resolve_device as resolve

    if sharded:
        return distributed.init(spec)
    if distributed.is_distributed():
        raise AllRanksError(
            "this command runs in one process; start it without torchrun "
            "(fit-laplace and evaluate share their work across torchrun's processes)"
        )
    return resolve(spec)
