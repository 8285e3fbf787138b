"""The classifier wrapper: input normalisation, the network's logits and its feature/head split.

:class:`Classifier` wraps any ``nn.Module`` classifier so that the rest of bayescli sees

* ``net`` / ``forward`` — a module whose output is the logits tensor ``[N, K]``, even when the network
  returns a tuple, dict or dataclass (``output`` picks the element) or log-probabilities (``net`` then
  stops at the head and returns its logits: softmax is the same, but temperature, energy/MaxLogit
  scores and linearised predictives need the logits themselves);
* ``features(x) -> φ [N, D]`` and ``head(φ) -> logits [N, K]`` with ``head`` an ``nn.Linear``: the
  network's own ``Linear``, or, for a 1×1 ``Conv2d(D, K, 1)`` followed by global average pooling, an
  ``nn.Linear(D, K)`` sharing the conv's weights applied to the spatially averaged conv input
  (exact: the mean over positions commutes with a 1×1 conv).

Last-layer methods need the logits to be linear in the head's weights. A non-linear module between the
head and the output (SqueezeNet's ``Conv2d → ReLU → AdaptiveAvgPool2d``) makes them inexact: the
classifier still builds and serves whole-network methods through ``net``, but ``features``, ``head`` and
``check_split`` refuse with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from bayescli.errors import BayescliError, require

SPLIT_TOLERANCE = 1e-5
# Where torchvision and timm keep a classifier's head, in the order they are tried by find_head
# (timm's ``get_classifier()`` comes first).
HEAD_ATTRIBUTES = ("classifier", "fc", "head", "heads.head", "last_linear")
# Modules that may follow the head without changing the map from its output to the logits:
# identities on [N, K] (dropout is one in eval mode), the global average pooling of a 1×1-conv head,
# and a log-softmax (which only subtracts a per-row constant).
_TRANSPARENT = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd, nn.LogSoftmax)
# Outputs that are probabilities, or further linear layers, are reported by the numerical check of
# check_split (with a fix for each); every other module after the head is a non-linearity.
_PROBABILITIES = (nn.Softmax, nn.Softmin, nn.Sigmoid)
_LAYERS = (nn.Linear, nn.modules.conv._ConvNd)


def last_linear_name(net: nn.Module) -> str:
    """Name of the last registered ``nn.Linear`` of ``net``."""
    names = [n for n, m in net.named_modules() if isinstance(m, nn.Linear)]
    require(bool(names), "the model has no nn.Linear layer to use as classification head")
    return names[-1]


def _is_conv1x1(module: nn.Module) -> bool:
    """A ``Conv2d`` that is a per-position linear map ``C → K`` (1×1 kernel, stride 1, no padding/groups)."""
    return (
        isinstance(module, nn.Conv2d)
        and tuple(module.kernel_size) == (1, 1)
        and tuple(module.stride) == (1, 1)
        and module.padding in ((0, 0), "valid")
        and module.groups == 1
    )


def _is_head_layer(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1x1(module)


def find_head(net: nn.Module) -> str:
    """Name of ``net``'s classification head, by the torchvision/timm conventions.

    Tried in order: timm's ``get_classifier()``, then the attributes :data:`HEAD_ATTRIBUTES`; a
    candidate that is an ``nn.Linear`` or a 1×1 ``Conv2d`` is the head, a container contributes its
    last such layer. Otherwise the last ``nn.Linear`` (then the last 1×1 conv) of the network.
    """
    modules = dict(net.named_modules())
    candidates: list[str] = []
    get_classifier = getattr(net, "get_classifier", None)
    if callable(get_classifier):
        try:
            found = get_classifier()
        except TypeError:  # a method of that name with another signature: not timm's
            found = None
        candidates += [n for n, m in modules.items() if n and m is found][:1]
    candidates += [name for name in HEAD_ATTRIBUTES if name in modules]
    for name in candidates:
        inner = [f"{name}.{sub}".rstrip(".") for sub, m in modules[name].named_modules() if _is_head_layer(m)]
        if inner:
            return inner[-1]
    linear = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    conv = [n for n, m in modules.items() if _is_conv1x1(m)]
    require(
        bool(linear or conv),
        "the model has no nn.Linear or 1×1 Conv2d layer to use as classification head; pass --head NAME",
    )
    return (linear or conv)[-1]


def _leaves(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """Modules without children under ``module`` (``module`` itself if it has none), full names."""
    return [
        (f"{prefix}.{n}".strip(".") if n else prefix, m)
        for n, m in module.named_modules()
        if next(m.children(), None) is None
    ]


def _is_global_average_pool(module: nn.Module) -> bool:
    return isinstance(module, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)) and module.output_size in (
        1,
        (1,),
        (1, 1),
    )


def _is_nonlinear(module: nn.Module) -> bool:
    """True for a module after the head that makes the logits non-linear in the head's weights."""
    return not (
        isinstance(module, _TRANSPARENT + _PROBABILITIES + _LAYERS) or _is_global_average_pool(module)
    )


