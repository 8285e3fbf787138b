"""Model specs, checkpoint loading and the feature/head split.

A *model spec* names an architecture: ``timm:NAME``, ``torchvision:NAME``, ``builtin:NAME`` or
``py:package.module:factory``. :func:`load_classifier` builds it with the class count read from
the checkpoint, loads the weights and wraps it as a :class:`Classifier`, which

* owns the input normalisation (callers feed pixel-space tensors in [0, 1]), and
* splits the network into ``features(x) -> φ [N, D]`` and ``head(φ) -> logits [N, K]``, where
  the head is the last ``nn.Linear`` applied in ``forward`` (or one named with ``head=``).

Builtin architectures live in a registry: adding one is one :func:`register_builtin` entry.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from bayescli.errors import BayescliError, require
from bayescli.io import sha256_file
from bayescli.models.args import factory_arguments, parse_model_args
from bayescli.models.checkpoints import load_weights, read_checkpoint, resolve_weights
from bayescli.models.classifier import SPLIT_TOLERANCE, Classifier, find_head, last_linear_name  # noqa: F401 (re-exported)
from bayescli.models.preprocess import Preprocess, PreprocessOverrides
from bayescli.options import Precision

# ---------------------------------------------------------------------------------------------
# builtin architectures
# ---------------------------------------------------------------------------------------------

BuiltinFactory = Callable[..., nn.Module]
_BUILTINS: dict[str, BuiltinFactory] = {}

# the classifier likelihoods: softmax, or a sigmoid per class (multi-label)
LIKELIHOODS = ("categorical", "bernoulli")


def register_builtin(name: str) -> Callable[[BuiltinFactory], BuiltinFactory]:
    """Register ``factory(num_classes, input_shape) -> nn.Module`` as ``builtin:name``."""

    def deco(factory: BuiltinFactory) -> BuiltinFactory:
        _BUILTINS[name] = factory
        return factory

    return deco


def builtin_names() -> list[str]:
    """Names accepted after ``builtin:``."""
    return sorted(_BUILTINS)


@register_builtin("small-cnn")
def small_cnn(num_classes: int, input_shape: tuple[int, ...], width: int = 32) -> nn.Module:
    """Two conv blocks, adaptive pooling to 4×4, a 128-unit feature layer, a linear head.

    Works for any ``[C, H, W]`` input with H, W ≥ 2 (8×8 digits, 28×28 MNIST, 32×32 CIFAR).
    """
    require(len(input_shape) == 3, f"builtin:small-cnn needs image inputs [C,H,W], got {list(input_shape)}")
    c = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(2 * width * 16, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


@register_builtin("lenet")
def lenet(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """LeNet-5 with ReLU and max-pooling (the MNIST network family of the MNVI paper):
    conv 5×5 (6, padding 2) → pool → conv 5×5 (16) → pool → 120 → 84 → K. Needs H, W ≥ 12."""
    require(
        len(input_shape) == 3 and min(input_shape[1:]) >= 12,
        f"builtin:lenet needs image inputs [C,H,W] with H, W >= 12, got {list(input_shape)}",
    )
    c, h, w = input_shape
    flat = 16 * ((h // 2 - 4) // 2) * ((w // 2 - 4) // 2)
    return nn.Sequential(
        nn.Conv2d(c, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )


class SmallSegNet(nn.Module):
    """Three 3×3 conv blocks (the second at stride 2, the third dilated: a 13-pixel receptive field,
    enough to see an 8×8 digit whole), a 1×1-conv dense head ``classifier`` and bilinear upsampling
    of its logits to the input's size (torchvision's segmentation layout, in miniature)."""

    def __init__(self, channels: int, num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=2, dilation=2),
            nn.ReLU(),
        )
        self.classifier = nn.Conv2d(2 * width, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.classifier(self.backbone(x))
        return nn.functional.interpolate(z, size=x.shape[-2:], mode="bilinear", align_corners=False)


@register_builtin("small-segnet")
def small_segnet(num_classes: int, input_shape: tuple[int, ...], width: int = 16) -> nn.Module:
    """:class:`SmallSegNet`: per-pixel logits ``[N, K, H, W]`` for images ``[C, H, W]`` (H, W ≥ 2)."""
    require(
        len(input_shape) == 3 and min(input_shape[1:]) >= 2,
        f"builtin:small-segnet needs image inputs [C,H,W] with H, W >= 2, got {list(input_shape)}",
    )
    return SmallSegNet(input_shape[0], num_classes, width)


_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


@register_builtin("mlp")
def mlp(
    num_classes: int,
    input_shape: tuple[int, ...],
    hidden: int = 128,
    depth: int = 2,
    activation: str = "relu",
) -> nn.Module:
    """A multilayer perceptron on flattened inputs (``activation``: relu or tanh)."""
    require(activation in _ACTIVATIONS, f"builtin:mlp activation must be relu or tanh, got '{activation}'")
    d_in = 1
    for s in input_shape:
        d_in *= s
    layers: list[nn.Module] = [nn.Flatten()]
    for i in range(depth):
        layers += [nn.Linear(d_in if i == 0 else hidden, hidden), _ACTIVATIONS[activation]()]
    layers.append(nn.Linear(hidden if depth else d_in, num_classes))
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------------
# specs and loading
# ---------------------------------------------------------------------------------------------

SPEC_KINDS = ("timm", "torchvision", "builtin", "hf", "py")
# Factory arguments a file may never set: they would fetch weights (from a hub or a path) or change
# what bayescli itself passes.
LIBRARY_RESERVED = (
    "num_classes", "pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path", "weights",
    "progress",
)  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``--model`` value: ``kind:name`` (``py:`` names are ``module:factory``, ``hf:`` a folder)."""

    kind: str
    name: str

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        kind, sep, name = text.partition(":")
        if not sep or kind not in SPEC_KINDS or not name:
            raise BayescliError(
                f"unknown model spec '{text}'; use timm:NAME, torchvision:NAME, "
                f"builtin:NAME ({', '.join(builtin_names())}), hf:FOLDER or py:package.module:factory"
            )
        return cls(kind, name)

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


