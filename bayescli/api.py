"""The Python API: hand bayescli an ``nn.Module`` and a ``DataLoader``.

>>> post = bayescli.fit(net, train_loader, "laplace", val=val_loader)      # doctest: +SKIP
>>> pred = post.predict(test_loader)                                      # doctest: +SKIP
>>> pred.probs.shape, pred.logit_var.shape                                # doctest: +SKIP
(torch.Size([N, K]), torch.Size([N, K]))
>>> post.save("laplace.safetensors")                                      # doctest: +SKIP
>>> post = bayescli.load("laplace.safetensors", model=net)                 # doctest: +SKIP
>>> report = bayescli.evaluate([post], test_loader, ood=[svhn_loader])     # doctest: +SKIP

``model`` is an ``nn.Module`` in hand (its head found as the CLI finds it; ``head=`` names it), a
:class:`~bayescli.models.specs.LoadedModel`, or a model spec string with ``checkpoint=``. ``data`` is a
``DataLoader`` (or any iterable of ``(x, y)`` batches), a pair of tensors ``(x [N, ...], y [N])``,
a :class:`~bayescli.data.Data` or a data spec. Inputs from loaders and tensors are used as given:
the module sees exactly what the loader yields (its own transforms, no extra normalisation).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bayescli.data import ArrayData, Data
from bayescli.data.base import Source
from bayescli.errors import BayescliError, require
from bayescli.fitting.fit_source import FitSource
from bayescli.fitting.pipeline import (
    DataOptions,
    ModelOptions,
    check_labels,
    fit_posterior,
    require_likelihood,
)
from bayescli.fitting.registry import create_settings, select_defaults
from bayescli.fitting.registry import methods as _methods
from bayescli.models.features import parse_precision
from bayescli.models.preprocess import Preprocess
from bayescli.models.specs import LoadedModel, ModelSpec
from bayescli.posterior.base import Posterior, load_posterior

MEMORY_KIND = "memory"  # the model-spec kind of a module that was only ever in memory

ModelLike = nn.Module | LoadedModel | str
DataLike = Data | torch.utils.data.DataLoader | Iterable | tuple | str


def methods() -> list[str]:
    """Every registered post-hoc method (Laplace variants and the VI methods)."""
    return _methods()


def settings(method: str = "laplace", **values: Any) -> Any:
    """Method ``method``'s settings dataclass instance with its defaults (and ``values``); the
    class docstring documents each field. Pass the result (or field values) to :func:`fit`."""
    return create_settings(method, **values)


# -- models ---------------------------------------------------------------------------------------


def weights_sha256(module: nn.Module) -> str:
    """SHA-256 over a module's state dict (names, shapes, dtypes and values, in order)."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{list(t.shape)}:{t.dtype}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def architecture(module: nn.Module) -> dict:
    """What a posterior records about an in-memory module: class and parameter shapes."""
    return {
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "shapes": {name: list(t.shape) for name, t in module.state_dict().items()},
    }


def as_model(
    model: ModelLike,
    *,
    head: str | None = None,
    checkpoint: str | Path | None = None,
    preprocess: Preprocess | None = None,
    output: int | str | None = None,
    model_args: Sequence[str] = (),
) -> LoadedModel:
    """A :class:`LoadedModel` from a module in hand, a loaded model or a spec + ``checkpoint``."""
    from bayescli.models.classifier import Classifier, find_head

    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, str):
        opts = ModelOptions(
            model, None if checkpoint is None else Path(checkpoint), head, None, list(model_args)
        )
        opts.output, opts.preprocess = None if output is None else str(output), preprocess
        return opts.load()
    require(
        isinstance(model, nn.Module),
        f"model must be an nn.Module, a LoadedModel or a spec, not {type(model)}",
    )
    require(checkpoint is None, "checkpoint= goes with a model spec string, not with an nn.Module")
    pre = preprocess or Preprocess("none")
    clf = Classifier(model, head or find_head(model), pre.mean, pre.std, output=output)
    clf.eval()
    meta = {"architecture": architecture(model)}
    spec = ModelSpec(MEMORY_KIND, type(model).__qualname__)
    return LoadedModel(clf, spec, Path(""), weights_sha256(model), meta, {}, pre)


# -- data -----------------------------------------------------------------------------------------


class _DatasetSource(Source):
    """A map-style dataset with known ``targets`` (torchvision's convention), read item by item."""

    def __init__(self, dataset: torch.utils.data.Dataset, labels: torch.Tensor) -> None:
        super().__init__()
        self.dataset, self.labels = dataset, labels
        first = dataset[0]
        self.shape = tuple(torch.as_tensor(first[0] if isinstance(first, tuple | list) else first).shape)

    def __len__(self) -> int:
        return len(self.dataset)

    def load(self, row: int) -> torch.Tensor:
        item = self.dataset[row]
        return torch.as_tensor(item[0] if isinstance(item, tuple | list) else item).float()


