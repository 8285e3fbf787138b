"""Arguments for model factories, and which of them a file may supply.

A factory (``builtin:``, ``py:``, ``timm:``, ``torchvision:``) is called with keyword arguments
from three places, later ones overriding earlier ones:

1. a checkpoint's or posterior's recorded arguments (``model_kwargs`` of ``bayescli train``,
   ``model_args`` recorded by every fit),
2. a Lightning checkpoint's ``hyper_parameters``, passed as
   ``LightningModule.load_from_checkpoint`` passes them: every name the factory's signature
   declares, or all of them when it takes ``**kwargs`` (names starting with ``_`` are Lightning's
   own bookkeeping and never passed),
3. ``--model-arg NAME=VALUE`` on the command line, typed by the factory's signature (its
   annotation, else its default's type) or parsed as JSON.

Files are untrusted input: what comes from one (1 and 2) must be a plain JSON value — it can
select within a library's own registries (timm's ``act_layer="gelu"``) but never name code — and,
for factories with a fixed signature, a name that signature declares. A ``py:`` spec read from a
file is not imported unless the user names it (:func:`check_file_spec`).
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from bayescli.errors import BayescliError


def is_plain_json(value: object) -> bool:
    """Whether ``value`` is made of None, bools, numbers, strings, lists and string-keyed dicts."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(is_plain_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain_json(v) for k, v in value.items())
    return False


@dataclass(frozen=True)
class Signature:
    """What a factory declares: its keyword parameters, their types, and whether it takes ``**kwargs``."""

    names: tuple[str, ...]
    types: dict[str, object] = field(default_factory=dict)
    var_keyword: bool = False

    @classmethod
    def of(cls, factory: Callable) -> Signature:
        try:
            sig = inspect.signature(factory)
        except (TypeError, ValueError):  # builtins without a signature: accept JSON values
            return cls((), {}, True)
        try:
            hints = typing.get_type_hints(factory)
        except Exception:  # unresolvable string annotations: fall back to the defaults' types
            hints = {}
        names, types, var_kw = [], {}, False
        for name, p in sig.parameters.items():
            if p.kind is p.VAR_KEYWORD:
                var_kw = True
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                names.append(name)
                if name in hints:
                    types[name] = hints[name]
                elif p.default is not p.empty and p.default is not None:
                    types[name] = type(p.default)
        return cls(tuple(names), types, var_kw)

    def declares(self, name: str) -> bool:
        return name in self.names


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(name: str, text: str, kind: object) -> object:
    """``text`` as the type the factory declares for ``name`` (JSON for anything else)."""
    origin = typing.get_origin(kind)
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        if text.lower() in ("none", "null"):
            return None
        kind = args[0]
    try:
        if kind is bool:
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is str:
            return text
    except ValueError:
        raise BayescliError(
            f"--model-arg {name}={text}: the factory takes {getattr(kind, '__name__', kind)} for '{name}'"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # an untyped parameter: a bare word is a string


def parse_model_args(items: Iterable[str], factory: Callable | None) -> dict[str, object]:
    """``["hidden=64", "act=tanh"]`` → ``{"hidden": 64, "act": "tanh"}``, typed by ``factory``'s signature.

    Names the signature does not declare are refused when it takes no ``**kwargs``.
    """
    sig = Signature.of(factory) if factory is not None else Signature((), {}, True)
    out: dict[str, object] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise BayescliError(f"--model-arg takes NAME=VALUE (e.g. hidden=64), got '{item}'")
        if not sig.var_keyword and not sig.declares(name):
            raise BayescliError(
                f"--model-arg {name}: the factory takes no argument '{name}'; it takes "
                f"{', '.join(sig.names) or 'no arguments'}"
            )
        out[name] = _convert(name, text, sig.types.get(name))
    return out


@dataclass
class FactoryArguments:
    """The keyword arguments a factory is called with, and where each came from."""

    kwargs: dict[str, object] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)  # name → why it was not passed

    def describe(self) -> dict:
        """JSON-ready record for posterior files (``model_args`` is what a later load passes back)."""
        out: dict = {"model_args": dict(self.kwargs)}
        if self.sources:
            out["model_args_sources"] = dict(self.sources)
        if self.ignored:
            out["model_args_ignored"] = dict(self.ignored)
        return out


def factory_arguments(
    factory: Callable | None,
    *,
    from_file: dict | None = None,
    hyper_parameters: dict | None = None,
    user: dict | None = None,
    strict_file_names: bool = True,
    reserved: tuple[str, ...] = (),
) -> FactoryArguments:
    """Merge the three sources (module docstring), applying the rules for what files may supply.

    ``strict_file_names``: arguments from files must be names the signature declares (builtin and
    ``py:`` factories); timm's and torchvision's entry points take ``**kwargs`` for their model
    classes, so there plain JSON values suffice. ``reserved`` names (the class count and input
    shape bayescli passes itself) are never taken from a file.
    """
    sig = Signature.of(factory) if factory is not None else Signature((), {}, True)
    args = FactoryArguments()

    def take(name: str, value: object, source: str, *, lightning: bool) -> None:
        if name in reserved:
            return
        if not is_plain_json(value):
            args.ignored[name] = f"{source}: not a plain JSON value ({type(value).__name__})"
            return
        declared = sig.declares(name) or (sig.var_keyword and (lightning or not strict_file_names))
        if not declared:
            args.ignored[name] = f"{source}: the factory takes no argument '{name}'"
            return
        args.kwargs[name] = value
        args.sources[name] = source

    for name, value in (from_file or {}).items():
        take(str(name), value, "file", lightning=False)
    for name, value in (hyper_parameters or {}).items():
        if not str(name).startswith("_"):
            take(str(name), value, "hyper_parameters", lightning=True)
    for name, value in (user or {}).items():
        args.kwargs[name] = value
        args.sources[name] = "--model-arg"
        args.ignored.pop(name, None)
    # An argument the factory cannot take is only worth reporting when some were passed or named.
    if hyper_parameters and not any(s == "hyper_parameters" for s in args.sources.values()):
        args.ignored.setdefault("(hyper_parameters)", "the factory declares none of them")
    return args


def check_file_spec(file_spec: str, named: str | None, trust_model_code: bool, path: object) -> str:
    """The model spec to build for a posterior file whose header says ``file_spec``.

    A ``py:`` spec imports and runs the module it names, so one read from a file is used only when
    the user names the same spec (``named``, from ``--model``) or passes ``--trust-model-code``;
    builtin, timm, torchvision and hf specs name code of installed libraries and are used as read.
    """
    if named is not None and named != file_spec:
        raise BayescliError(
            f"{path} was fitted on the model {file_spec}, not {named}; pass --model {file_spec} "
            "or the posterior of that model"
        )
    if file_spec.startswith("py:") and named is None and not trust_model_code:
        raise BayescliError(
            f"{path} names the model code {file_spec}, which bayescli will not import because a file "
            f"says so; if you trust it, pass --model {file_spec} (or --trust-model-code)"
        )
    return file_spec