def model_factory(spec: ModelSpec) -> Callable[..., nn.Module] | None:
    """The callable a spec builds its network with (``None`` for ``hf:``, built from its config).

    ``py:`` modules are imported with the current directory on the import path, as ``python -m``
    would find them.
    """
    if spec.kind == "builtin":
        if spec.name not in _BUILTINS:
            raise BayescliError(
                f"unknown builtin model '{spec.name}'; choose one of {', '.join(builtin_names())}"
            )
        return _BUILTINS[spec.name]
    if spec.kind == "timm":
        import timm

        if spec.name not in timm.list_models():
            raise BayescliError(f"timm has no model '{spec.name}'; see timm.list_models()")
        return timm.models.model_entrypoint(spec.name)
    if spec.kind == "torchvision":
        import torchvision

        if spec.name not in torchvision.models.list_models():
            raise BayescliError(
                f"torchvision has no model '{spec.name}'; see torchvision.models.list_models()"
            )
        return torchvision.models.get_model_builder(spec.name)
    if spec.kind == "hf":
        return None
    module_name, sep, attr = spec.name.rpartition(":")
    require(
        bool(sep and module_name and attr), f"py spec must be py:package.module:factory, got py:{spec.name}"
    )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise BayescliError(
            f"cannot import {module_name}:{attr} ({exc}); run from the folder that holds it or set PYTHONPATH"
        ) from None


