"""Run "CUDA" code paths on a CPU-only machine, checking device discipline and counting host transfers.

Code that claims to keep its maths on the GPU can only be checked on a GPU — unless the GPU is
emulated. Inside ``with emulated_cuda() as stats:``

* ``torch.device("cuda")`` works as usual in user code: factories (``torch.zeros(..., device="cuda")``,
  ``torch.tensor(..., device=dev)``, ``*_like``, ``new_*``), ``Tensor.to("cuda")``/``.cuda()`` and
  ``nn.Module.to("cuda")``/``.cuda()`` give :class:`EmulatedCudaTensor` objects that report
  ``device == cuda:0`` and ``is_cuda`` but keep their data in a plain CPU tensor, so the numbers
  are the CPU run's numbers;
* an op that mixes an emulated tensor with a plain CPU tensor of one or more dimensions raises
  the same ``RuntimeError`` real CUDA raises (0-dim CPU tensors pass, as CUDA treats them as
  scalars);
* every device→host copy (``.cpu()``, ``.to("cpu")``, ``.tolist()``, copying into a CPU tensor,
  printing), every scalar read (``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``), every
  host→device copy and every ``torch.cuda.synchronize()`` is counted in ``stats``, with a note of
  where in ``bayescli`` it happened;
* ``torch.cuda.is_available()`` is True, and the handful of ``torch.cuda`` functions the project
  calls are stubbed for one device.

How it works. An :class:`EmulatedCudaTensor` is a wrapper subclass: its ``__torch_dispatch__``
runs every aten op on the CPU tensors it wraps. Autograd runs on the wrappers themselves, the way
``torch/testing/_internal/logging_tensor.py`` (LoggingTensor) does it: the wrapper may require
grad, the wrapped tensor never does, and dispatch happens below autograd, so backward formulas
run through the same ``__torch_dispatch__``.

The wrapper's C++ device is ``meta``, not ``cuda``; only the Python-visible attributes
(``.device``, ``.is_cuda``, ``.get_device()``, ``repr``) say ``cuda:0``. A wrapper whose C++
device is ``cuda`` aborts the interpreter on a machine without a driver: autograd asks the CUDA
runtime for the current stream as soon as such a tensor enters a graph. ``meta`` has a no-op
device guard and runs on autograd's CPU queue, and C++ code that makes tensors "like" a wrapper
(``at::zeros(sizes, grad.options())`` in backward formulas, the engine's zero gradients) asks
for ``meta``, which the emulation turns into emulated tensors. Consequences:

* inside the context ``device="meta"`` means the emulated GPU: code under test cannot use real
  meta tensors there;
* a ``TorchFunctionMode`` rewrites ``device="cuda"`` arguments to ``meta`` before PyTorch's
  Python bindings see them (they would otherwise initialise the real CUDA runtime), and a
  ``TorchDispatchMode`` turns ``meta`` (and any ``cuda`` that slipped through) factory results
  into emulated tensors.

Random numbers. ``torch.Generator(device="cuda")`` needs the CUDA runtime, so inside the context
``torch.Generator`` is replaced by a factory that hands out a CPU generator for CUDA devices
(:func:`cpu_generator` does the same outside it). Code under test should create its generators
through ``bayescli.devices.generator(device, seed)``; a test may also monkeypatch that function
with :func:`cpu_generator`. Random ops on emulated tensors run on the CPU with the given (CPU)
generator or the CPU default generator, so seeded draws equal the CPU run's draws (on real CUDA
they differ: different streams).

Known limits (all raise rather than give wrong numbers where they can be detected):

* in-place ops that change an emulated tensor's shape or strides (``resize_``, ``t_``,
  ``unsqueeze_``, ``out=`` tensors of the wrong size) raise ``NotImplementedError``;
* ``nn.Module.to("cuda")`` replaces the Parameter objects (real CUDA keeps them): build
  optimizers after moving the model;
* ``data_ptr()``/``untyped_storage()`` of emulated tensors are unavailable; pickling or
  ``torch.save`` of an emulated tensor stores a CPU tensor (counted as a device→host copy);
* host syncs hidden inside ops (``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``,
  ``repeat_interleave`` without ``output_size``, ``linalg`` error checks) are counted in
  ``stats.implicit_syncs`` on a best-effort list; under ``torch.inference_mode()`` composite ops
  (``linalg.cholesky``, ...) reach the wrapper whole, so the error checks inside them go
  uncounted there (explicit reads and copies are always counted);
* ``.to("cuda")`` inside a Python-implemented torch function (one that handles
  ``__torch_function__`` itself) bypasses the function mode and fails as on a machine without a
  GPU; factories there still work.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "CUDA0",
    "EmulatedCudaTensor",
    "TransferStats",
    "cpu_generator",
    "current_stats",
    "emulated",
    "emulated_cuda",
    "is_emulated",
    "machine_without_gpu",
    "real_cuda_available",
]

aten = torch.ops.aten

#: What emulated tensors report as their device.
CUDA0 = torch.device("cuda", 0)
_CPU = torch.device("cpu")
# The C++ device of the wrappers (see the module docstring for why not ``cuda``).
_BACKING = torch.device("meta")
_MIXED = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


@dataclass
class TransferStats:
    """What crossed between the emulated device and the host inside one ``emulated_cuda()`` block.

    ``d2h``/``d2h_bytes``: device→host copies (``.cpu()``, ``.to("cpu")``, ``.tolist()``, copies
    into CPU tensors, printing); ``h2d``/``h2d_bytes``: host→device copies; ``syncs``: scalar reads
    (``.item()``, ``float()``, ``int()``, ``bool()``, ``torch.equal``); ``implicit_syncs``: ops that
    make real CUDA wait for the device to know an output size or an error flag; ``synchronize``:
    ``torch.cuda.synchronize()`` calls. ``events`` says, for each, which op and where (the
    innermost ``bayescli`` frame when there is one), so a failing test can show the culprits.
    """

    d2h: int = 0
    d2h_bytes: int = 0
    h2d: int = 0
    h2d_bytes: int = 0
    syncs: int = 0
    implicit_syncs: int = 0
    synchronize: int = 0
    events: list[str] = field(default_factory=list)

    def reset(self) -> None:
        """Zero every counter and forget the events (to measure one phase of a longer run)."""
        self.d2h = self.d2h_bytes = self.h2d = self.h2d_bytes = 0
        self.syncs = self.implicit_syncs = self.synchronize = 0
        self.events.clear()

    @property
    def host_reads(self) -> int:
        """Everything that makes the host wait for the device: copies back plus scalar reads."""
        return self.d2h + self.syncs + self.implicit_syncs

    def report(self, kinds: tuple[str, ...] = ("d2h", "sync", "implicit_sync")) -> str:
        """The events of the given kinds, one a line (for assertion messages)."""
        return "\n".join(e for e in self.events if e.split(" ", 1)[0] in kinds)


_STATS: list[TransferStats] = []


def current_stats() -> TransferStats | None:
    """The stats of the innermost active ``emulated_cuda()`` block, or None outside one."""
    return _STATS[-1] if _STATS else None


def _package_dir() -> str | None:
    mod = sys.modules.get("bayescli")
    file = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.abspath(file)) + os.sep if file else None


# co_filename -> what the frame is to _where: ("pkg", "bayescli/...") for the package, ("skip", "")
# for torch and this file, ("other", basename) elsewhere. Per (package dir, file): the package may be
# imported after the first event.
_FRAME_KINDS: dict[tuple[str | None, str], tuple[str, str]] = {}
_THIS_FILE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _frame_kind(pkg: str | None, filename: str) -> tuple[str, str]:
    key = (pkg, filename)
    kind = _FRAME_KINDS.get(key)
    if kind is None:
        path = os.path.abspath(filename)
        if pkg is not None and path.startswith(pkg):
            kind = ("pkg", os.path.join("bayescli", path[len(pkg) :]))
        elif path == _THIS_FILE or path.startswith(_TORCH_DIR):
            kind = ("skip", "")
        else:
            kind = ("other", os.path.basename(path))
        _FRAME_KINDS[key] = kind
    return kind


def _where() -> str:
    """The innermost ``bayescli`` frame of the current stack, else the innermost frame outside
    torch and this file: where a transfer was asked for, not where PyTorch carried it out.

    Walks the frames themselves: ``traceback.extract_stack`` reads every frame's source line,
    which made each recorded event cost milliseconds in loops that read a scalar per step."""
    pkg = _package_dir()
    fallback = None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        kind, name = _frame_kind(pkg, code.co_filename)
        if kind == "pkg":
            return f"{name}:{frame.f_lineno} in {code.co_name}"
        if fallback is None and kind == "other":
            fallback = f"{name}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return fallback or "?"


def _record(kind: str, op: str, nbytes: int = 0) -> None:
    stats = current_stats()
    if stats is None:
        return
    if kind == "d2h":
        stats.d2h += 1
        stats.d2h_bytes += nbytes
    elif kind == "h2d":
        stats.h2d += 1
        stats.h2d_bytes += nbytes
    elif kind == "sync":
        stats.syncs += 1
    elif kind == "implicit_sync":
        stats.implicit_syncs += 1
    elif kind == "synchronize":
        stats.synchronize += 1
    size = f" {nbytes} B" if kind in ("d2h", "h2d") else ""
    stats.events.append(f"{kind} {op}{size} at {_where()}")


# --------------------------------------------------------------------------------------------
# The tensor
# --------------------------------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_cuda_device(value: object) -> bool:
    """Whether ``value`` names a CUDA device (str, torch.device or, for ``.to``/``.cuda``, an int)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        dev = torch.device("cuda", value)
    elif isinstance(value, str):
        try:
            dev = torch.device(value)
        except RuntimeError:
            return False
    elif isinstance(value, torch.device):
        dev = value
    else:
        return False
    if dev.type != "cuda":
        return False
    if dev.index not in (None, 0):
        # One emulated device: asking for another is a bug in a test or in the code.
        raise RuntimeError(
            f"CUDA error: invalid device ordinal (emulated_cuda has one device, asked for {dev})"
        )
    return True