def as_data(
    data: DataLike,
    *,
    class_names: list[str] | None = None,
    name: str = "data",
    preprocess: Preprocess | None = None,
    data_options: DataOptions | None = None,
) -> Data:
    """A :class:`~bayescli.data.Data` from a loader, an iterable of ``(x, y)`` batches, tensors
    ``(x, y)`` (or ``x`` alone), a ``Data`` or a spec (read with ``preprocess``).

    A ``DataLoader`` over a map-style dataset with ``targets`` is read lazily in bayescli's own
    batches (its order, not the loader's shuffling); any other iterable is collected once.
    """
    if isinstance(data, Data):
        return data
    if isinstance(data, str):
        return (data_options or DataOptions()).load(data, preprocess)
    info = {"spec": f"python:{name}"}
    if isinstance(data, torch.Tensor):
        x, y = data, None
    elif isinstance(data, tuple) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        x, y = data
    elif isinstance(data, torch.utils.data.DataLoader) and _has_targets(data.dataset):
        labels = torch.as_tensor(data.dataset.targets, dtype=torch.int64)
        source = _DatasetSource(data.dataset, labels)
        return Data(source, class_names or _class_names(data.dataset, labels), info)
    elif isinstance(data, Iterable):
        xs, ys = [], []
        for batch in data:
            require(
                isinstance(batch, tuple | list) and len(batch) >= 1,
                f"{name} must yield (x, y) batches; got a {type(batch).__name__}",
            )
            xs.append(torch.as_tensor(batch[0]))
            ys.append(torch.as_tensor(batch[1]) if len(batch) > 1 else None)
        require(bool(xs), f"{name} yielded no batches")
        x = torch.cat(xs)
        y = None if any(t is None for t in ys) else torch.cat(ys)
    else:
        raise BayescliError(
            f"{name} must be a DataLoader, an iterable of (x, y) batches, a pair of tensors, a Data or "
            f"a data spec; got {type(data).__name__}"
        )
    if y is not None:
        y = y.to(torch.int64).reshape(-1)
    names = class_names or ([str(i) for i in range(int(y.max()) + 1)] if y is not None and len(y) else [])
    return ArrayData(x, y, names, info)


def _has_targets(dataset: object) -> bool:
    return hasattr(dataset, "targets") and hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")


def _class_names(dataset: object, labels: torch.Tensor) -> list[str]:
    names = getattr(dataset, "classes", None)
    return [str(n) for n in names] if names else [str(i) for i in range(int(labels.max()) + 1)]


# -- fit, load, predict, evaluate -------------------------------------------------------------------


def fit(
    model: ModelLike,
    data: DataLike,
    method: str = "laplace",
    *,
    val: DataLike | None = None,
    head: str | None = None,
    preprocess: Preprocess | None = None,
    device: torch.device | str = "cpu",
    checkpoint: str | Path | None = None,
    batch_size: int = 256,
    settings: Any = None,
    precision: str = "fp32",
    **values: Any,
) -> Posterior:
    """Fit post-hoc ``method`` (see :func:`methods`) to ``model`` on ``data``.

    ``val`` (held-out, disjoint from ``data``) tunes the method's key hyperparameter on its
    validation NLL (``select_by``); without it each method keeps its principled default and the
    posterior records that nothing was validated. ``settings`` is the method's settings instance
    (:func:`settings`), or pass its fields as keywords (``prior_precision=…``, ``hessian="diag"``).
    The returned posterior remembers the model, so ``post.predict(loader)`` needs nothing else.
    ``precision`` (``fp32`` | ``bf16`` | ``fp16``, CUDA only) is the backbone's feature pass's,
    recorded in the posterior (see :class:`~bayescli.options.Precision`).
    """
    loaded = as_model(model, head=head, checkpoint=checkpoint, preprocess=preprocess)
    loaded = dataclasses.replace(loaded, precision=parse_precision(precision))  # the caller's model untouched
    require_likelihood(method, loaded)
    num_classes = loaded.classifier.num_classes
    fit_data = as_data(data, name="fit", preprocess=loaded.preprocess, class_names=loaded.class_names)
    val_data = None
    if val is not None:
        val_data = as_data(val, name="val", preprocess=loaded.preprocess, class_names=loaded.class_names)
        check_labels(val_data, num_classes, loaded.likelihood)
    check_labels(fit_data, num_classes, loaded.likelihood)
    source = FitSource(loaded, fit_data, val_data, device, batch_size)
    post = fit_posterior(method, source, settings, **values)
    if loaded.spec.kind == MEMORY_KIND:  # what bayescli.load checks a module against
        post.meta["architecture"] = loaded.metadata["architecture"]
    post.model = loaded
    # in-memory sets have no spec to reload: evaluate's detectors and temperature reuse them
    post.fit_data, post.val_data = fit_data, val_data
    return post