def build_network(
    spec: ModelSpec,
    num_classes: int | None,
    input_shape: tuple[int, ...] | None,
    kwargs: dict,
    factory: Callable[..., nn.Module] | None = None,
) -> nn.Module:
    """Instantiate ``spec`` with factory ``kwargs``; ``num_classes=None`` means the architecture's
    default. ``factory``: :func:`model_factory`'s result when the caller already has it."""
    if spec.kind == "hf":
        from bayescli.models.hf import build_hf_network

        return build_hf_network(Path(spec.name), num_classes)
    factory = factory or model_factory(spec)
    if spec.kind == "builtin":
        require(
            num_classes is not None and input_shape is not None,
            "builtin checkpoints carry their input shape in the metadata; this one does not "
            "(re-create it with `bayescli train`)",
        )
        return factory(num_classes, tuple(input_shape), **kwargs)
    extra = {} if num_classes is None else {"num_classes": num_classes}
    if spec.kind == "timm":
        return factory(pretrained=False, **extra, **kwargs)
    if spec.kind == "torchvision":
        return factory(weights=None, **extra, **kwargs)
    params = inspect.signature(factory).parameters
    if num_classes is not None and "num_classes" in params:
        kwargs = {**kwargs, "num_classes": num_classes}
    try:
        net = factory(**kwargs)
    except TypeError as exc:
        if "argument" not in str(exc):
            raise
        raise BayescliError(
            f"{spec} cannot be built with {kwargs or 'no arguments'} ({exc}); pass its arguments with "
            "--model-arg NAME=VALUE"
        ) from None
    require(isinstance(net, nn.Module), f"py:{spec.name} returned {type(net).__name__}, not an nn.Module")
    return net


@dataclass
class LoadedModel:
    """A ready :class:`Classifier` plus what was read from its checkpoint."""

    classifier: Classifier
    spec: ModelSpec
    checkpoint: Path
    sha256: str
    metadata: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict)  # checkpoint_key / stripped_prefixes, if any
    preprocess: Preprocess = field(default_factory=Preprocess)
    # the arithmetic of its backbone passes (bayescli.models.features); a fit records it, a
    # prediction reuses it
    precision: Precision = Precision.FP32

    @property
    def likelihood(self) -> str:
        """``categorical`` (softmax; checkpoints that do not say) or ``bernoulli`` (a sigmoid per class)."""
        return str(self.metadata.get("likelihood", "categorical"))

    def require_categorical(self, what: str, why: str | None = None) -> None:
        """Raise unless the classifier is a softmax one; ``why`` replaces the default reason (the
        command does not support multi-label classifiers yet) with the real one."""
        if self.likelihood != "categorical":
            reason = why or f"{what} supports softmax classifiers only so far; use a categorical checkpoint"
            raise BayescliError(
                f"{self.checkpoint} is a multi-label classifier (likelihood '{self.likelihood}', a "
                f"sigmoid per class), but {reason}"
            )

    @property
    def input_channels(self) -> int | None:
        """The channels the network's first layer takes (see :func:`input_channels`)."""
        return input_channels(self.classifier.network)

    def input_problem(self, shape: tuple[int, ...], spec: str) -> str | None:
        """Why inputs of ``shape`` (``[C, H, W]`` after preprocessing, of the data ``spec``) cannot
        reach the network, as one line, or ``None``: their channel count differs from the first
        convolution's, or from the normalisation's per-channel values (which would broadcast
        1-channel images to 3 and fail inside torch)."""
        if len(shape) != 3:
            return None
        channels, wanted = int(shape[0]), self.input_channels
        if wanted is not None and channels != wanted:
            hint = "convert them to greyscale" if wanted == 1 else f"give {wanted}-channel images"
            return (
                f"{spec} has {channels}-channel inputs {list(shape)} but {self.spec} takes "
                f"{wanted}-channel inputs (its first convolution); {hint}"
            )
        mean = self.preprocess.mean
        if mean is not None and len(mean) not in (1, channels):
            return (
                f"the '{self.preprocess.source}' preprocessing normalises {len(mean)} channels but "
                f"{spec} has {channels}-channel inputs; use --preprocess none or --mean/--std with "
                f"{channels} value{'s' if channels > 1 else ''}"
            )
        return None

    @property
    def class_names(self) -> list[str]:
        names = self.metadata.get("class_names")
        return list(names) if names else [str(i) for i in range(self.classifier.num_classes)]

    def describe(self) -> dict:
        """JSON-ready description, as recorded in every output (and printed by ``bayescli inspect``):
        spec, checkpoint and hash, how the weights were found (format, container entry, prefixes),
        factory arguments and their sources, the head and output facts, the preprocessing."""
        return {
            "model": str(self.spec),
            "checkpoint": str(self.checkpoint),
            "checkpoint_sha256": self.sha256,
            **self.classifier.describe(),
            **self.source,
            "preprocess": self.preprocess.to_meta(),
        }