def _nonlinear_message(head_name: str, name: str, module: nn.Module) -> str:
    return (
        f"last-layer methods need logits that are linear in the head's weights, but "
        f"{type(module).__name__} '{name}' is applied between the head '{head_name}' and the output; "
        "use --subset all (whole-network methods)"
    )


def _static_problem(net: nn.Module, head_name: str) -> str | None:
    """A non-linearity that is certainly applied to the head's output, found without running ``net``.

    Only ``nn.Sequential`` parents are read (their forward is the chain of their children); the walk
    up stops at the first other container, whose forward cannot be known without running it.
    """
    parts = head_name.split(".") if head_name else []
    for depth in range(len(parts) - 1, -1, -1):
        parent_name = ".".join(parts[:depth])
        parent = net.get_submodule(parent_name)
        if not isinstance(parent, nn.Sequential):
            return None
        keys = list(parent._modules)
        for key in keys[keys.index(parts[depth]) + 1 :]:
            for name, leaf in _leaves(parent._modules[key], f"{parent_name}.{key}".strip(".")):
                if _is_nonlinear(leaf):
                    return _nonlinear_message(head_name, name, leaf)
    return None


# -- outputs that are not a tensor --------------------------------------------------------------


def _elements(out: Any) -> list[tuple[int | str, Any]]:
    """``(key, value)`` of a structured output: positions of a tuple/list, keys of a mapping (a Hugging
    Face ``ModelOutput`` is one), fields of a dataclass."""
    if isinstance(out, Mapping):
        return list(out.items())
    if isinstance(out, (tuple, list)):
        return list(enumerate(out))
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [(f.name, getattr(out, f.name)) for f in dataclasses.fields(out)]
    raise BayescliError(
        f"the model returns a {type(out).__name__}, not a tensor, tuple, list, dict or dataclass; "
        "wrap it in a module whose forward returns the logits"
    )


def _element(out: Any, key: int | str) -> Any:
    """The element ``key`` (as returned by :func:`_choose`) of a structured output."""
    if isinstance(key, str) and not isinstance(out, Mapping):
        return getattr(out, key)
    return out[key]


def _describe_elements(out: Any) -> str:
    return ", ".join(
        f"{key!r} {list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
        for key, v in _elements(out)
    )


def _choose(out: Any, output: int | str | None, num_classes: int) -> int | str:
    """The key of the logits element of ``out``: ``output`` when given (an index or a key/attribute,
    digits meaning an index), else the one ``[N, num_classes]`` tensor."""
    items = _elements(out)
    if output is not None:
        wanted: int | str = int(output) if isinstance(output, str) and output.isdigit() else output
        if isinstance(wanted, int):
            require(
                -len(items) <= wanted < len(items),
                f"--output {output} is out of range: the model returns {len(items)} elements "
                f"({_describe_elements(out)})",
            )
            key = items[wanted][0]
        else:
            key = wanted
            require(
                key in dict(items) or hasattr(out, key),
                f"--output {output!r} is not an element of the model's output ({_describe_elements(out)})",
            )
        require(
            isinstance(_element(out, key), torch.Tensor),
            f"--output {output!r} selects a {type(_element(out, key)).__name__}, not a tensor; "
            f"elements: {_describe_elements(out)}",
        )
        return key
    fits = [
        key for key, v in items if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == num_classes
    ]
    kind = type(out).__name__
    if len(fits) > 1:
        raise BayescliError(
            f"the model returns a {kind} with {len(fits)} [N, {num_classes}] tensors, "
            f"{', '.join(repr(k) for k in fits)}; pass --output INDEX|KEY to choose the logits"
        )
    require(
        bool(fits),
        f"the model returns a {kind} without a [N, {num_classes}] tensor ({_describe_elements(out)}); "
        "pass --output INDEX|KEY of the logits, or --head NAME if the head is another layer",
    )
    return fits[0]


class _StopForward(Exception):
    """Raised by a hook to end a forward pass once the head's input or output is known."""


