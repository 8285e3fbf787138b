"""Torch pickles read without running their code: whole pickled modules and other objects.

``torch.save(model, path)`` pickles the module *object*: its class by name (``__main__.CNN``,
``torch.nn.modules.conv.Conv2d``) and its ``__dict__``, whose ``_parameters``, ``_buffers`` and
``_modules`` hold the weights. A stock unpickler imports those names and calls them, and a pickle
can name any callable (``os.system``, ``builtins.exec``), so :func:`read_torch_pickle` reads such
files with its own unpickler and torch's two file layouts re-implemented here:

* **zip** (torch ≥ 1.6): ``<dir>/data.pkl`` plus one record ``<dir>/data/<key>`` of raw bytes per
  storage, read with :mod:`zipfile`;
* **legacy** (``_use_new_zipfile_serialization=False``): the pickles of torch's magic number, its
  protocol version and a ``sys_info`` dict, then the object's pickle, then the pickled list of
  storage keys, then per key an int64 element count followed by the storage's raw bytes.

**What runs** while reading: CPython's C unpickler executing the opcodes (it builds str, bytes,
numbers, tuples, lists, dicts, sets and the memo itself); :meth:`RestrictedUnpickler.find_class`,
which looks names up in fixed tables and otherwise makes an :class:`Inert` subclass (no import, no
attribute lookup on any module named in the file); of the names in those tables,
``collections.OrderedDict``, ``set``, ``frozenset``, ``list``, ``dict``, ``tuple`` and ``torch.Size``
are called with the file's arguments, torch's dtypes and storage types are constants, and
``torch._utils._rebuild_tensor``/``_v2``/``_v3``, ``_rebuild_parameter``/``_with_state`` and
``copyreg._reconstructor`` are replaced by this module's own functions, which check their arguments
and view storage bytes as a tensor with ``Tensor.set_`` (``requires_grad``, hooks and Python
attributes of tensors are dropped) or make a bare record; :meth:`RestrictedUnpickler.persistent_load`,
which reads a storage's bytes from the file; and the methods of :class:`Inert`.

**What never runs**: any other name in the file. It becomes a subclass of :class:`Inert`; calling
it (``REDUCE``, ``NEWOBJ``, ``INST``/``OBJ``, a ``__reduce__`` target such as ``os.system``)
returns an :class:`Inert` record of the arguments, ``BUILD`` stores the state on the record, and
``SETITEMS``/``APPENDS`` on a record store the items on it, so no class from the file is
instantiated and no ``__init__``, ``__setstate__``, ``__reduce__`` target or other global is
called; nothing is imported. Tensor subclasses, quantised, sparse, nested and device tensors
become records too. TorchScript archives (their ``code/``) are refused, never loaded.

:func:`module_state_dict` turns a record of an ``nn.Module`` into the state dict the module's
``state_dict()`` would return, by reading ``_parameters``, ``_buffers`` (without the names in
``_non_persistent_buffers_set``) and ``_modules`` recursively; custom ``_save_to_state_dict``
methods and ``get_extra_state`` are code, so what they would add is not there.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar

import torch

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER: first pickle of a legacy file
PROTOCOL_VERSION = 1001  # torch.serialization.PROTOCOL_VERSION: second pickle of a legacy file


class UnpickleError(ValueError):
    """The file is not a torch pickle this module can read; the message is one line."""


class Inert:
    """A record of what a pickle asked for, standing in for a global bayescli does not trust.

    Each global name in the file becomes its own subclass with ``origin = "module.name"``;
    calling that class (or a record) makes a record of the call: ``origin``, ``args``,
    ``kwargs``. Pickle's ``BUILD`` sets ``state`` (an ``nn.Module`` record's state is its
    ``__dict__``: ``_parameters``, ``_buffers``, ``_modules``, …), ``SETITEMS`` fills
    ``dictitems`` and ``APPENDS`` fills ``listitems`` (dict and list subclasses). Nothing else
    happens: the records never call what they name.
    """

    origin: ClassVar[str] = "?"
    calls: ClassVar[set[str]] = set()  # shared with the unpickler that made the subclass

    def __new__(cls, *args: Any, **kwargs: Any) -> Inert:
        record = object.__new__(cls)
        record.args, record.kwargs = args, kwargs
        record.state, record.dictitems, record.listitems = None, {}, []
        cls.calls.add(cls.origin)
        return record

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: ``__new__`` recorded the arguments (pickle calls both on ``REDUCE``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Inert:
        """A record called like a function (a chain such as ``getattr(x, 'y')(…)``): a new record."""
        called = type(self).__new__(type(self), *args, **kwargs)
        called.args = (self, *args)
        return called

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.dictitems[key] = value

    def append(self, value: Any) -> None:
        self.listitems.append(value)

    def extend(self, values: Any) -> None:
        self.listitems.extend(values)

    def __repr__(self) -> str:
        return f"<record of {self.origin}>"


def is_module(obj: object) -> bool:
    """Whether ``obj`` is the record of an ``nn.Module`` (its state has ``_parameters`` and ``_modules``)."""
    state = _dict_state(obj) if isinstance(obj, Inert) else None
    return (
        isinstance(state, dict)
        and isinstance(state.get("_parameters"), dict)
        and isinstance(state.get("_modules"), dict)
    )


def module_state_dict(root: Inert) -> OrderedDict[str, torch.Tensor]:
    """What ``root.state_dict()`` would return: ``{"conv1.weight": tensor, "bn1.running_mean": …}``.

    Parameters and persistent buffers that are ``None`` are skipped, as torch does. Raises
    :class:`UnpickleError` naming the entry when a parameter, buffer or child is not what an
    ``nn.Module`` holds (a record instead of a tensor, a cycle of modules).
    """
    out: OrderedDict[str, torch.Tensor] = OrderedDict()

    def visit(record: Inert, prefix: str, ancestors: frozenset[int]) -> None:
        state = _dict_state(record)
        skip = state.get("_non_persistent_buffers_set", set())
        if not isinstance(skip, set | frozenset):
            raise UnpickleError(f"module '{prefix[:-1]}' has a {_kind(skip)} as _non_persistent_buffers_set")
        tensors = [*state["_parameters"].items()]
        buffers = state.get("_buffers", {})
        if not isinstance(buffers, dict):
            raise UnpickleError(f"module '{prefix[:-1]}' has a {_kind(buffers)} as _buffers")
        tensors += [(n, b) for n, b in buffers.items() if n not in skip]
        for name, value in tensors:
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise UnpickleError(
                    f"'{prefix}{name}' is stored as a {_kind(value)}, not a plain tensor, which bayescli "
                    "does not rebuild"
                )
            out[prefix + str(name)] = value
        for name, child in state["_modules"].items():
            if child is None:
                continue
            if not is_module(child):
                raise UnpickleError(f"submodule '{prefix}{name}' is a {_kind(child)}, not a torch module")
            if id(child) in ancestors:
                raise UnpickleError(f"submodule '{prefix}{name}' contains itself")
            visit(child, f"{prefix}{name}.", ancestors | {id(child)})

    visit(root, "", frozenset({id(root)}))
    return out


@dataclass
class TorchPickle:
    """What :func:`read_torch_pickle` read: the object with records in place of untrusted globals."""

    content: object
    layout: str  # "zip" or "legacy"
    globals: list[str] = field(default_factory=list)  # every untrusted global named, sorted
    calls: list[str] = field(default_factory=list)  # the untrusted globals the pickle calls, sorted


def read_torch_pickle(path: str | Path) -> TorchPickle:
    """Read a torch zip or legacy file at ``path`` without running its code (see the module doc).

    Raises :class:`UnpickleError` for files in neither layout, TorchScript archives, big-endian
    files, storage views of torch < 0.4 and corrupt data.
    """
    p = Path(path)
    with open(p, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    return _read_zip(p) if zipped else _read_legacy(p)


def is_legacy_torch_file(f: IO[bytes]) -> bool:
    """Whether the stream starts with a pickle of torch's magic number (a legacy torch file)."""
    try:
        return _load_plain(f) == MAGIC_NUMBER
    except Exception:  # any malformed start means "not this format"
        return False


