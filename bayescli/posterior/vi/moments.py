"""Moment propagation through a network's real forward pass (VI-SPEC C1, [002] §3.3).

Every unit carries a mean ``x`` and a variance ``v`` (independent Gaussian units, [002]
Assumptions 2–3). :class:`MomentPropagator` traces ``forward`` once with ``torch.fx`` and then
interprets the graph on :class:`Moments`, so residual additions, ``torch.flatten``, ``F.relu``,
``x.mean((2, 3))`` or ``view`` written in ``forward`` code (torchvision/timm ResNets) are followed
exactly as the network computes them. Rules (:mod:`bayescli.posterior.vi.moment_rules`):

* ``nn.Linear`` / ``nn.Conv{1,2,3}d`` with multiplicative noise ``a_j`` per input unit (conv:
  per input channel): ``μ = Mx + b``, ``v' = (M∘M)((1+a)∘v + a∘x²)`` [002:(9)] — one extra
  matmul/convolution with the squared weights and the layer's own stride/padding/groups. A layer
  without noise (or ``F.linear``/``F.conv*d`` on fixed tensors) gives ``v' = (M∘M) v``.
* ReLU [002:(11)], computed as ``V = σ² g(μ/σ)`` with ``g(r) = r²Φ(r)Φ(−r) + Φ(r) +
  rφ(r)(Φ(−r) − Φ(r)) − φ(r)²``, which is free of the cancellation of the textbook
  ``(μ²+σ²)Φ + μσφ − E²``. That cancellation is why [002:App A] floors the variance at 1e-5;
  we need no floor (only ``1e-30`` against 0/0), so deterministic inputs pass ReLU exactly and
  ``a → 0`` recovers the deterministic network.
* other elementwise activations (GELU, SiLU, tanh, sigmoid, ELU, LeakyReLU, …) [002:(12)]:
  ``E = f(μ)``, ``V = f'(μ)² v`` with ``f'`` by forward-mode autodiff.
* BatchNorm [002:(13)]: means as the layer computes them (running statistics in eval mode,
  batch statistics of the means in training mode), ``v' = γ² v / (var + ε)``.
* MaxPool [002:3.3.3]: mean and variance of the unit with the largest mean.
* Not in the paper (VI-SPEC C1 RECOMMEND, independence assumption): average pools and
  ``mean``/``sum`` reductions ``v' = Σ w² v``; residual ``+``/``−`` add variances; products with
  constants scale by ``c²``; products of two random tensors use the independent-product rule;
  flatten/view/reshape/permute/indexing/``cat`` rearrange both; dropout is the identity.

An operation with no rule raises :class:`BayescliError` naming it and suggesting
the setting ``subset=last-layer``.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from bayescli.errors import BayescliError
from bayescli.posterior.vi.moment_rules import (
    Moments,
    adaptive_avgpool_moments,
    affine_moments,
    avgpool_moments,
    batchnorm_moments,
    maxpool_moments,
    product_moments,
    quotient_moments,
    reduce_moments,
    relu_moments,
    sum_moments,
    taylor_moments,
)

NOISY_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


# ---------------------------------------------------------------------------------------------
# dispatch tables
# ---------------------------------------------------------------------------------------------

_ACTIVATION_MODULES = (
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.LeakyReLU,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.ReLU6,
    nn.Mish,
    nn.Softplus,
)
_ACTIVATION_FUNCTIONS = {
    F.gelu,
    F.silu,
    F.tanh,
    F.sigmoid,
    torch.tanh,
    torch.sigmoid,
    F.elu,
    F.celu,
    F.selu,
    F.leaky_relu,
    F.hardswish,
    F.hardsigmoid,
    F.hardtanh,
    F.relu6,
    F.mish,
    F.softplus,
}
_ACTIVATION_METHODS = {"tanh", "tanh_", "sigmoid", "sigmoid_"}
_RELU_FUNCTIONS = {F.relu, torch.relu, F.relu_, torch.relu_}
_RELU_METHODS = {"relu", "relu_"}
_STRUCTURAL_MODULES = (nn.Flatten, nn.Unflatten, nn.Identity)
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
_DROPOUT_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout}
_STRUCTURAL_FUNCTIONS = {
    torch.flatten,
    torch.reshape,
    torch.squeeze,
    torch.unsqueeze,
    torch.permute,
    torch.transpose,
    torch.narrow,
    torch.movedim,
    torch.clone,
    operator.getitem,
}
_STRUCTURAL_METHODS = {
    "view",
    "reshape",
    "flatten",
    "permute",
    "transpose",
    "squeeze",
    "unsqueeze",
    "contiguous",
    "clone",
    "narrow",
    "movedim",
    "expand",
    "expand_as",
    "view_as",
    "reshape_as",
    "t",
    "float",
    "double",
    "to",
    "type_as",
    "__getitem__",
}
_SPLIT_METHODS = {"chunk", "split", "unbind", "tensor_split"}
_SPLIT_FUNCTIONS = {torch.chunk, torch.split, torch.unbind, torch.tensor_split}
_CAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate, torch.stack}
_ADD = {operator.add, operator.iadd, torch.add}
_SUB = {operator.sub, operator.isub, torch.sub}
_MUL = {operator.mul, operator.imul, torch.mul}
_DIV = {operator.truediv, operator.itruediv, torch.div}
_NEG = {operator.neg, torch.neg}
_SHAPE_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda"}
_SHAPE_METHODS = {"size", "dim", "numel", "ndimension"}


def _name(target: Any) -> str:
    if isinstance(target, str):
        return f"Tensor.{target}"
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__name__', repr(target))}".lstrip(".")


def _has_moments(obj: Any) -> bool:
    if isinstance(obj, Moments):
        return True
    if isinstance(obj, list | tuple):
        return any(_has_moments(o) for o in obj)
    if isinstance(obj, dict):
        return any(_has_moments(o) for o in obj.values())
    return False


def _both(fn: Callable[[torch.Tensor], Any], x: Moments) -> Any:
    """Apply a rearrangement to mean and variance (tuples of results become tuples of Moments)."""
    mean = fn(x.mean)
    var = None if x.var is None else fn(x.var)
    if isinstance(mean, tuple | list):
        return type(mean)(
            Moments(m, None if var is None else v) for m, v in zip(mean, var or mean, strict=True)
        )
    return Moments(mean, var)


def _strip_inplace(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k != "inplace"}


def unsupported(what: str) -> BayescliError:
    return BayescliError(
        f"MNVI moment propagation has no rule for {what}; use subset last-layer "
        "(or replace the operation in the model)"
    )


# ---------------------------------------------------------------------------------------------
# the propagator
# ---------------------------------------------------------------------------------------------


class MomentPropagator:
    """Propagate ``(mean, var)`` through ``net``'s traced forward pass.

    ``layers`` maps the name of every ``nn.Linear``/``nn.Conv*d`` called in ``forward`` to its
    number of noise units (``in_features`` / ``in_channels``), in call order. Modules are looked
    up in ``net`` at every call, so training ``net`` (or overriding weights with ``params``) is
    seen by the next propagation.
    """

    def __init__(self, net: nn.Module) -> None:
        self.net = net
        try:
            self.graph = fx.Tracer().trace(net)
        except Exception as exc:  # fx raises many types (TraceError, TypeError, RuntimeError …)
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
            raise BayescliError(
                f"cannot trace {type(net).__name__}.forward for MNVI moment propagation ({first}); "
                "use subset last-layer"
            ) from None
        self.layers: dict[str, int] = {}
        # Squared weights for prediction (no gradient), keyed by layer: recomputed only when the
        # weight tensor or its version changes.
        self._squares: dict[str, tuple[int, int, torch.Tensor]] = {}
        for node in self.graph.nodes:
            if node.op == "call_module":
                mod = net.get_submodule(node.target)
                if isinstance(mod, NOISY_LAYERS):
                    units = mod.in_features if isinstance(mod, nn.Linear) else mod.in_channels
                    self.layers.setdefault(str(node.target), int(units))

    def layer(self, name: str) -> nn.Module:
        return self.net.get_submodule(name)

    def __call__(
        self,
        x: torch.Tensor,
        noise: Mapping[str, torch.Tensor] | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
        input_var: torch.Tensor | None = None,
    ) -> Moments:
        """Output moments of ``net(x)`` for an input ``x [N, ...]`` (deterministic, or with
        independent per-unit variances ``input_var``).

        ``noise[layer]`` is ``a [units]`` (variances, not ρ); layers without an entry have fixed
        weights. ``params`` overrides ``"<layer>.weight"``/``"<layer>.bias"`` of noisy layers
        (the variational means when they differ from the net's own weights).
        """
        run = _Run(self, noise or {}, params or {})
        env: dict[fx.Node, Any] = {}
        first = True
        for node in self.graph.nodes:
            if node.op == "placeholder":
                if first:
                    env[node], first = Moments(x, input_var), False
                elif node.args:
                    env[node] = node.args[0]
                else:
                    raise BayescliError(
                        f"{type(self.net).__name__}.forward needs argument '{node.target}'; MNVI "
                        "propagates single-input networks only (use subset last-layer)"
                    )
                continue
            if node.op == "output":
                out = fx.node.map_arg(node.args[0], lambda n: env[n])
                if not isinstance(out, Moments):
                    raise BayescliError(
                        f"{type(self.net).__name__}.forward returns {type(out).__name__}, not one "
                        "logit tensor; use subset last-layer"
                    )
                return Moments(out.mean, out.variance())
            args = fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
            env[node] = run.node(node, args, kwargs)
        raise BayescliError("the traced graph has no output")  # fx graphs always have one


class _Run:
    """One propagation: the noise and weight overrides, and the per-op dispatch."""

    def __init__(
        self, prop: MomentPropagator, noise: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
    ) -> None:
        self.prop, self.net, self.noise, self.params = prop, prop.net, noise, params

    def square(self, name: str, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight²`` from the cache when no gradient is needed (``None``: compute it inline)."""
        if torch.is_grad_enabled() and weight.requires_grad:
            return None
        key = (weight.data_ptr(), weight._version)
        hit = self.prop._squares.get(name)
        if hit is None or hit[:2] != key or hit[2].dtype != weight.dtype:
            hit = (*key, weight.detach().square())
            self.prop._squares[name] = hit
        return hit[2]

    def node(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        if node.op == "get_attr":
            return self.params.get(str(node.target), _fetch(self.net, str(node.target)))
        if not _has_moments((args, kwargs)):
            return _plain(self.net, node, args, kwargs)
        if node.op == "call_module":
            return self.module(str(node.target), self.net.get_submodule(node.target), args, kwargs)
        if node.op == "call_method":
            return self.method(node.target, args, kwargs)
        return self.function(node.target, args, kwargs)

    # -- modules --------------------------------------------------------------------------

    def module(self, name: str, mod: nn.Module, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        if not isinstance(x, Moments) or len(args) > 1 or kwargs:
            raise unsupported(f"{type(mod).__name__} '{name}' called with several inputs")
        if isinstance(mod, nn.Linear):
            w = self.params.get(f"{name}.weight", mod.weight)
            b = self.params.get(f"{name}.bias", mod.bias)
            return affine_moments(
                F.linear, x, w, b, self.noise.get(name), channel_last=True, weight_sq=self.square(name, w)
            )
        if isinstance(mod, nn.Conv1d | nn.Conv2d | nn.Conv3d):
            w = self.params.get(f"{name}.weight", mod.weight)
            b = self.params.get(f"{name}.bias", mod.bias)
            return affine_moments(
                mod._conv_forward, x, w, b, self.noise.get(name), False, weight_sq=self.square(name, w)
            )
        if isinstance(mod, nn.ReLU):
            return relu_moments(x.mean, x.var)
        if isinstance(mod, _ACTIVATION_MODULES):
            if getattr(mod, "inplace", False):
                fn = copy.copy(mod)
                fn.inplace = False
                return taylor_moments(fn, x.mean, x.var)
            return taylor_moments(mod, x.mean, x.var)
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            use_batch = mod.training or mod.running_var is None
            momentum = 0.0 if mod.momentum is None else mod.momentum
            if mod.training and mod.track_running_stats and mod.num_batches_tracked is not None:
                mod.num_batches_tracked.add_(1)
                if mod.momentum is None:
                    momentum = 1.0 / float(mod.num_batches_tracked)
            return batchnorm_moments(
                x, mod.running_mean, mod.running_var, mod.weight, mod.bias, use_batch, momentum, mod.eps
            )
        if isinstance(mod, nn.MaxPool1d | nn.MaxPool2d | nn.AdaptiveMaxPool2d):
            pool = _with_indices(mod)
            return maxpool_moments(pool, x)
        if isinstance(mod, nn.AvgPool2d):

            def pool(t: torch.Tensor, divisor_override: int | None = mod.divisor_override) -> torch.Tensor:
                return F.avg_pool2d(
                    t, mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode, mod.count_include_pad,
                    divisor_override,
                )  # fmt: skip

            return avgpool_moments(pool, x)
        if isinstance(mod, nn.AdaptiveAvgPool1d | nn.AdaptiveAvgPool2d):
            return adaptive_avgpool_moments(x, mod.output_size)
        if isinstance(mod, _DROPOUT_MODULES):
            return x
        if isinstance(mod, _STRUCTURAL_MODULES):
            return _both(mod, x)
        raise unsupported(f"module {type(mod).__name__} ('{name}')")

    # -- functions and methods ------------------------------------------------------------

    def function(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        if fn in _ADD or fn in _SUB:
            if kwargs.get("alpha", 1) != 1:
                raise unsupported(f"{_name(fn)} with alpha")
            return sum_moments(args[0], args[1], 1.0 if fn in _ADD else -1.0)
        if fn in _MUL:
            return product_moments(args[0], args[1])
        if fn in _DIV and not kwargs:
            return quotient_moments(args[0], args[1])
        if fn in _NEG:
            return Moments(-args[0].mean, args[0].var)
        x = args[0]
        if fn is operator.getitem and not isinstance(x, Moments):
            return x[args[1]]
        if fn in _CAT_FUNCTIONS:
            return _cat(fn, x, *args[1:], **kwargs)
        if not isinstance(x, Moments) or _has_moments((args[1:], kwargs)):
            raise unsupported(f"{_name(fn)} on these inputs")
        rest = args[1:]
        if fn in _RELU_FUNCTIONS:
            return relu_moments(x.mean, x.var)
        if fn in _ACTIVATION_FUNCTIONS:
            kw = _strip_inplace(kwargs)
            return taylor_moments(lambda t: fn(t, *rest, **kw), x.mean, x.var)
        if fn in _DROPOUT_FUNCTIONS:
            return x
        if fn in _STRUCTURAL_FUNCTIONS or fn in _SPLIT_FUNCTIONS:
            return _both(lambda t: fn(t, *rest, **kwargs), x)
        if fn in (torch.mean, torch.sum):
            return reduce_moments(fn.__name__, x, rest, kwargs)
        if fn is F.linear or fn in (F.conv1d, F.conv2d, F.conv3d):
            weight = _arg(rest, kwargs, 0, "weight")
            bias = _arg(rest, kwargs, 1, "bias")
            extra = rest[2:]
            ckw = {k: v for k, v in kwargs.items() if k not in ("weight", "bias")}
            return affine_moments(
                lambda t, w, b: fn(t, w, b, *extra, **ckw), x, weight, bias, None, fn is F.linear
            )
        if fn is F.batch_norm:
            names = ("running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
            defaults = (None, None, None, None, False, 0.1, 1e-5)
            vals = [_arg(rest, kwargs, i, n, d) for i, (n, d) in enumerate(zip(names, defaults, strict=True))]
            rm, rv, w, b, training, momentum, eps = vals
            return batchnorm_moments(x, rm, rv, w, b, bool(training) or rv is None, momentum, eps)
        if fn in (F.max_pool1d, F.max_pool2d, F.adaptive_max_pool2d):
            kw = {k: v for k, v in kwargs.items() if k != "return_indices"}
            if fn is F.adaptive_max_pool2d:
                return maxpool_moments(lambda t: fn(t, *rest, return_indices=True), x)
            names = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
            bound = {n: _arg(rest, kw, i, n, None) for i, n in enumerate(names)}
            bound = {k: v for k, v in bound.items() if v is not None}
            return maxpool_moments(lambda t: fn(t, **bound, return_indices=True), x)
        if fn is F.avg_pool2d:
            names = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
            bound = {n: _arg(rest, kwargs, i, n, None) for i, n in enumerate(names)}
            bound = {k: v for k, v in bound.items() if v is not None}
            own = bound.pop("divisor_override", None)

            def pool(t: torch.Tensor, divisor_override: int | None = own) -> torch.Tensor:
                return F.avg_pool2d(t, **bound, divisor_override=divisor_override)

            return avgpool_moments(pool, x)
        if fn in (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d):
            return adaptive_avgpool_moments(x, _arg(rest, kwargs, 0, "output_size"))
        if fn is getattr and rest and rest[0] in _SHAPE_ATTRS:
            return getattr(x.mean, rest[0])
        raise unsupported(f"function {_name(fn)}")

    def method(self, name: str, args: tuple, kwargs: dict) -> Any:
        x, rest = args[0], args[1:]
        if not isinstance(x, Moments):
            if name in ("add", "add_", "sub", "sub_", "mul", "mul_") and isinstance(rest[0], Moments):
                return self.function({"a": torch.add, "s": torch.sub, "m": torch.mul}[name[0]], args, kwargs)
            raise unsupported(f"method Tensor.{name} with a random argument")
        if name in ("add", "add_", "sub", "sub_"):
            return self.function(torch.add if name.startswith("add") else torch.sub, args, kwargs)
        if name in ("mul", "mul_"):
            return product_moments(x, rest[0])
        if name in ("div", "div_") and not kwargs:
            return quotient_moments(x, rest[0])
        if name in ("neg", "neg_"):
            return Moments(-x.mean, x.var)
        if _has_moments((rest, kwargs)):
            raise unsupported(f"method Tensor.{name} with several random inputs")
        if name in _SHAPE_METHODS:
            return getattr(x.mean, name)(*rest, **kwargs)
        if name in _RELU_METHODS:
            return relu_moments(x.mean, x.var)
        if name in _ACTIVATION_METHODS:
            plain = name.rstrip("_")
            return taylor_moments(lambda t: getattr(t, plain)(), x.mean, x.var)
        if name in _STRUCTURAL_METHODS or name in _SPLIT_METHODS:
            return _both(lambda t: getattr(t, name)(*rest, **kwargs), x)
        if name in ("mean", "sum"):
            return reduce_moments(name, x, rest, kwargs)
        raise unsupported(f"method Tensor.{name}")


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if index < len(args):
        return args[index]
    return kwargs.get(name, default)


def _with_indices(mod: nn.Module) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(mod, nn.AdaptiveMaxPool2d):
        return lambda t: F.adaptive_max_pool2d(t, mod.output_size, return_indices=True)
    fn = F.max_pool1d if isinstance(mod, nn.MaxPool1d) else F.max_pool2d
    return lambda t: fn(t, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode, True)


def _cat(fn: Any, parts: Any, *args: Any, **kwargs: Any) -> Moments:
    items = [p if isinstance(p, Moments) else Moments(p, None) for p in parts]
    mean = fn([p.mean for p in items], *args, **kwargs)
    if all(p.var is None for p in items):
        return Moments(mean, None)
    return Moments(mean, fn([p.variance() for p in items], *args, **kwargs))


def _fetch(net: nn.Module, target: str) -> Any:
    obj: Any = net
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _plain(net: nn.Module, node: fx.Node, args: tuple, kwargs: dict) -> Any:
    """An operation on deterministic values only: run it as the network would."""
    if node.op == "call_module":
        return net.get_submodule(node.target)(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)