def _run_to_head(
    network: nn.Module, layer: nn.Module, x: torch.Tensor, *, output: bool
) -> torch.Tensor | None:
    """Run ``network`` on ``x`` until ``layer`` is about to run (``output=False``: its input) or has run
    (``output=True``: its output); the rest of the forward is skipped. ``None`` if it never runs."""
    captured: list[torch.Tensor] = []

    def grab_input(_module: nn.Module, args: tuple) -> None:
        captured.append(args[0])
        raise _StopForward

    def grab_output(_module: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        captured.append(out)
        raise _StopForward

    handle = (
        layer.register_forward_hook(grab_output) if output else layer.register_forward_pre_hook(grab_input)
    )
    try:
        network(x)
    except _StopForward:
        pass
    finally:
        handle.remove()
    return captured[0] if captured else None


class SelectOutput(nn.Module):
    """``network(x)`` → its logits element ``[N, K]`` (``key``: index or key/attribute)."""

    def __init__(self, network: nn.Module, key: int | str) -> None:
        super().__init__()
        self.network = network
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _element(self.network(x), self.key)


class HeadLogits(nn.Module):
    """``network(x)`` → the logits ``[N, K]`` of its head ``head_name``, for a network that outputs
    log-probabilities: the head's output, averaged over positions for a 1×1-conv head (``pooled``).
    The forward stops at the head."""

    def __init__(self, network: nn.Module, head_name: str, pooled: bool) -> None:
        super().__init__()
        self.network = network
        self.head_name = head_name
        self.pooled = pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = _run_to_head(self.network, self.network.get_submodule(self.head_name), x, output=True)
        require(z is not None, f"the head '{self.head_name}' was never called in forward")
        return z.mean((2, 3)) if self.pooled else z


def _conv_as_linear(conv: nn.Conv2d) -> nn.Linear:
    """``nn.Linear(C, K)`` whose weight ``[K, C]`` and bias are views of a 1×1 conv's (shared storage:
    in-place changes to the conv show). Read-only: gradients go through the conv."""
    linear = nn.Linear(conv.in_channels, conv.out_channels, bias=conv.bias is not None, device="meta")
    # merging the trailing 1×1 dimensions is a view for any memory layout
    linear.weight = nn.Parameter(conv.weight.detach().view(conv.out_channels, conv.in_channels), False)
    if conv.bias is not None:
        linear.bias = nn.Parameter(conv.bias.detach(), requires_grad=False)
    return linear


class Classifier(nn.Module):
    """A network with its input normalisation, its logits and a located classification head.

    ``forward(x)`` maps pixel-space inputs ``[N, *input_shape]`` to logits ``[N, K]`` through ``net``;
    ``features(x)`` returns ``φ [N, D]``; ``head`` is an ``nn.Linear`` ``D → K`` with
    ``head(features(x)) == forward(x)`` once the output has been checked.

    ``output`` selects the logits among a tuple/list (index), dict (key) or dataclass (attribute)
    output; by default the one ``[N, K]`` tensor is used. The first forward settles the element;
    :meth:`check_output` / :meth:`check_split` also settle whether the output is logits or
    log-probabilities. Until then ``net`` is the user's network: run one of them on a few inputs
    before using ``net`` directly (:class:`~bayescli.models.features.FeatureStream`,
    :func:`~bayescli.models.features.logit_pass` and the all-layer Laplace fit do).
    """

    def __init__(
        self,
        net: nn.Module,
        head_name: str,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        output: int | str | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.head_name = head_name
        modules = dict(net.named_modules())
        require(head_name in modules, f"no module named '{head_name}' in the model; see --head")
        layer = modules[head_name]
        if isinstance(layer, nn.Linear):
            self.head_kind = "linear"
        elif _is_conv1x1(layer):
            self.head_kind = "conv1x1-pool"
        else:
            conv = isinstance(layer, nn.Conv2d)
            shape = f" with a {'×'.join(map(str, layer.kernel_size))} kernel" if conv else ""
            raise BayescliError(
                f"head '{head_name}' is a {type(layer).__name__}{shape}, not nn.Linear or a 1×1 Conv2d "
                "followed by global average pooling; pass --head NAME of the final linear layer"
            )
        self.output = output
        self.output_kind: str | None = None
        self._resolved = False
        self._static_problem = _static_problem(net, head_name)
        self._problem = self._static_problem
        self._linear_cache: tuple[tuple, nn.Linear] | None = None
        self.register_buffer("mean", torch.tensor(mean if mean else [0.0]))
        self.register_buffer("std", torch.tensor(std if std else [1.0]))

    # -- the parts --------------------------------------------------------------------------------

    @property
    def network(self) -> nn.Module:
        """The user's network (``net`` may wrap it to return logits)."""
        return self.net.network if isinstance(self.net, (SelectOutput, HeadLogits)) else self.net

    @property
    def _layer(self) -> nn.Module:
        return self.network.get_submodule(self.head_name)

    @property
    def num_classes(self) -> int:
        layer = self._layer
        return layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels

    @property
    def feature_dim(self) -> int:
        layer = self._layer
        return layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels

    @property
    def last_layer_exact(self) -> bool:
        """False once a reason is known why ``head(features(x))`` cannot give the logits."""
        return self._problem is None

    @property
    def head(self) -> nn.Linear:
        """The head as an ``nn.Linear`` ``D → K`` (for a 1×1-conv head, one sharing its weights)."""
        self._require_last_layer()
        return self._linear_head()

    def _linear_head(self) -> nn.Linear:
        layer = self._layer
        if isinstance(layer, nn.Linear):
            return layer
        # the views follow in-place changes; rebuilt when the conv's tensors are replaced (.to, .double)
        key = tuple((t.data_ptr(), t.dtype, t.device) for t in (layer.weight, layer.bias) if t is not None)
        if self._linear_cache is None or self._linear_cache[0] != key:
            self._linear_cache = (key, _conv_as_linear(layer))
        return self._linear_cache[1]

    def _require_last_layer(self) -> None:
        if self._problem is not None:
            raise BayescliError(self._problem)

    def describe(self) -> dict:
        """JSON-ready facts: ``head`` (its name), ``head_kind`` (``"linear"`` | ``"conv1x1-pool"``),
        ``feature_dim`` D, ``num_classes`` K, ``output`` (the selected element's index or key, ``None``
        for a tensor output), ``output_kind`` (``"logits"`` | ``"log-probabilities"``, ``None`` until
        checked or when the last layer is inexact) and ``last_layer_exact``."""
        return {
            "head": self.head_name,
            "head_kind": self.head_kind,
            "feature_dim": self.feature_dim,
            "num_classes": self.num_classes,
            "output": self.output,
            "output_kind": self.output_kind,
            "last_layer_exact": self.last_layer_exact,
        }

    # -- forward ----------------------------------------------------------------------------------

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """``(x - mean) / std``: per channel for images ``[N, C, H, W]``, per column for ``[N, D]``."""
        if x.dim() == 4:
            return (x - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)
        return (x - self.mean) / self.std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, K]`` of pixel-space inputs ``x`` (the network's own output before
        :meth:`check_output` has found it to be log-probabilities)."""
        xn = self.normalise(x)
        if self._resolved:
            return self.net(xn)
        return self._resolve(self.network(xn))

    def _resolve(self, out: Any) -> torch.Tensor:
        """The logits element of the network's output ``out``; the first call settles which it is."""
        if not self._resolved:
            if isinstance(out, torch.Tensor):
                require(
                    self.output is None,
                    f"--output {self.output} was given but the model returns one tensor "
                    f"{list(out.shape)}; drop --output",
                )
            else:
                self.output = _choose(out, self.output, self.num_classes)
            self._resolved = True
            self._rebuild_net()
        return out if self.output is None else _element(out, self.output)

    def _rebuild_net(self) -> None:
        network = self.network
        if self.output_kind == "log-probabilities":
            wanted: nn.Module = HeadLogits(network, self.head_name, self.head_kind == "conv1x1-pool")
        elif self.output is not None:
            wanted = SelectOutput(network, self.output)
        else:
            wanted = network
        if type(wanted) is not type(self.net):
            self.net = wanted

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features ``φ(x)`` ``[N, D]``: the head's input (averaged over positions for a
        1×1-conv head). The forward stops at the head."""
        self._require_last_layer()
        phi = _run_to_head(self.network, self._layer, self.normalise(x), output=False)
        require(phi is not None, f"the head '{self.head_name}' was never called in forward")
        problem = self._feature_problem(phi)
        require(problem is None, problem or "")
        return phi if self.head_kind == "linear" else phi.mean((2, 3))

    def _feature_problem(self, head_input: torch.Tensor) -> str | None:
        want = 2 if self.head_kind == "linear" else 4
        if head_input.dim() == want:
            return None
        what = "[N, D] features" if want == 2 else "[N, C, H, W] maps for a 1×1-conv head"
        return (
            f"the head '{self.head_name}' receives a {head_input.dim()}-D input {list(head_input.shape)}; "
            f"bayescli needs {what}, pick another --head"
        )

    # -- checks -----------------------------------------------------------------------------------

    def check_output(self, x: torch.Tensor) -> dict:
        """Settle what the network outputs, on a few pixel-space inputs ``x [n, ...]``; returns
        :meth:`describe`.

        Picks the logits element (see ``output``) and, unless a non-linearity after the head is
        already known, compares ``head(features(x))`` with it: equal → ``"logits"``; different by a
        constant per row → ``"log-probabilities"`` (``net`` then returns the head's logits);
        otherwise the last layer is recorded as inexact with the reason (raised later by
        ``features``, ``head`` and :meth:`check_split`). Whole-network methods need only this call.
        Raises :class:`BayescliError` for an ambiguous or missing logits element and for non-finite
        outputs.
        """
        self._check(x)
        return self.describe()

    def check_split(self, x: torch.Tensor) -> float:
        """Verify that ``head(features(x))`` reproduces the network's logits; returns the max abs
        difference (after removing the per-row constant for log-probability outputs).

        Raises :class:`BayescliError` when it does not (to ``SPLIT_TOLERANCE`` times the outputs'
        scale), naming the cause: a non-linearity after the head, a later linear layer, an output of
        probabilities.
        """
        diff = self._check(x)
        self._require_last_layer()
        return float(diff)

    def _check(self, x: torch.Tensor) -> float | None:
        layer, xn = self._layer, self.normalise(x)
        order: list[tuple[str, nn.Module]] = []
        inputs: list[torch.Tensor] = []
        handles = [
            m.register_forward_hook(lambda _m, _a, _o, n=name, m=m: order.append((n, m)))
            for name, m in _leaves(self.network, "")
        ]
        handles.append(layer.register_forward_pre_hook(lambda _m, args: inputs.append(args[0])))
        try:
            with torch.inference_mode():
                full = self._resolve(self.network(xn))
        finally:
            for h in handles:
                h.remove()
        if not torch.isfinite(full).all():
            raise BayescliError(
                "the model produces non-finite features/logits (NaN or inf) on these inputs; "
                "check the checkpoint and the input scaling"
            )
        self.output_kind, problem, diff = None, self._static_problem, None
        if problem is None:
            problem = f"the head '{self.head_name}' was never called in forward" if not inputs else None
        if problem is None:
            problem = self._feature_problem(inputs[0])
        if problem is None:
            phi = inputs[0] if self.head_kind == "linear" else inputs[0].mean((2, 3))
            with torch.inference_mode():
                split = self._linear_head()(phi)
            kind, diff, problem = self._compare(full, split, order)
            self.output_kind = kind
        self._problem = problem
        self._rebuild_net()
        return diff

    def _compare(
        self, full: torch.Tensor, split: torch.Tensor, order: list[tuple[str, nn.Module]]
    ) -> tuple[str | None, float, str | None]:
        """``(output kind, max abs difference, problem)`` of the network's output ``full [n, K]``
        against the head's ``split [n, K]``; ``order`` lists the leaf modules in call order."""
        heads = [i for i, (n, _) in enumerate(order) if n == self.head_name]
        after = order[heads[-1] + 1 :] if heads else []
        last_layer = [n for n, m in order if _is_head_layer(m)][-1:]
        hint = f" (the last linear layer applied is '{last_layer[0]}')" if last_layer else ""
        if full.shape != split.shape:
            problem = (
                f"the model's output {list(full.shape)} is not the head's output {list(split.shape)}; "
                f"pass --head NAME of the final linear layer{hint}"
            )
            return None, float("inf"), problem
        full, split = full.double(), split.double()
        # float32 rounding grows with the magnitude of the outputs (log-probabilities reach −30 and more)
        tol = SPLIT_TOLERANCE * max(1.0, full.abs().max().item(), split.abs().max().item())
        delta = full - split
        diff = delta.abs().max().item()
        if diff <= tol:
            return "logits", diff, None
        # log-probabilities: log_softmax(z) = z − logsumexp(z), the same softmax as z
        shifted = (delta - delta.mean(1, keepdim=True)).abs().max().item()
        if full.shape[1] > 1 and shifted <= tol:
            return "log-probabilities", shifted, None
        nonlinear = [(n, m) for n, m in after if _is_nonlinear(m)]
        if nonlinear:
            return None, diff, _nonlinear_message(self.head_name, *nonlinear[0])
        prefix = f"head(features(x)) differs from the model's output by {diff:.2e} > {tol:.1e}"
        later = [n for n, m in after if isinstance(m, _LAYERS)]
        sums = full.sum(1)
        if not later and (full >= 0).all() and (sums - 1).abs().max().item() <= 1e-4:
            problem = (
                f"{prefix}: the model outputs probabilities (rows sum to 1), not logits or "
                "log-probabilities; pass --output of the logits or remove the final softmax"
            )
            return None, diff, problem
        return None, diff, f"{prefix}: '{self.head_name}' is not the final layer{hint}; pass --head NAME"