def _emulated_device(value: object) -> bool:
    """Whether a ``device`` argument seen at dispatch level means the emulated GPU."""
    return value is not None and torch.device(value).type in ("cuda", "meta")


def _wrap_new(t: Any) -> Any:
    return (
        EmulatedCudaTensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, EmulatedCudaTensor) else t
    )


def _plain(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, EmulatedCudaTensor)


def _op_name(func: torch._ops.OpOverload) -> str:
    name = func.__name__.removesuffix(".default")
    return f"aten.{name}" if func.namespace == "aten" else str(func)


def _check_plain(func: torch._ops.OpOverload, tensors: list[torch.Tensor]) -> None:
    """Refuse plain CPU tensors next to emulated ones, as CUDA kernels do (0-dim ones are scalars)."""
    for t in tensors:
        if t.device.type == "meta":
            raise RuntimeError(
                f"emulated_cuda: a plain meta tensor reached {_op_name(func)}; it was probably created "
                "outside the emulation (another thread, or after the block ended)"
            )
        if t.dim() > 0:
            raise RuntimeError(f"{_MIXED} (when checking arguments for {_op_name(func)})")


def _tensors(values: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in ``values`` (an op's arguments: tensors, scalars and lists or tuples of them),
    appended to ``out``. A dispatch-level argument is never a dict or a dataclass, so this walks
    less than ``tree_flatten`` and is the emulation's hottest helper."""
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            _tensors(v, out)
    return out


def _unwrap_args(values: tuple[Any, ...] | list[Any]) -> list[Any]:
    """``values`` with each emulated tensor, also inside lists and tuples, replaced by its ``elem``."""
    return [
        v.elem
        if isinstance(v, EmulatedCudaTensor)
        else _same_sequence(v, _unwrap_args(v))
        if isinstance(v, (list, tuple))
        else v
        for v in values
    ]


def _unwrap_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return dict(zip(kwargs, _unwrap_args(list(kwargs.values())), strict=True)) if kwargs else kwargs


def _wrap_out(out: Any) -> Any:
    """An op's CPU result as emulated tensors (tensors, also inside lists and tuples)."""
    if isinstance(out, torch.Tensor):
        return EmulatedCudaTensor(out)
    if isinstance(out, (list, tuple)):
        return _same_sequence(out, [_wrap_out(o) for o in out])
    return out


def _same_sequence(like: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    """``items`` in a sequence of ``like``'s type (list, tuple or named tuple)."""
    if type(like) is list:
        return items
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)


# Ops whose index arguments may live on the host (CUDA uploads them): the output lives with self.
_INDEX_OPS = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten._unsafe_index.Tensor,
}
# Ops returning a Python value computed from device data: a host sync each.
# (item and is_nonzero decompose into _local_scalar_dense, except under inference mode.)
_SCALAR_OPS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.allclose.default,
}
# Ops whose output size (or error flag) real CUDA must read back before returning.
_IMPLICIT_SYNC_OPS = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten._linalg_check_errors.default,
}


