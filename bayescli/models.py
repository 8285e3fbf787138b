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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from bayescli.checkpoints import mismatch_message, read_checkpoint, resolve_state_dict
from bayescli.errors import BayescliError, require
from bayescli.io import sha256_file
from bayescli.preprocess import Preprocess

SPLIT_TOLERANCE = 1e-5

# ---------------------------------------------------------------------------------------------
# builtin architectures
# ---------------------------------------------------------------------------------------------

BuiltinFactory = Callable[..., nn.Module]
_BUILTINS: dict[str, BuiltinFactory] = {}


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
# the wrapper
# ---------------------------------------------------------------------------------------------


class _StopForward(Exception):
    """Raised by a hook to end a forward pass once the head's input is known."""


class Classifier(nn.Module):
    """A network with its input normalisation and a located classification head.

    ``forward(x)`` maps pixel-space inputs ``[N, *input_shape]`` to logits ``[N, K]``;
    ``features(x)`` returns the head's input ``φ [N, D]``; ``head`` is the ``nn.Linear`` ``D → K``.
    """

    def __init__(
        self,
        net: nn.Module,
        head_name: str,
        mean: list[float] | None = None,
        std: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.head_name = head_name
        modules = dict(net.named_modules())
        require(head_name in modules, f"no module named '{head_name}' in the model; see --head")
        head = modules[head_name]
        require(
            isinstance(head, nn.Linear),
            f"head '{head_name}' is a {type(head).__name__}, not nn.Linear; pass --head NAME "
            "of the final linear layer",
        )
        self.head: nn.Linear = head
        self.register_buffer("mean", torch.tensor(mean if mean else [0.0]))
        self.register_buffer("std", torch.tensor(std if std else [1.0]))

    @property
    def num_classes(self) -> int:
        return self.head.out_features

    @property
    def feature_dim(self) -> int:
        return self.head.in_features

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """``(x - mean) / std``: per channel for images ``[N, C, H, W]``, per column for ``[N, D]``."""
        if x.dim() == 4:
            return (x - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)
        return (x - self.mean) / self.std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.normalise(x))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features ``φ(x)`` ``[N, D]``: the input the head receives."""
        captured: list[torch.Tensor] = []

        def grab(_module: nn.Module, args: tuple) -> None:
            captured.append(args[0])
            raise _StopForward

        handle = self.head.register_forward_pre_hook(grab)
        try:
            self.net(self.normalise(x))
        except _StopForward:
            pass
        finally:
            handle.remove()
        require(bool(captured), f"the head '{self.head_name}' was never called in forward")
        phi = captured[0]
        require(
            phi.dim() == 2,
            f"the head '{self.head_name}' receives a {phi.dim()}-D input {list(phi.shape)}; "
            "bayescli needs [N, D] features, pick another --head",
        )
        return phi

    def check_split(self, x: torch.Tensor) -> float:
        """Verify ``head(features(x))`` reproduces ``forward(x)``; returns the max abs difference.

        Raises :class:`BayescliError` if the difference exceeds ``SPLIT_TOLERANCE`` or if the
        head is not the last linear layer applied (with a hint naming that layer).
        """
        order: list[str] = []
        handles = [
            m.register_forward_hook(lambda _m, _a, _o, n=name: order.append(n))
            for name, m in self.net.named_modules()
            if isinstance(m, nn.Linear)
        ]
        try:
            with torch.inference_mode():
                full = self.forward(x)
        finally:
            for h in handles:
                h.remove()
        with torch.inference_mode():
            split = self.head(self.features(x))
        if full.shape != split.shape:
            raise BayescliError(
                f"the model's output {list(full.shape)} is not the head's output "
                f"{list(split.shape)}; pass --head NAME of the final linear layer"
                + (f" (the last one applied is '{order[-1]}')" if order else "")
            )
        if not torch.isfinite(full).all():
            raise BayescliError(
                "the model produces non-finite features/logits (NaN or inf) on these inputs; "
                "check the checkpoint and the input scaling"
            )
        diff = (full.float() - split.float()).abs().max().item()
        if not diff <= SPLIT_TOLERANCE:
            hint = f" (the last linear layer applied is '{order[-1]}')" if order else ""
            raise BayescliError(
                f"head(features(x)) differs from the model's output by {diff:.2e} > "
                f"{SPLIT_TOLERANCE:g}: '{self.head_name}' is not the final layer{hint}; "
                "pass --head NAME"
            )
        return diff


# ---------------------------------------------------------------------------------------------
# specs and loading
# ---------------------------------------------------------------------------------------------

SPEC_KINDS = ("timm", "torchvision", "builtin", "py")


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``--model`` value: ``kind:name`` (``py:`` names are ``module:factory``)."""

    kind: str
    name: str

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        kind, sep, name = text.partition(":")
        if not sep or kind not in SPEC_KINDS or not name:
            raise BayescliError(
                f"unknown model spec '{text}'; use timm:NAME, torchvision:NAME, "
                f"builtin:NAME ({', '.join(builtin_names())}) or py:package.module:factory"
            )
        return cls(kind, name)

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


def last_linear_name(net: nn.Module) -> str:
    names = [n for n, m in net.named_modules() if isinstance(m, nn.Linear)]
    require(bool(names), "the model has no nn.Linear layer to use as classification head")
    return names[-1]


