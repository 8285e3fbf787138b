"""Load → features → fit → tune → provenance → save, as one library call.

``fit-laplace``, ``fit-vi``, ``train --method``, ``demo``, ``select``, the Python API, the tests'
fixtures and the benchmarks all fit through :func:`fit_posterior` (an in-memory
:class:`~bayescli.fitting.fit_source.FitSource`) or :func:`fit_from_specs` (specs and files, sharded under
``torchrun``, written atomically). Held-out data comes from, in order: an explicit validation
spec; ``val_split`` (a seeded fraction carved from fitting data the net never saw); the validation
split a ``bayescli train`` checkpoint records, when disjoint from the fitting data. Without any,
each method keeps its principled default and the posterior says that nothing was validated.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bayescli import parallel
from bayescli.data import Data, load_data, validation_spec
from bayescli.errors import LowAccuracyWarning, require
from bayescli.fitting.fit_source import FitSource
from bayescli.fitting.registry import create_settings, fit_function, method_entry, sharding
from bayescli.metrics.classification import low_accuracy_warning
from bayescli.models.features import check_precision, parse_precision, require_last_layer_precision
from bayescli.models.preprocess import Preprocess
from bayescli.models.specs import LoadedModel, load_classifier
from bayescli.options import Precision, Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.selection import FIXED, Selection

NOT_VALIDATED = (
    "nothing was validated: no held-out data, so each hyperparameter is the method's principled "
    "default; pass validation data (--val-data, or --val-split for fitting data the net never saw)"
)


@dataclass
class DataOptions:
    """Where data specs are read from (the CLI's data option group)."""

    root: Path = Path("data")
    download: bool = False
    limit: int | None = None
    seed: int = 0
    num_workers: int = 0
    skip_unreadable: bool = False

    def load(self, spec: str, preprocess: Preprocess | None, *, limit: bool = True) -> Data:
        """Read ``spec`` with this model's ``preprocess`` (``limit`` applies to fitting data only)."""
        return load_data(
            spec,
            root=self.root,
            download=self.download,
            limit=self.limit if limit else None,
            seed=self.seed,
            preprocess=preprocess,
            num_workers=self.num_workers,
            skip_unreadable=self.skip_unreadable,
        )


@dataclass
class ModelOptions:
    """Which network and weights (the CLI's model option group)."""

    spec: str
    checkpoint: Path | None = None
    head: str | None = None
    checkpoint_key: str | None = None
    model_args: list[str] = field(default_factory=list)
    output: str | None = None
    preprocess: Preprocess | None = None
    likelihood: str | None = None
    precision: Precision | str = Precision.FP32  # of the backbone's feature passes

    def load(self) -> LoadedModel:
        loaded = load_classifier(
            self.spec,
            self.checkpoint,
            self.head,
            checkpoint_key=self.checkpoint_key,
            preprocess=self.preprocess,
            model_args=list(self.model_args),
            output=self.output,
            likelihood=self.likelihood,
        )
        loaded.precision = parse_precision(self.precision)
        return loaded


def check_labels(data: Data, num_classes: int, likelihood: str = "categorical") -> None:
    """Raise if ``data``'s labels do not fit a ``num_classes``-way classifier of ``likelihood``
    (class indices for ``categorical``, multi-label ``[N, K]`` for ``bernoulli``)."""
    data.check_labels(num_classes, likelihood)


def require_likelihood(method: str, loaded: LoadedModel) -> None:
    """Raise unless ``method`` fits ``loaded``'s likelihood (the registry entry's ``likelihoods``:
    Laplace, MNVI and GLM VI fit softmax and multi-label (bernoulli) classifiers, every other
    method softmax ones only)."""
    if loaded.likelihood not in method_entry(method).likelihoods:
        loaded.require_categorical(method)


def record_provenance(post: Posterior, loaded: LoadedModel, fit_data: Data, val: Data | None = None) -> None:
    """What a posterior file must say about its model and data (``load_model`` reads it back)."""
    post.meta |= {
        **loaded.describe(),
        "precision": parse_precision(loaded.precision).value,
        "class_names": loaded.class_names,
        "data": fit_data.info,
        "validation_data": None if val is None else val.info,
    }


def recorded_validation(loaded: LoadedModel, fit_data: Data) -> str | None:
    """The validation spec a ``bayescli train`` checkpoint records, unless it is the fitting data."""
    recorded = (loaded.metadata.get("val_data") or {}).get("spec")
    if not recorded or recorded == fit_data.spec:
        return None
    return recorded


def carve_validation(data: Data, fraction: float, seed: int) -> tuple[Data, Data]:
    """Split ``data`` into (fitting, validation) with a seeded ``fraction`` held out."""
    require(0 < fraction < 1, f"val_split must be in (0, 1), got {fraction}")
    n = len(data)
    n_val = int(round(fraction * n))
    require(0 < n_val < n, f"val_split {fraction} of {n} rows leaves an empty fitting or validation set")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    val_rows, fit_rows = perm[:n_val].sort().values, perm[n_val:].sort().values
    info = {"val_split": fraction, "val_split_seed": seed}
    return data.subset(fit_rows, role="fitting", **info), data.subset(val_rows, role="validation", **info)


def resolve_validation(
    loaded: LoadedModel,
    fit_data: Data,
    data_options: DataOptions,
    *,
    val: str | None = None,
    val_split: float | None = None,
    required: bool = False,
) -> tuple[Data, Data | None]:
    """(fitting data, validation data or ``None``) by the rules of the module docstring.

    ``required`` (an explicit request to select on validation data) falls back to the fitting
    spec's own validation split, as ``--select`` always has.
    """
    require(val is None or val_split is None, "give validation data or a val_split, not both")
    if val_split is not None:
        return carve_validation(fit_data, val_split, data_options.seed)
    spec = val or recorded_validation(loaded, fit_data)
    if spec is None and required:
        spec = validation_spec(fit_data.spec)
    if spec is None:
        return fit_data, None
    val_data = data_options.load(spec, loaded.preprocess, limit=False)
    check_labels(val_data, loaded.classifier.num_classes, loaded.likelihood)
    require(val_data.y is not None, f"{spec} has no labels; validation data must be labelled")
    return fit_data, val_data


def load_setting_data(settings: Any, data_options: DataOptions, preprocess: Preprocess | None) -> Any:
    """``settings`` with every data spec it names (``settings.data_specs()``) replaced by loaded
    :class:`~bayescli.data.Data` (read with the model's preprocessing)."""
    specs = settings.data_specs() if hasattr(settings, "data_specs") else {}
    if not specs:
        return settings
    loaded = {name: data_options.load(spec, preprocess, limit=False) for name, spec in specs.items()}
    return dataclasses.replace(settings, **loaded)


def fit_posterior(
    method: str,
    source: FitSource,
    settings: Any = None,
    *,
    data_options: DataOptions | None = None,
    **values: Any,
) -> Posterior:
    """Fit ``method`` on ``source`` with ``settings`` (or the method's defaults with ``values``)
    and record its provenance. Data specs named in the settings are loaded with ``data_options``.

    Issues :class:`~bayescli.errors.LowAccuracyWarning` when the MAP accuracy on the fitting data
    says the model is fed wrongly (the accuracy is also recorded as ``map_accuracy``, from the
    feature pass at ``source.model.precision``). A precision other than fp32 is refused for
    posteriors over the whole network (see :func:`~bayescli.models.features.require_last_layer_precision`).
    """
    require_likelihood(method, source.model)
    settings = create_settings(method, settings, **values)
    precision = check_precision(source.model.precision, source.device)
    if Subset(getattr(settings, "subset", Subset.LAST_LAYER)) is not Subset.LAST_LAYER:
        require_last_layer_precision(precision, f"{method} with subset 'all'")
    settings = load_setting_data(settings, data_options or DataOptions(), source.model.preprocess)
    start = time.perf_counter()
    with warnings.catch_warnings():
        # the fitting data's own warning is issued below, once, naming its role
        warnings.filterwarnings("ignore", category=LowAccuracyWarning)
        post = fit_function(method)(source, settings)
    post.meta.setdefault("fit_seconds", time.perf_counter() - start)
    record_provenance(post, source.model, source.data, source.val)
    if post.selection is None:  # a method that records no selection validated nothing
        post.meta["validated"] = False
    correct, n = source.map_counts()
    if parallel.world().distributed:
        summed = parallel.all_reduce_sum(torch.tensor([correct, n], dtype=torch.float64)).tolist()
        correct, n = summed[0], int(summed[1])
    post.meta["map_accuracy"] = correct / n if n else None
    if n:
        message = low_accuracy_warning(
            correct / n,
            source.num_classes,
            f"the fitting data {source.data.spec}",
            multilabel=source.model.likelihood == "bernoulli",
        )
        if message is not None:
            warnings.warn(LowAccuracyWarning(message, correct / n, source.data.spec), stacklevel=2)
    return post


@dataclass
class FitRun:
    """What :func:`fit_from_specs` did: the posterior, the data it saw and where validation came from."""

    posterior: Posterior
    model: LoadedModel
    data: Data
    val: Data | None
    seconds: float
    forward_seconds: float

    def facts(self) -> dict:
        """Scalar facts for a summary table."""
        sel = self.posterior.selection
        out = {
            "precision": self.posterior.meta.get("precision"),
            "map_accuracy": self.posterior.meta.get("map_accuracy"),
            "validation": self.val.spec if self.val is not None else None,
        }
        if sel is not None:
            out |= {f"chosen {sel.setting}": sel.chosen, "chosen by": chosen_by(sel)}
        if self.val is None and (sel is None or sel.how != FIXED):
            out["validated"] = NOT_VALIDATED
        return out


def chosen_by(sel: Selection) -> str:
    """How ``sel``'s value was set, for a summary: ``validation nll``, ``given``, ``default: …``."""
    if sel.validated:
        return f"validation {None if sel.criterion is None else sel.criterion.value}"
    return "given" if sel.how == FIXED else f"default: {sel.rule}"


def fit_from_specs(
    method: str,
    model: ModelOptions | LoadedModel,
    data: str,
    *,
    settings: Any = None,
    data_options: DataOptions | None = None,
    val: str | None = None,
    val_split: float | None = None,
    select_required: bool = False,
    device: torch.device | str = "cpu",
    batch_size: int = 256,
    feature_cache: Path | None = None,
    out: Path | None = None,
) -> FitRun:
    """Load the model and data from specs, fit ``method``, record provenance and write ``out``.

    Under ``torchrun`` (after :func:`bayescli.distributed.init`) the fits of methods whose registry
    entry ``shards`` (last-layer Laplace: its settings' ``check_shardable()``) shard the fitting rows
    across processes (each caches its own shard's features); rank 0 writes the file.
    """
    opts = data_options or DataOptions()
    settings = create_settings(method, settings)
    loaded = model if isinstance(model, LoadedModel) else model.load()
    require_likelihood(method, loaded)
    fit_data = opts.load(data, loaded.preprocess)
    check_labels(fit_data, loaded.classifier.num_classes, loaded.likelihood)
    fit_data, val_data = resolve_validation(
        loaded, fit_data, opts, val=val, val_split=val_split, required=select_required
    )
    world = parallel.world()
    full_data = fit_data
    if world.distributed:
        require(
            method_entry(method).shards,
            f"under torchrun only {', '.join(sharding())} fits are sharded; run one process",
        )
        settings.check_shardable()
        fit_data = fit_data.subset(parallel.local_rows(len(fit_data)))
        if feature_cache is not None:
            feature_cache = feature_cache.with_name(f"{feature_cache.name}.rank{world.rank}-of-{world.size}")
    source = FitSource(loaded, fit_data, val_data, device, batch_size, feature_cache)
    start = time.perf_counter()
    post = fit_posterior(method, source, settings, data_options=opts)
    if world.distributed:  # what every process saw: skipped files over all shards
        full_data.add_unreadable(parallel.gather_objects(fit_data.unreadable))
        record_provenance(post, loaded, full_data, val_data)
    post.meta["processes"] = world.size
    if out is not None:
        if world.is_main:
            post.save(out)
        parallel.barrier()
    return FitRun(post, loaded, full_data, val_data, time.perf_counter() - start, source.forward_seconds)