class _OpInfo:
    """What the wrapper's ``__torch_dispatch__`` needs to know about one OpOverload, worked out
    on its first call (the schema walk and the set lookups cost more than many CPU kernels)."""

    __slots__ = ("is_view", "name", "record", "special", "written")

    def __init__(self, func: torch._ops.OpOverload) -> None:
        self.name = _op_name(func)
        # (position, name) of every argument the op writes (in place or out=)
        self.written = tuple(
            (i, arg.name)
            for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        self.is_view = func.is_view
        self.record = (
            "sync" if func in _SCALAR_OPS else "implicit_sync" if func in _IMPLICIT_SYNC_OPS else None
        )
        self.special: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None
        if func is aten._to_copy.default:
            self.special = lambda f, args, kwargs: _to_copy(args[0], kwargs)
        elif func is aten.copy_.default:
            self.special = lambda f, args, kwargs: _copy_(*args, **kwargs)
        elif func.overloadpacket is aten.to:
            self.special = _to
        elif func in _INDEX_OPS:
            self.special = _index_op


_OP_INFO: dict[torch._ops.OpOverload, _OpInfo] = {}


def _op_info(func: torch._ops.OpOverload) -> _OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        info = _OP_INFO[func] = _OpInfo(func)
    return info


def _written_values(info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors the op writes (in place or ``out=``)."""
    values = [args[i] if i < len(args) else kwargs.get(name) for i, name in info.written]
    return _tensors(values, [])


def _check_written(info: _OpInfo, written: list[torch.Tensor]) -> None:
    """Refuse to write device results into host tensors (in place or ``out=``), 0-dim included:
    CUDA kernels only take host scalars as inputs."""
    if any(_plain(t) for t in written):
        raise RuntimeError(f"{_MIXED} (when checking the output of {info.name})")


class EmulatedCudaTensor(torch.Tensor):
    """A tensor that says it lives on ``cuda:0`` and keeps its data in a CPU tensor, ``elem``.

    Made by the factories and copies inside ``emulated_cuda()``, or directly with
    ``EmulatedCudaTensor(cpu_tensor)`` / :func:`emulated`. ``elem`` never requires grad; the
    wrapper does when asked, and autograd records on the wrapper.
    """

    elem: torch.Tensor
    __slots__ = ["elem"]

    # The wrapper does not take part in ``__torch_function__``: without this PyTorch would turn
    # the plain CPU results of ``.cpu()`` into this subclass.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor, *, requires_grad: bool = False) -> EmulatedCudaTensor:
        if isinstance(elem, EmulatedCudaTensor) or elem.device.type != "cpu":
            raise TypeError(
                f"EmulatedCudaTensor wraps a plain CPU tensor, got {type(elem).__name__} on {elem.device}"
            )
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=_BACKING,
            requires_grad=requires_grad,
        )
        # Autograd lives on the wrapper only (as in LoggingTensor): history on elem would be
        # recorded twice and never reach the wrapper's .grad.
        r.elem = elem.detach() if elem.requires_grad else elem
        return r

    # ---- what Python code sees --------------------------------------------------------------
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """``cuda:0`` (the C++ device is ``meta``; see the module docstring)."""
        return CUDA0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:  # type: ignore[override]
        return 0

    def __repr__(self, *, tensor_contents: str | None = None) -> str:  # type: ignore[override]
        """As PyTorch prints a dense CUDA tensor (``tensor([...], device='cuda:0', ...)``)."""
        # Printing a CUDA tensor copies it to the host: count it like any other copy.
        _record("d2h", "repr", _nbytes(self.elem))
        ts = torch._tensor_str
        prefix = "tensor("
        elem = self.elem
        suffixes = [f"device='{CUDA0}'"]
        defaults = (torch.get_default_dtype(), torch.int64, torch.bool)
        if elem.numel() == 0:
            contents = "[]"
            if elem.dim() != 1:
                suffixes.append(f"size={tuple(elem.shape)}")
            if elem.dtype != torch.get_default_dtype():
                suffixes.append(f"dtype={elem.dtype}")
        else:
            contents = ts._tensor_str(elem, len(prefix))
            if not ts.PRINT_OPTS.edgeitems:
                suffixes.append(f"size={tuple(elem.shape)}")
            if elem.dtype not in defaults:
                suffixes.append(f"dtype={elem.dtype}")
        if tensor_contents is not None:
            contents = tensor_contents
        if self.grad_fn is not None:
            name = type(self.grad_fn).__name__
            suffixes.append(
                f"grad_fn=<{self.grad_fn.name().rsplit('::', 1)[-1] if name == 'CppFunction' else name}>"
            )
        elif self.requires_grad:
            suffixes.append("requires_grad=True")
        text = ts._add_suffixes(prefix + contents, suffixes, len(prefix), force_newline=False)
        if getattr(self, "_is_param", False):  # as torch.nn.Parameter.__repr__ words it
            return "Parameter containing:\n" + text
        return text

    def __format__(self, format_spec: str) -> str:
        # Like torch.Tensor.__format__ for 0-dim tensors: a scalar read (a sync on CUDA).
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        """Raise like CUDA tensors do; ``force=True`` copies to the host first (counted)."""
        if force:
            return self.detach().cpu().numpy(force=True)
        raise TypeError(
            "can't convert cuda:0 device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def tolist(self) -> Any:  # type: ignore[override]
        """The values as Python numbers: one device→host copy."""
        return self.cpu().tolist()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickling a CUDA tensor copies it to the host; store the host copy.
        return self.detach().cpu().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> EmulatedCudaTensor:
        # torch.Tensor.__deepcopy__ looks at the storage, which a wrapper does not have.
        if id(self) in memo:
            return memo[id(self)]
        new = EmulatedCudaTensor(self.elem.clone(), requires_grad=self.requires_grad)
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for key, value in self.__dict__.items():
            setattr(new, key, copy.deepcopy(value, memo))
        return new

    # ---- below autograd ---------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(
        cls,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        info = _OP_INFO.get(func) or _op_info(func)
        if info.special is not None:
            return info.special(func, args, dict(kwargs or {}))
        kwargs = kwargs or {}
        flat = _tensors(kwargs.values(), _tensors(args, []))
        plain = [t for t in flat if not isinstance(t, EmulatedCudaTensor)]
        if plain:
            _check_plain(func, plain)
        written = _written_values(info, args, kwargs) if info.written else []
        if written:
            _check_written(info, written)
        if info.record is not None:
            _record(info.record, info.name)
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            _record("implicit_sync", info.name)

        to_host = False
        if kwargs.get("device") is not None:
            kwargs = dict(kwargs)
            if _emulated_device(kwargs["device"]):
                kwargs["device"] = _CPU
            else:  # an explicit CPU device (torch.zeros_like(x, device="cpu")): a host result
                to_host = True
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            kwargs["pin_memory"] = False  # pinning needs the CUDA runtime

        out = func(*_unwrap_args(args), **_unwrap_kwargs(kwargs))
        # In-place and out= ops return a fresh wrapper of the mutated elem here; PyTorch hands
        # the caller its own (mutated) argument instead, so ``x.add_(1) is x`` holds.
        if to_host:
            result = out
        elif info.is_view and isinstance(args[0], torch.Tensor) and not args[0].is_inference():
            # A view of a normal tensor is a normal tensor even in inference mode (autograd then
            # gives it its base's version counter, which an inference-mode wrapper cannot take).
            with torch.inference_mode(False):
                result = _wrap_out(out)
        else:
            result = _wrap_out(out)
        # Only a written argument can change its shape or strides in place (resize_, t_, out=).
        for t in written:
            if isinstance(t, EmulatedCudaTensor) and (
                t.shape != t.elem.shape or t.stride() != t.elem.stride()
            ):
                raise NotImplementedError(
                    f"emulated_cuda: {info.name} changed the shape or strides of an emulated tensor in "
                    f"place ({tuple(t.shape)} → {tuple(t.elem.shape)}); wrappers cannot follow that"
                )
        return result


def _to_copy(src: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """``aten._to_copy`` of an emulated tensor: to the host (counted) or a device-side cast."""
    kwargs.pop("pin_memory", None)
    device = kwargs.get("device")
    if device is not None and not _emulated_device(device):
        out = aten._to_copy.default(src.elem, **kwargs)
        _record("d2h", "aten._to_copy", _nbytes(out))
        return out
    kwargs["device"] = _CPU
    return EmulatedCudaTensor(aten._to_copy.default(src.elem, **kwargs))


def _to(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``aten.to`` overloads. They reach dispatch whole only where autograd is off (inference
    mode); elsewhere they decompose into ``_to_copy`` above. ``to`` may return its input, so
    a move to the host must not hand back the wrapped tensor itself."""
    named = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
    src = named["self"]
    other = named.get("other")
    device = other.device if isinstance(other, torch.Tensor) and _plain(other) else named.get("device")
    dtype = named.get("dtype") or (other.dtype if isinstance(other, torch.Tensor) else None)
    memory_format = named.get("memory_format")
    if _plain(src):  # host → device
        if not _emulated_device(device) and not isinstance(other, EmulatedCudaTensor):
            return func(*args, **kwargs)
        _record("h2d", _op_name(func), _nbytes(src))
        return EmulatedCudaTensor(aten._to_copy.default(src, dtype=dtype, memory_format=memory_format))
    if device is not None and not _emulated_device(device):
        out = aten._to_copy.default(src.elem, dtype=dtype, device=_CPU, memory_format=memory_format)
        _record("d2h", _op_name(func), _nbytes(out))
        return out
    out = src.elem.to(
        dtype=dtype, copy=bool(named.get("copy", False)), memory_format=memory_format or torch.preserve_format
    )
    return src if out is src.elem else EmulatedCudaTensor(out)


def _copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy_`` with an emulated side: the cross-device copies CUDA allows, counted."""
    if isinstance(dst, EmulatedCudaTensor):
        if isinstance(src, EmulatedCudaTensor):
            dst.elem.copy_(src.elem)
            return dst
        _check_host(src, "aten.copy_")
        dst.elem.copy_(src)
        _record("h2d", "aten.copy_", _nbytes(src))
        return dst
    _check_host(dst, "aten.copy_")
    dst.copy_(src.elem)
    _record("d2h", "aten.copy_", _nbytes(src.elem))
    return dst


def _check_host(t: torch.Tensor, op: str) -> None:
    if t.device.type != "cpu":
        raise RuntimeError(f"emulated_cuda: {op} between an emulated tensor and a plain {t.device} tensor")


def _index_op(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Indexing: CUDA accepts host index tensors (uploading them) next to a device tensor, and
    device indices next to a host tensor (downloading them); boolean masks cost a sync."""
    self, indices, *rest = args
    name = _op_name(func)
    index_tensors = [i for i in indices if isinstance(i, torch.Tensor)]
    if any(i.dtype in (torch.bool, torch.uint8) for i in index_tensors if not _plain(i)):
        _record("implicit_sync", name)
    if _plain(self):
        _check_plain(
            func,
            [
                t
                for t in _tensors(kwargs.values(), _tensors(rest, []))
                if isinstance(t, EmulatedCudaTensor) and t.dim() > 0
            ],
        )
        moved = [i for i in index_tensors if isinstance(i, EmulatedCudaTensor)]
        if moved:
            _record("d2h", name, sum(_nbytes(i.elem) for i in moved))
        return func(self, _unwrap_args(indices), *_unwrap_args(rest), **_unwrap_kwargs(kwargs))
    _check_plain(func, [t for t in _tensors(kwargs.values(), _tensors(rest, [])) if _plain(t)])
    uploaded = [i for i in index_tensors if _plain(i) and i.dim() > 0]
    for i in uploaded:
        _check_host(i, name)
    if uploaded:
        _record("h2d", name, sum(_nbytes(i) for i in uploaded))
    out = func(self.elem, _unwrap_args(indices), *_unwrap_args(rest), **_unwrap_kwargs(kwargs))
    return self if out is self.elem else EmulatedCudaTensor(out)


def emulated(t: torch.Tensor, *, requires_grad: bool | None = None) -> EmulatedCudaTensor:
    """A copy-free emulated view of the CPU tensor ``t`` (``requires_grad`` defaults to ``t``'s).

    Not counted as a transfer: use ``t.to("cuda")`` inside ``emulated_cuda()`` for that.
    """
    rg = t.requires_grad if requires_grad is None else requires_grad
    return EmulatedCudaTensor(t.detach(), requires_grad=rg)


def is_emulated(t: object) -> bool:
    """Whether ``t`` is an emulated CUDA tensor."""
    return isinstance(t, EmulatedCudaTensor)


# --------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------


class _CudaArgumentsToMeta(TorchFunctionMode):
    """Rewrite CUDA device arguments to the wrappers' C++ device before the Python bindings,
    which would initialise the real CUDA runtime for them, see them."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func not in _SPECIAL_FUNCTIONS:  # the common case, kept short: every torch call comes here
            if kwargs and "device" in kwargs and _is_cuda_device(kwargs["device"]):
                kwargs = {**kwargs, "device": _BACKING}
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            t, *rest = args
            device = rest[0] if rest else kwargs.pop("device", None)
            if device is not None:
                _is_cuda_device(device)  # validates the index
            if len(rest) > 1:
                kwargs["non_blocking"] = rest[1]
            return torch.Tensor.to(t, _BACKING, **kwargs)
        if func is torch.Tensor.to:
            args = tuple(_BACKING if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        elif func is torch.Tensor.pin_memory:
            # Pinned host memory needs the CUDA runtime; an ordinary host copy behaves the same here.
            t = args[0]
            if isinstance(t, EmulatedCudaTensor):
                raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
            return t.clone()
        elif func is torch.Tensor.is_pinned:
            return False
        elif func in _FROM_DATA:
            return _from_data(func, args, kwargs)
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(
            args[0], EmulatedCudaTensor
        ):
            args = (args[0], _host_index(args[1]), *args[2:])
            if len(args) > 2 and isinstance(args[2], (list, np.ndarray)):
                # The value is built on the host and uploaded, as on CUDA.
                value = torch.as_tensor(args[2], dtype=args[0].dtype)
                args = (args[0], args[1], torch.Tensor.to(value, _BACKING))
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _BACKING
        return func(*args, **kwargs)


def _is_index_list(item: object) -> bool:
    if isinstance(item, np.ndarray):
        return item.dtype.kind in "biu"
    if not isinstance(item, list):
        return False
    return all(isinstance(i, (int, bool)) or _is_index_list(i) for i in item)


def _host_index(index: Any) -> Any:
    """Python sequences in an index as host index tensors (CUDA builds them on the host and uploads
    them; PyTorch would build them on the wrappers' C++ device and lose the values)."""
    if isinstance(index, tuple):
        return tuple(_host_index(i) for i in index)
    return torch.as_tensor(index) if _is_index_list(index) else index


# Constructors from Python data. They copy to the target device with the Python dispatch keys
# switched off, so a meta target would silently drop the data: build on the host, then copy.
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}
# What _CudaArgumentsToMeta does more for than rewrite a device= keyword.
_SPECIAL_FUNCTIONS = {
    torch.Tensor.cuda,
    torch.Tensor.to,
    torch.Tensor.pin_memory,
    torch.Tensor.is_pinned,
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    *_FROM_DATA,
}


def _from_data(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if func is torch.as_tensor and len(args) > 2:
        kwargs["device"] = args[2]
        args = args[:2]
    device = kwargs.get("device")
    at = 1 if func is torch.Tensor.new_tensor else 0
    data = args[at]
    if isinstance(data, EmulatedCudaTensor):
        # From a device tensor: stays on the device unless told otherwise (a copy, or the same
        # tensor for as_tensor/asarray).
        to_host = device is not None and not _is_cuda_device(device)
        copies = func in (torch.tensor, torch.Tensor.new_tensor)
        source = data.detach() if copies else data
        out = torch.Tensor.to(source, _CPU if to_host else _BACKING, dtype=kwargs.get("dtype"), copy=copies)
        return out.requires_grad_() if kwargs.get("requires_grad") else out
    flat, _ = tree_flatten(data)
    if any(isinstance(t, EmulatedCudaTensor) for t in flat):
        # Device scalars inside Python data are read one by one (a sync each), as on CUDA.
        data = tree_map(lambda t: t.item() if isinstance(t, EmulatedCudaTensor) else t, data)
        args = (*args[:at], data, *args[at + 1 :])
    if device is None and func is torch.Tensor.new_tensor and isinstance(args[0], EmulatedCudaTensor):
        device = CUDA0  # new_tensor defaults to self's device
    if device is None or not _is_cuda_device(device):
        return func(*args, **kwargs)
    requires_grad = bool(kwargs.pop("requires_grad", False))
    kwargs["device"] = _CPU
    out = torch.Tensor.to(func(*args, **kwargs), _BACKING)  # the host→device copy, counted
    return out.requires_grad_() if requires_grad else out


class _EmulationDispatchMode(TorchDispatchMode):
    """Turn tensors made on the emulated device without an emulated input (factories, host→device
    copies, C++ code making tensors "like" a wrapper) into emulated tensors."""

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if EmulatedCudaTensor in types or any(issubclass(t, EmulatedCudaTensor) for t in types):
            return func(*args, **(kwargs or {}))  # the wrapper's __torch_dispatch__ takes it from here
        kwargs = kwargs or {}
        if func is aten.is_pinned.default:
            return False
        if func is aten._pin_memory.default:
            return args[0].clone()
        if func.overloadpacket is aten.to:
            return _to(func, args, dict(kwargs))
        if _emulated_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            if func is aten._to_copy.default:
                _record("h2d", "aten._to_copy", _nbytes(args[0]))
            return tree_map(_wrap_new, func(*args, **kwargs))
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Generators and torch.cuda stubs
# --------------------------------------------------------------------------------------------

_RealGenerator = torch.Generator
# Captured before any emulation stubs it (this module is imported before any block is entered).
_real_is_available = torch.cuda.is_available


def real_cuda_available() -> bool:
    """Whether this machine has a real CUDA device, emulation or not."""
    return bool(_real_is_available())


def machine_without_gpu() -> bool:
    """No real GPU and no emulation active: what tests of the emulation's own CPU-only
    assumptions need (they skip elsewhere)."""
    return not real_cuda_available() and not _STATS


def cpu_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` for ``device``; CPU for CUDA devices.

    Same signature as ``bayescli.devices.generator``, so a test can monkeypatch that function with
    this one. Draws made on emulated tensors with it equal the CPU run's draws.
    """
    dev = torch.device(device)
    return _RealGenerator(device="cpu" if dev.type == "cuda" else dev).manual_seed(seed)


class _GeneratorMeta(type):
    # isinstance(g, torch.Generator) keeps working while torch.Generator is the factory below.
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _RealGenerator)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _RealGenerator)


class _EmulatedGenerator(metaclass=_GeneratorMeta):
    """Stands in for ``torch.Generator`` inside the context: CUDA devices get a CPU generator."""

    def __new__(cls, device: torch.device | str | int = "cpu") -> torch.Generator:  # type: ignore[misc]
        if _is_cuda_device(device):
            return _RealGenerator(device="cpu")
        return _RealGenerator(device=device)


def _set_device(device: torch.device | str | int) -> None:
    if not isinstance(device, int) or device != 0:
        _is_cuda_device(device)


def _synchronize(device: torch.device | str | int | None = None) -> None:
    _record("synchronize", "torch.cuda.synchronize")


def _seed_cpu(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, i.e. this function.
    torch.default_generator.manual_seed(int(seed))


class _Stream:
    """The one stream of the emulated device (the optimizers ask whether it is capturing a graph)."""

    device = CUDA0

    def is_capturing(self) -> bool:
        return False

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _synchronize()

    def wait_stream(self, stream: object) -> None:
        pass


_STREAM = _Stream()


def _stubs(patch_generator: bool) -> list[tuple[Any, str, Any]]:
    cuda, acc = torch.cuda, torch.accelerator
    stubs: list[tuple[Any, str, Any]] = [
        (cuda, "is_available", lambda: True),
        (cuda, "device_count", lambda: 1),
        (cuda, "current_device", lambda: 0),
        (cuda, "set_device", _set_device),
        (cuda, "synchronize", _synchronize),
        (cuda, "reset_peak_memory_stats", lambda device=None: None),
        (cuda, "max_memory_allocated", lambda device=None: 0),
        (cuda, "memory_allocated", lambda device=None: 0),
        (cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30)),  # (free, total): an H100
        (cuda, "manual_seed", _seed_cpu),
        (cuda, "manual_seed_all", _seed_cpu),
        (cuda, "get_device_name", lambda device=None: "emulated"),
        (cuda, "current_stream", lambda device=None: _STREAM),
        (cuda, "is_current_stream_capturing", lambda: False),
        # torch.accelerator.is_available() follows torch.cuda.is_available(); the rest must agree.
        (acc, "current_stream", lambda device=None: _STREAM),
        (acc, "current_device_index", lambda: 0),
        (acc, "device_count", lambda: 1),
        (acc, "set_device_index", _set_device),
        (acc, "synchronize", _synchronize),
        # Bindings that still see a CUDA device call this first; nothing to initialise.
        (cuda, "_lazy_init", lambda: None),
    ]
    if patch_generator:
        stubs.append((torch, "Generator", _EmulatedGenerator))
    return stubs


@contextlib.contextmanager
def emulated_cuda(*, patch_generator: bool = True) -> Iterator[TransferStats]:
    """Emulate one CUDA device on the CPU for the duration of the block; yields its :class:`TransferStats`.

    ``patch_generator``: replace ``torch.Generator`` so that ``torch.Generator(device="cuda")``
    gives a CPU generator (see the module docstring). Everything is restored on exit. Emulated
    tensors that outlive the block keep their data but should not be used for more maths.
    """
    if torch.cuda.is_available():
        # A real GPU: initialise it now, as the stubbed _lazy_init would leave it half-initialised.
        torch.cuda.init()
    stats = TransferStats()
    saved = []
    _STATS.append(stats)
    try:
        for owner, name, value in _stubs(patch_generator):
            if not hasattr(owner, name):  # an older torch without this API: nothing to stub
                continue
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        with _CudaArgumentsToMeta(), _EmulationDispatchMode():
            yield stats
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
        # By identity: list.remove compares with ==, and a nested block's stats can equal an
        # enclosing block's (both empty after a reset), which would end the wrong block's log.
        del _STATS[max(i for i, s in enumerate(_STATS) if s is stats)]