def load(
    path: str | Path, model: ModelLike | None = None, device: torch.device | str | None = None
) -> Posterior:
    """Read a posterior file. ``model``: the module (or spec/LoadedModel) it was fitted on — needed
    when the file names no checkpoint (a module that was only ever in memory); a module is checked
    against the file's recorded architecture and weights."""
    post = load_posterior(path, device or "cpu")
    if model is None:
        return post
    recorded = post.meta.get("architecture")
    if recorded is not None and isinstance(model, nn.Module) and recorded != architecture(model):
        raise BayescliError(
            f"{path} was fitted on a {recorded['class']} with other layers than this "
            f"{type(model).__qualname__}; pass the module it was fitted on"
        )
    recorded_pre = post.meta.get("preprocess")
    pre = Preprocess.from_meta(recorded_pre) if recorded_pre else None  # the fit's own normalisation
    loaded = as_model(model, head=post.meta.get("head"), preprocess=pre)
    sha = post.meta.get("checkpoint_sha256")
    if sha and sha != loaded.sha256:
        raise BayescliError(
            f"the model's weights differ from those {path} was fitted on (sha256 {loaded.sha256[:12]}… vs "
            f"{sha[:12]}…); pass the module or checkpoint it was fitted on"
        )
    k = loaded.classifier.num_classes
    require(
        k == post.meta.get("num_classes", k),
        f"{path} has {post.meta.get('num_classes')} classes, the model {k}; pass the one it was fitted on",
    )
    post.model = loaded
    return post


def model_of(post: Posterior) -> LoadedModel:
    """The model a posterior predicts with: the one it was fitted on or loaded with, else the one its
    file names (a module that was only in memory must be passed to :func:`load`)."""
    loaded = getattr(post, "model", None)
    if loaded is not None:
        return loaded
    if str(post.meta.get("model", "")).startswith(f"{MEMORY_KIND}:"):
        raise BayescliError(
            "this posterior was fitted on a module that was only in memory; pass it: "
            "bayescli.load(path, model=module)"
        )
    post.model = post.load_model()
    return post.model


def predict(
    post: Posterior,
    data: DataLike,
    *,
    predictive: str | None = None,
    link: str | None = None,
    samples: int = 1000,
    seed: int = 0,
    batch_size: int = 256,
    device: torch.device | str | None = None,
    precision: str | None = None,
) -> Any:
    """``post``'s predictive on ``data`` → :class:`~bayescli.predictive.glm.Prediction` (``probs
    [N, K]``, ``alpha`` where defined, ``logit_mean``/``logit_var [N, K]``). Defaults: the GLM
    predictive with the probit link, or the Dirichlet mean for a native-Dirichlet posterior.
    ``precision`` of the feature pass: default the one ``post`` was fitted at."""
    from bayescli.models.features import (
        check_precision,
        extract_features,
        require_last_layer_precision,
        resolve_precision,
    )
    from bayescli.options import Link, Predictive
    from bayescli.predictive.glm import predict as glm_predict

    loaded = model_of(post)
    dev = torch.device(device) if device is not None else _device_of(post)
    chosen = check_precision(resolve_precision(precision, post.meta), dev)
    if post.needs_inputs:
        require_last_layer_precision(chosen, f"{post.method} with subset '{post.subset.value}'")
    loaded = dataclasses.replace(loaded, precision=chosen)
    x = as_data(data, name="data", preprocess=loaded.preprocess, class_names=loaded.class_names)
    feats = extract_features(loaded, x, batch_size, dev, whole_network=post.needs_inputs)
    chosen = Link(link) if link is not None else post.default_link
    return glm_predict(
        post,
        feats,
        Predictive(predictive or Predictive.GLM),
        chosen,
        samples,
        seed,
        classifier=loaded.classifier.to(dev),
        data=x,
        batch_size=batch_size,
    )


def _device_of(post: Posterior) -> torch.device:
    tensors = post.tensors()
    return next(iter(tensors.values())).device if tensors else torch.device("cpu")