# Calls that serve only to run code, commands or network requests. Nothing is ever called, but a
# file that asks for one of these is an attack, not a model, and is refused as such by
# bayescli.models.checkpoints; every other record stays inert data.
# fmt: off
_CODE_MODULES = frozenset((
    "os", "posix", "nt", "subprocess", "sys", "shutil", "importlib", "runpy", "socket", "ctypes", "pty",
    "code", "codeop", "pickle", "_pickle", "marshal", "webbrowser", "multiprocessing", "asyncio", "types",
    "operator", "_operator", "pdb", "bdb", "timeit", "imp", "zipimport", "pip", "setuptools", "distutils",
    "commands", "popen2", "urllib", "http", "requests", "ftplib", "smtplib", "telnetlib",
))
_CODE_BUILTINS = frozenset((
    "eval", "exec", "execfile", "compile", "__import__", "open", "getattr", "setattr", "delattr", "globals",
    "locals", "vars", "input", "breakpoint", "apply", "file", "reload", "exit", "quit",
))
# fmt: on
_CODE_TORCH = (
    "torch.hub.",
    "torch.jit.",
    "torch.package.",
    "torch.serialization.",
    "torch.load",
    "torch.ops.",
)


def runs_code(name: str) -> bool:
    """Whether calling the global ``name`` (``module.attr``) serves only to run code or commands."""
    module, _, attr = name.rpartition(".")
    root = module.split(".")[0]
    if root in ("builtins", "__builtin__"):
        return attr in _CODE_BUILTINS
    return root in _CODE_MODULES or name.startswith(_CODE_TORCH) or name.startswith("numpy.testing.")