def input_channels(net: nn.Module) -> int | None:
    """``in_channels`` of the first convolution, when it comes before any linear layer (the
    network's input layer, in registration order); ``None`` for networks whose inputs have no
    channel axis to check (MLPs) or that start otherwise."""
    for module in net.modules():
        if isinstance(module, nn.Conv2d):
            return int(module.in_channels)
        if isinstance(module, nn.Linear):
            return None
    return None


def check_preprocess_fits(pre: Preprocess, channels: int | None, spec: ModelSpec) -> None:
    """Raise when ``pre`` normalises a channel count the network cannot take (``--preprocess
    imagenet`` on a 1-channel net), before any data is read."""
    if pre.mean is not None and channels is not None and len(pre.mean) not in (1, channels):
        what = "--mean/--std" if pre.source == "none+overrides" else f"the '{pre.source}' preprocessing"
        raise BayescliError(
            f"{what} normalises {len(pre.mean)} channels but {spec} takes "
            f"{channels}-channel inputs (its first convolution); use --preprocess none, or "
            f"--mean/--std with {channels} value{'s' if channels > 1 else ''}"
        )


def _reserved(kind: str) -> tuple[str, ...]:
    """Factory arguments bayescli sets itself or that would fetch weights: never from a file."""
    return {"builtin": ("num_classes", "input_shape"), "py": ()}.get(kind, LIBRARY_RESERVED)


def _output_key(output: int | str | None) -> int | str | None:
    """``--output 0`` selects by index, ``--output logits`` by key or attribute."""
    if isinstance(output, str) and output.lstrip("-").isdigit():
        return int(output)
    return output