def evaluate(
    posteriors: Posterior | Sequence[Posterior] | dict[str, Posterior],
    data: DataLike,
    *,
    model: ModelLike | None = None,
    ood: Sequence[DataLike] = (),
    rotation: Any = None,
    corruption: Any = None,
    fgsm: Any = None,
    fit_data: DataLike | None = None,
    val_data: DataLike | None = None,
    precision: str | None = None,
    **options: Any,
) -> dict:
    """The report ``bayescli evaluate`` writes (same schema) for ``posteriors`` on labelled
    ``data`` and optional OOD sets (loaders, tensors, ``Data`` or specs); ``options`` are the
    evaluate command's options as keywords (see :func:`bayescli.evaluation.evaluate`).

    The OOD detectors fit on ``fit_data`` and ``temp`` on ``val_data`` (default: the sets the first
    posterior was fitted and validated on — in memory for a posterior from :func:`fit`, else the
    specs its file records). ``precision`` of the feature passes: default the one the posteriors
    were fitted at (recorded as ``report["precision"]``)."""
    from bayescli.evaluation import evaluate as run_evaluation

    if isinstance(posteriors, Posterior):
        posteriors = [posteriors]
    posts = list(posteriors.values()) if isinstance(posteriors, dict) else list(posteriors)
    require(bool(posts), "evaluate needs at least one posterior")
    loaded = as_model(model) if model is not None else model_of(posts[0])
    for post in posts:
        if getattr(post, "model", None) is None:
            post.model = loaded
    test = as_data(data, name="test", preprocess=loaded.preprocess, class_names=loaded.class_names)
    ood_sets = [
        d if isinstance(d, str) else as_data(d, name=f"ood{i}", preprocess=loaded.preprocess)
        for i, d in enumerate(ood)
    ]
    fit_data = fit_data if fit_data is not None else getattr(posts[0], "fit_data", None)
    val_data = val_data if val_data is not None else getattr(posts[0], "val_data", None)
    for key, given in (("fit_data", fit_data), ("val_data", val_data)):
        if given is not None:
            options[key] = (
                given if isinstance(given, str) else as_data(given, name=key, preprocess=loaded.preprocess)
            )
    return run_evaluation(
        posteriors,
        test,
        model=loaded,
        ood=ood_sets,
        rotation=rotation,
        corruption=corruption,
        fgsm=fgsm,
        precision=precision,
        **options,
    )


def select(
    model: ModelLike,
    data: DataLike,
    val: DataLike,
    *,
    methods: Sequence[str] | None = None,
    ood: dict[str, DataLike] | Sequence[DataLike] = (),
    select_by: str = "nll",
    head: str | None = None,
    preprocess: Preprocess | None = None,
    device: torch.device | str = "cpu",
    batch_size: int = 256,
    out_dir: str | Path | None = None,
    precision: str = "fp32",
    seed: int = 0,
) -> tuple[dict, dict[str, Posterior]]:
    """Which posterior should ``model`` use? Fit every method (default: ``select``'s list) on one
    backbone pass of ``data``, each tuned on the held-out ``val`` by ``select_by`` (by ``nll`` when
    ranking by ``auroc``) with ``seed``, score them and MAP on ``val`` (and AUROC against each
    ``ood`` set) and rank them by ``select_by`` (``nll`` | ``ece`` | ``brier`` | ``auroc``). Returns
    the leaderboard (``bayescli select``'s ``leaderboard.json``) and the posteriors by method;
    ``out_dir`` also writes their files. ``precision``: the feature pass's, as in :func:`fit`."""
    from bayescli.fitting.select import SelectOptions
    from bayescli.fitting.select import select as run_select

    loaded = as_model(model, head=head, preprocess=preprocess)
    loaded = dataclasses.replace(loaded, precision=parse_precision(precision))
    loaded.require_categorical("select")
    names = loaded.class_names
    fit_data = as_data(data, name="fit", preprocess=loaded.preprocess, class_names=names)
    val_data = as_data(val, name="val", preprocess=loaded.preprocess, class_names=names)
    for d in (fit_data, val_data):
        check_labels(d, loaded.classifier.num_classes)
    sets = ood if isinstance(ood, dict) else {f"ood{i}": d for i, d in enumerate(ood)}
    ood_sets = {
        name: as_data(d, name=name, preprocess=loaded.preprocess).drop_labels() for name, d in sets.items()
    }
    source = FitSource(loaded, fit_data, val_data, device, batch_size)
    options = SelectOptions(list(methods or select_defaults()), select_by, seed=seed)
    board, posts = run_select(source, ood_sets, options, out_dir=None if out_dir is None else Path(out_dir))
    for post in posts.values():
        post.model, post.fit_data, post.val_data = loaded, fit_data, val_data
    return board, posts


# Posterior.predict is this module's predict: the posterior layer below cannot import it.
Posterior.api_predict = predict