def build_network(
    spec: ModelSpec, num_classes: int | None, input_shape: tuple[int, ...] | None, kwargs: dict
) -> nn.Module:
    """Instantiate ``spec``; ``num_classes=None`` means the architecture's default."""
    if spec.kind == "builtin":
        if spec.name not in _BUILTINS:
            raise BayescliError(
                f"unknown builtin model '{spec.name}'; choose one of {', '.join(builtin_names())}"
            )
        require(
            num_classes is not None and input_shape is not None,
            "builtin checkpoints carry their input shape in the metadata; this one does not "
            "(re-create it with `bayescli train`)",
        )
        return _BUILTINS[spec.name](num_classes, tuple(input_shape), **kwargs)
    if spec.kind == "timm":
        import timm

        if spec.name not in timm.list_models():
            raise BayescliError(f"timm has no model '{spec.name}'; see timm.list_models()")
        extra = {} if num_classes is None else {"num_classes": num_classes}
        return timm.create_model(spec.name, pretrained=False, **extra, **kwargs)
    if spec.kind == "torchvision":
        import torchvision

        if spec.name not in torchvision.models.list_models():
            raise BayescliError(
                f"torchvision has no model '{spec.name}'; see torchvision.models.list_models()"
            )
        extra = {} if num_classes is None else {"num_classes": num_classes}
        return torchvision.models.get_model(spec.name, weights=None, **extra, **kwargs)
    module_name, sep, attr = spec.name.rpartition(":")
    require(
        bool(sep and module_name and attr), f"py spec must be py:package.module:factory, got py:{spec.name}"
    )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise BayescliError(f"cannot import {module_name}:{attr} ({exc}); check PYTHONPATH") from None
    params = inspect.signature(factory).parameters
    if num_classes is not None and "num_classes" in params:
        kwargs = {**kwargs, "num_classes": num_classes}
    net = factory(**kwargs)
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

    @property
    def class_names(self) -> list[str]:
        names = self.metadata.get("class_names")
        return list(names) if names else [str(i) for i in range(self.classifier.num_classes)]

    def describe(self) -> dict:
        """JSON-ready description, as recorded in every output."""
        return {
            "model": str(self.spec),
            "checkpoint": str(self.checkpoint),
            "checkpoint_sha256": self.sha256,
            "head": self.classifier.head_name,
            "num_classes": self.classifier.num_classes,
            "feature_dim": self.classifier.feature_dim,
            **self.source,
            "preprocess": self.preprocess.to_meta(),
        }


def load_classifier(
    model: str | ModelSpec,
    checkpoint: str | Path,
    head: str | None = None,
    expected_sha256: str | None = None,
    checkpoint_key: str | None = None,
    preprocess: Preprocess | None = None,
) -> LoadedModel:
    """Build ``model`` with the checkpoint's class count and load its weights.

    The state dict is found inside wrappers and freed of wrapper prefixes by
    :func:`bayescli.checkpoints.resolve_state_dict` (``checkpoint_key`` picks a wrapper entry);
    what was unwrapped or stripped is in :meth:`LoadedModel.describe`. Raises
    :class:`BayescliError` for unknown specs, unreadable checkpoints, a hash mismatch with
    ``expected_sha256``, or weights that do not fit the architecture (naming the first missing,
    unexpected or mis-shaped keys). ``preprocess`` sets the input recipe; without one, the
    normalisation a ``bayescli train`` checkpoint carries is used (none for other checkpoints).
    """
    spec = model if isinstance(model, ModelSpec) else ModelSpec.parse(model)
    path = Path(checkpoint)
    content, meta = read_checkpoint(path)
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
    kwargs = dict(meta.get("model_kwargs", {}))
    input_shape = tuple(meta["input_shape"]) if meta.get("input_shape") else None
    num_classes = meta.get("num_classes")
    net = build_network(spec, None if spec.kind != "builtin" else num_classes, input_shape, kwargs)
    resolved = resolve_state_dict(content, _shapes(net), checkpoint_key)
    if spec.kind != "builtin":
        head_name = head or last_linear_name(net)
        weight = resolved.state.get(f"{head_name}.weight")
        require(
            weight is not None and weight.dim() == 2,
            f"checkpoint {path} has no 2-D '{head_name}.weight' for the head of {spec} "
            f"({mismatch_message(resolved.state, _shapes(net))}); or pass --head NAME",
        )
        if int(weight.shape[0]) != _shapes(net)[f"{head_name}.weight"][0]:
            net = build_network(spec, int(weight.shape[0]), input_shape, kwargs)
    problem = mismatch_message(resolved.state, _shapes(net))
    if problem:
        raise BayescliError(f"checkpoint {path} does not match {spec}: {problem}")
    net.load_state_dict(resolved.state, strict=True)
    net.eval()
    if preprocess is None:
        norm = meta.get("normalisation", {})
        source = "checkpoint" if norm.get("mean") else "none"
        preprocess = Preprocess(source, norm.get("mean"), norm.get("std"))
    clf = Classifier(net, head or last_linear_name(net), preprocess.mean, preprocess.std)
    clf.eval()
    return LoadedModel(clf, spec, path, digest, meta, resolved.describe(), preprocess)


def _shapes(net: nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in net.state_dict().items()}