# ---------------------------------------------------------------------------------------------
# the unpickler and its allow-list
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StorageType:
    """A storage class named in the file (``torch.FloatStorage``), reduced to its dtype."""

    dtype: torch.dtype


@dataclass
class _Storage:
    """Raw bytes of one storage and the dtype its tensors view them as."""

    data: torch.UntypedStorage
    dtype: torch.dtype


_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
    "UntypedStorage": torch.uint8,
}
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(type(v) is int for v in value):
        raise UnpickleError(f"a tensor's {what} is a {_kind(value)}, not a tuple of ints")
    return tuple(value)


def _rebuild_tensor(
    storage: object, offset: object, size: object, stride: object, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``size``/``stride`` view at element ``offset`` of ``storage`` (checked to lie inside it)."""
    if not isinstance(storage, _Storage):
        raise UnpickleError(f"a tensor's storage is a {_kind(storage)}")
    dtype = storage.dtype if dtype is None else dtype
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if type(offset) is not int or offset < 0 or len(size) != len(stride) or min((*size, *stride, 0)) < 0:
        raise UnpickleError("a tensor's offset, size or stride is invalid")
    numel = storage.data.nbytes() // _element_size(dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if 0 not in size and last >= numel:
        raise UnpickleError(f"a tensor reaches element {last} of a storage of {numel}: the file is corrupt")
    return torch.empty((0,), dtype=dtype).set_(storage.data, offset, size, stride)


def _rebuild_tensor_v2(
    storage: object,
    offset: object,
    size: object,
    stride: object,
    requires_grad: object,
    backward_hooks: object,
    metadata: object = None,
) -> torch.Tensor:
    if metadata:  # conjugate/negative bits would change the values read
        raise UnpickleError(
            "a tensor carries metadata (conjugate/negative bits) that bayescli does not apply"
        )
    return _rebuild_tensor(storage, offset, size, stride)


def _rebuild_tensor_v3(
    storage: object,
    offset: object,
    size: object,
    stride: object,
    requires_grad: object,
    backward_hooks: object,
    dtype: object,
    metadata: object = None,
) -> torch.Tensor:
    if not isinstance(dtype, torch.dtype):
        raise UnpickleError(f"a tensor's dtype is a {_kind(dtype)}")
    if metadata:
        raise UnpickleError(
            "a tensor carries metadata (conjugate/negative bits) that bayescli does not apply"
        )
    return _rebuild_tensor(storage, offset, size, stride, dtype)


def _rebuild_parameter(data: object, *_: object) -> object:
    """A parameter's tensor; ``requires_grad``, hooks and Python attributes are not restored."""
    return data


def _size(dims: object = ()) -> torch.Size:
    return torch.Size(_ints(dims, "size"))


def _reconstructor(cls: object, base: object, state: object) -> object:
    """``copyreg._reconstructor`` of protocol 0/1 pickles: a bare record of ``cls``, never ``cls()``."""
    if isinstance(cls, type) and issubclass(cls, Inert):
        return cls.__new__(cls)
    raise UnpickleError(f"copyreg._reconstructor of a {_kind(cls)}")


_ALLOWED: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): OrderedDict,
    **{
        ("builtins", n): {"set": set, "frozenset": frozenset, "list": list, "dict": dict, "tuple": tuple}[n]
        for n in ("set", "frozenset", "list", "dict", "tuple")
    },
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch", "Size"): _size,
    ("copyreg", "_reconstructor"): _reconstructor,
}
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}  # names of protocol-2 pickles


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose globals are the allow-list above or :class:`Inert` records.

    ``storage(key, dtype, numel)`` supplies the bytes of persistent storage ids; ``globals`` and
    ``calls`` collect the untrusted names the file mentions and calls.
    """

    def __init__(self, file: IO[bytes], storage: Callable[[str, torch.dtype, int], _Storage] | None) -> None:
        super().__init__(file, encoding="utf-8")
        self._storage = storage
        self._classes: dict[str, type[Inert]] = {}
        self.globals: set[str] = set()
        self.calls: set[str] = set()

    def find_class(self, module: str, name: str) -> object:
        module = _PY2_MODULES.get(module, module)
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module.split(".")[0] == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        origin = f"{module}.{name}"
        if origin not in self._classes:
            # a fresh class per name, so NEWOBJ (which needs a type) works on it; its name is data only
            self._classes[origin] = type("InertGlobal", (Inert,), {"origin": origin, "calls": self.calls})
            self.globals.add(origin)
        return self._classes[origin]

    def persistent_load(self, pid: object) -> object:
        if not isinstance(pid, tuple) or not pid:
            raise UnpickleError(f"unknown persistent id {pid!r:.80}")
        kind = pid[0].decode("ascii") if isinstance(pid[0], bytes) else pid[0]
        if kind == "module" and len(pid) == 4:  # legacy files name each module class with its source
            return pid[1]
        if kind != "storage" or self._storage is None or len(pid) not in (5, 6):
            raise UnpickleError(f"unknown persistent id {kind!r:.40}")
        storage_type, key, _location, numel = pid[1:5]
        if len(pid) == 6 and pid[5] is not None:
            raise UnpickleError("the file holds storage views (torch < 0.4); re-save it with a newer torch")
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str) or type(numel) is not int:
            raise UnpickleError(f"malformed storage id {pid!r:.80}")
        return self._storage(key, storage_type.dtype, numel)


def _load_plain(f: IO[bytes]) -> object:
    """One pickle without storages (the legacy header and key list)."""
    return RestrictedUnpickler(f, None).load()


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _read_zip(path: Path) -> TorchPickle:
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        pickles = [n for n in names if n.count("/") == 1 and n.endswith("/data.pkl")]
        if any(n.endswith("/constants.pkl") for n in names) or any("/code/" in n for n in names):
            raise UnpickleError("it is a TorchScript archive, which is code; export its state_dict() instead")
        if len(pickles) != 1:
            raise UnpickleError("the zip archive holds no torch data.pkl")
        root = pickles[0][: -len("data.pkl")]
        if f"{root}byteorder" in names and archive.read(f"{root}byteorder").strip() != b"little":
            raise UnpickleError("it was saved on a big-endian machine, which bayescli does not read")
        loaded: dict[str, _Storage] = {}

        def storage(key: str, dtype: torch.dtype, numel: int) -> _Storage:
            if key not in loaded:
                record = f"{root}data/{key}"
                nbytes = numel * _element_size(dtype)
                if record not in names or archive.getinfo(record).file_size != nbytes:
                    raise UnpickleError(f"storage '{key}' is missing or not {nbytes} bytes long")
                loaded[key] = _Storage(_bytes_storage(archive.read(record)), dtype)
            return loaded[key]

        unpickler = RestrictedUnpickler(io.BytesIO(archive.read(pickles[0])), storage)
        content = unpickler.load()
    return TorchPickle(content, "zip", sorted(unpickler.globals), sorted(unpickler.calls))


def _read_legacy(path: Path) -> TorchPickle:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if _load_plain(f) != MAGIC_NUMBER:
            raise UnpickleError("it is neither a torch zip archive nor a legacy torch file")
        if _load_plain(f) != PROTOCOL_VERSION:
            raise UnpickleError("it is a legacy torch file of an unknown protocol version")
        sys_info = _load_plain(f)
        if not isinstance(sys_info, dict) or sys_info.get("little_endian") is not True:
            raise UnpickleError("it was saved on a big-endian machine, which bayescli does not read")
        pending: dict[str, _Storage] = {}

        def storage(key: str, dtype: torch.dtype, numel: int) -> _Storage:
            # the bytes follow the pickle: allocate now, fill below
            if key not in pending:
                nbytes = numel * _element_size(dtype)
                if not 0 <= nbytes <= size:
                    raise UnpickleError(f"storage '{key}' claims {nbytes} bytes in a file of {size}")
                pending[key] = _Storage(torch.UntypedStorage(nbytes), dtype)
            return pending[key]

        unpickler = RestrictedUnpickler(f, storage)
        content = unpickler.load()
        keys = _load_plain(f)
        if not isinstance(keys, list) or set(keys) != set(pending):
            raise UnpickleError("its storage key list does not match the storages its pickle uses")
        for key in keys:
            target = pending[key]
            numel = int.from_bytes(f.read(8), "little")
            data = f.read(numel * _element_size(target.dtype))
            if len(data) != target.data.nbytes():
                raise UnpickleError(f"storage '{key}' is truncated: the file is corrupt")
            target.data.copy_(_bytes_storage(data))
    return TorchPickle(content, "legacy", sorted(unpickler.globals), sorted(unpickler.calls))


def _bytes_storage(data: bytes) -> torch.UntypedStorage:
    if not data:
        return torch.UntypedStorage(0)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).untyped_storage()


def _dict_state(record: Inert) -> dict | None:
    """A record's ``BUILD`` state as a dict (the first half of a ``(dict, slots)`` state)."""
    state = record.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
        state = state[0]
    return state if isinstance(state, dict) else None


def _kind(value: object) -> str:
    """A short description of a value read from a file, for messages."""
    if isinstance(value, Inert):
        return f"record of {value.origin}"
    return type(value).__name__