def load_classifier(
    model: str | ModelSpec,
    checkpoint: str | Path | None = None,
    head: str | None = None,
    expected_sha256: str | None = None,
    checkpoint_key: str | None = None,
    preprocess: Preprocess | None = None,
    *,
    model_args: list[str] | dict | None = None,
    file_args: dict | None = None,
    output: int | str | None = None,
    likelihood: str | None = None,
    preprocess_overrides: PreprocessOverrides | None = None,
) -> LoadedModel:
    """Build ``model`` with the checkpoint's class count and load its weights.

    The checkpoint is read by content (:func:`bayescli.models.checkpoints.read_checkpoint`: safetensors,
    torch state dicts, Lightning checkpoints, whole pickled modules read without running their
    code), and its state dict is matched to the architecture by
    :func:`bayescli.models.checkpoints.load_weights` (``checkpoint_key`` picks a wrapper entry). Factory
    arguments come from ``model_args`` (``["NAME=VALUE", …]`` typed by the factory's signature, or a
    dict), a Lightning checkpoint's ``hyper_parameters`` (``py:`` factories, as
    ``load_from_checkpoint`` passes them) and ``file_args`` (recorded in a posterior file), under
    the rules of :mod:`bayescli.models.args`. ``hf:FOLDER`` specs read the folder's config,
    weights file (the default ``checkpoint``), preprocessing and class names. ``output`` selects the
    logits in a non-tensor output. What was read, unwrapped, mapped and passed is in
    :meth:`LoadedModel.describe`. Raises :class:`BayescliError` for unknown specs, unreadable
    checkpoints, a hash mismatch with ``expected_sha256``, or weights that do not fit. ``preprocess``
    sets the input recipe; without one, the recipe the checkpoint carries (a ``bayescli train``
    normalisation, an HF image processor) is used, else none. ``likelihood`` (``categorical`` or
    ``bernoulli``) declares what a checkpoint saved elsewhere was trained with (a ``bayescli train``
    checkpoint records it; one that records another is refused). ``preprocess_overrides`` change
    parts of whichever recipe applies (a prediction-time ``--resize``, say).
    """
    spec = model if isinstance(model, ModelSpec) else ModelSpec.parse(model)
    if likelihood is not None and likelihood not in LIKELIHOODS:
        raise BayescliError(f"unknown likelihood '{likelihood}'; use one of {', '.join(LIKELIHOODS)}")
    folder = None
    if spec.kind == "hf":
        from bayescli.models.hf import hf_folder_files

        folder = hf_folder_files(spec.name)
        checkpoint = checkpoint or folder.weights
    require(checkpoint is not None, f"--checkpoint is required for {spec} (the weights file as saved)")
    path = Path(checkpoint)
    ckpt = read_checkpoint(path)
    meta = dict(ckpt.metadata)
    if likelihood is not None:
        recorded = meta.get("likelihood")
        if recorded is not None and recorded != likelihood:
            raise BayescliError(
                f"{path} records likelihood '{recorded}', not '{likelihood}'; drop --likelihood or pass "
                f"--likelihood {recorded}"
            )
        meta["likelihood"] = likelihood
    digest = sha256_file(path)
    if expected_sha256 is not None and digest != expected_sha256:
        raise BayescliError(
            f"checkpoint {path} has sha256 {digest[:12]}…, but the posterior was fitted on "
            f"{expected_sha256[:12]}…; pass --checkpoint with the original file"
        )
    if meta.get("model") and meta["model"] != str(spec):
        raise BayescliError(
            f"checkpoint {path} was trained as {meta['model']}, not {spec}; pass --model {meta['model']}"
        )
    factory = model_factory(spec)
    user = parse_model_args(model_args, factory) if isinstance(model_args, list) else dict(model_args or {})
    if factory is None and user:
        raise BayescliError(f"--model-arg does not apply to {spec}: its config.json defines the network")
    args = factory_arguments(
        factory,
        from_file={**meta.get("model_kwargs", {}), **(file_args or {})} if factory else None,
        hyper_parameters=ckpt.hyper_parameters if spec.kind == "py" else None,
        user=user,
        strict_file_names=spec.kind in ("builtin", "py"),
        reserved=_reserved(spec.kind),
    )
    kwargs = args.kwargs
    input_shape = tuple(meta["input_shape"]) if meta.get("input_shape") else None
    num_classes = meta.get("num_classes")
    net = build_network(spec, None if spec.kind != "builtin" else num_classes, input_shape, kwargs, factory)
    if folder is not None:
        from bayescli.models.hf import hf_class_names, hf_preprocess, hf_state_dict

        ckpt = replace(ckpt, content=hf_state_dict(net, _tensors(ckpt.content, path)))
    head_name = head or find_head(net)
    resolved = None
    if spec.kind != "builtin":
        # the head's rows are the class count (2-D Linear or 4-D 1×1 conv weight); a checkpoint
        # without it is explained by load_weights below
        resolved = resolve_weights(net, ckpt, checkpoint_key)
        weight = resolved.state.get(f"{head_name}.weight")
        built = _shapes(net).get(f"{head_name}.weight")
        rows = int(weight.shape[0]) if weight is not None and weight.dim() in (2, 4) else None
        if rows is not None and built is not None and rows != built[0]:
            net = build_network(spec, rows, input_shape, kwargs, factory)
            resolved = None  # shapes changed: the best match may too
    resolved = load_weights(net, ckpt, checkpoint_key, model=str(spec), resolved=resolved)
    net.eval()
    source = {**resolved.describe(), **args.describe()}
    if folder is not None:
        names = hf_class_names(folder.root)
        if names:
            meta["class_names"] = names
        if preprocess is None:
            preprocess, notes = hf_preprocess(folder.root)
            if notes:
                source["preprocess_notes"] = notes
    if preprocess is None:
        norm = meta.get("normalisation", {})
        source_name = "checkpoint" if norm.get("mean") else "none"
        preprocess = Preprocess(source_name, norm.get("mean"), norm.get("std"))
    if preprocess_overrides:
        preprocess = preprocess_overrides.apply(preprocess, str(spec))
    check_preprocess_fits(preprocess, input_channels(net), spec)
    clf = Classifier(net, head_name, preprocess.mean, preprocess.std, output=_output_key(output))
    clf.eval()
    return LoadedModel(clf, spec, path, digest, meta, source, preprocess)


def _tensors(content: object, path: Path) -> dict[str, torch.Tensor]:
    """The flat dict of tensors an HF weights file holds."""
    require(
        isinstance(content, dict) and all(isinstance(v, torch.Tensor) for v in content.values()),
        f"{path} is not a save_pretrained weights file (a flat dict of tensors)",
    )
    return content


def _shapes(net: nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in net.state_dict().items()}
