"""The post-hoc methods: one registry entry each (timm-style ``create_*`` by name).

Every method obeys one contract:

* a **settings** dataclass — typed fields with defaults, validated in ``__post_init__`` with
  messages that name the settings (never a CLI flag);
* ``fit(source, settings) → Posterior`` with ``source`` a :class:`~bayescli.fitting.fit_source.FitSource`
  (model, fitting data, validation data, device; features computed once);
* the :class:`~bayescli.posterior.base.Posterior` class that reads its files back;
* optionally ``train(model_spec, train, val, settings, device) → (classifier, checkpoint
  metadata, posterior)``, the from-scratch trainer behind ``bayescli train --method``.

Adding a method is one :data:`REGISTRY` entry: its capabilities (kind, likelihoods, trainer,
sharding, ``select``'s default set) are fields of the entry, and every list of methods elsewhere is
derived from this table — ``bayescli.methods()`` / ``bayescli.settings(name)``, ``fit-vi
--method`` (entries of kind ``vi``) and its ``--set`` help, ``train --method``, ``select``'s default
methods, the sharding check under ``torchrun``. Entries hold ``module:attribute`` strings, so
importing the registry imports no method (start-up and ``--help`` stay light).
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from bayescli.errors import BayescliError
from bayescli.numbers import parse_number


class MethodKind(str, Enum):
    """What a method is: a Laplace approximation (``fit-laplace``), a variational posterior
    (``fit-vi``) or a calibration of the MAP head (fitted by ``select`` and the API)."""

    LAPLACE = "laplace"
    VI = "vi"
    CALIBRATION = "calibration"


@dataclass(frozen=True)
class MethodEntry:
    """One post-hoc method.

    ``kind`` says what it is and so which command fits it (:class:`MethodKind`; ``fit-vi`` offers
    every entry of kind ``vi``); ``posterior_method`` is the ``method`` entry its files carry
    (several entries may share one: the Laplace variants all write ``laplace`` files); ``defaults``
    override the settings' field defaults (a variant is an entry with other defaults);
    ``likelihoods`` the classifier likelihoods it fits (``categorical``: softmax; ``bernoulli``: a
    sigmoid per class);
    ``train`` its from-scratch trainer and ``train_likelihoods`` the likelihoods that trainer
    trains; ``shards``: under ``torchrun`` its fits shard the fitting rows across processes, as
    far as its settings' ``check_shardable()`` allows (a method without it runs in one process);
    ``select_default``: ``select`` fits it when no methods are named.
    """

    name: str
    summary: str
    settings: str
    fit: str
    posterior: str
    posterior_method: str
    train: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    likelihoods: tuple[str, ...] = ("categorical",)
    kind: MethodKind = field(kw_only=True)
    train_likelihoods: tuple[str, ...] = field(default=("categorical",), kw_only=True)
    shards: bool = field(default=False, kw_only=True)
    select_default: bool = field(default=False, kw_only=True)


def _entry(name: str, summary: str, module: str, settings: str, posterior: str, **kw: Any) -> MethodEntry:
    return MethodEntry(
        name,
        summary,
        settings=f"{module}:{settings}",
        fit=f"{module}:fit",
        posterior=f"{module}:{posterior}",
        posterior_method=kw.pop("posterior_method", name),
        **kw,
    )


_LAPLACE = "bayescli.fitting.laplace"
_SOFTMAX_AND_MULTILABEL = ("categorical", "bernoulli")
_VI = "bayescli.posterior.vi"
_TRAINING = "bayescli.training"
_LAPLACE_KIND = {"kind": MethodKind.LAPLACE, "likelihoods": _SOFTMAX_AND_MULTILABEL, "shards": True}

REGISTRY: dict[str, MethodEntry] = {
    entry.name: entry
    for entry in (
        _entry(
            "laplace",
            "Laplace approximation (GGN/EF curvature, Kronecker-factored by default) [003, 004]",
            _LAPLACE,
            "LaplaceSettings",
            "LaplacePosterior",
            **_LAPLACE_KIND,
        ),
        _entry(
            "laplace-diag",
            "Laplace, diagonal curvature",
            _LAPLACE,
            "LaplaceSettings",
            "LaplacePosterior",
            **_LAPLACE_KIND,
            posterior_method="laplace",
            defaults={"hessian": "diag"},
            select_default=True,
        ),
        _entry(
            "laplace-kron",
            "Laplace, Kronecker-factored (KFAC) curvature",
            _LAPLACE,
            "LaplaceSettings",
            "LaplacePosterior",
            **_LAPLACE_KIND,
            posterior_method="laplace",
            defaults={"hessian": "kron"},
            select_default=True,
        ),
        _entry(
            "laplace-full",
            "Laplace, full curvature (small heads)",
            _LAPLACE,
            "LaplaceSettings",
            "LaplacePosterior",
            **_LAPLACE_KIND,
            posterior_method="laplace",
            defaults={"hessian": "full"},
        ),
        _entry(
            "temperature",
            "Temperature scaling of the MAP logits (the calibration baseline; zero variance)",
            "bayescli.posterior.temperature",
            "TemperatureSettings",
            "TemperaturePosterior",
            kind=MethodKind.CALIBRATION,
            select_default=True,
        ),
        _entry(
            "mnvi",
            "Moment-propagation natural VI, noise-only or mean-and-noise [002]",
            f"{_VI}.mnvi",
            "MNVIConfig",
            "MNVIPosterior",
            kind=MethodKind.VI,
            train=f"{_TRAINING}.mnvi:train",
            likelihoods=_SOFTMAX_AND_MULTILABEL,
            train_likelihoods=_SOFTMAX_AND_MULTILABEL,
            select_default=True,
        ),
        _entry(
            "fsvi",
            "Function-space VI with a linearised-GP prior [001]",
            f"{_VI}.fsvi",
            "FSVIConfig",
            "FSVIPosterior",
            kind=MethodKind.VI,
            train=f"{_TRAINING}.fsvi:train",
            select_default=True,
        ),
        _entry(
            "dirichlet-fvi",
            "Dirichlet function-space VI (ensemble, mfvi, map or dropout families) [000]",
            f"{_VI}.dirichlet_fvi",
            "DirichletFVIConfig",
            "DirichletFVIPosterior",
            kind=MethodKind.VI,
            train=f"{_TRAINING}.dirichlet_fvi:train",
            select_default=True,
        ),
        _entry(
            "glm-vi",
            "VI on the linearised network (natural-gradient Gaussian, diag or full) [003]",
            f"{_VI}.glm_vi",
            "GLMVIConfig",
            "GLMVIPosterior",
            kind=MethodKind.VI,
            train=f"{_TRAINING}.glm_vi:train",
            likelihoods=_SOFTMAX_AND_MULTILABEL,
            select_default=True,
        ),
        _entry(
            "ggp-vi",
            "Sparse variational GP with the network's GGP kernel [003]",
            f"{_VI}.ggp_vi",
            "GGPVIConfig",
            "GGPVIPosterior",
            kind=MethodKind.VI,
            train=f"{_TRAINING}.ggp_vi:train",
        ),
        _entry(
            "bbb",
            "Bayes by Backprop, mean-field weight-space VI (a baseline of [003])",
            f"{_VI}.bbb",
            "BBBConfig",
            "BBBPosterior",
            kind=MethodKind.VI,
            train=f"{_TRAINING}.bbb:train",
        ),
    )
}


def _attribute(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def methods(kind: MethodKind | str | None = None) -> list[str]:
    """Every registered post-hoc method (of ``kind``, when given), in registry order."""
    if kind is None:
        return list(REGISTRY)
    kind = MethodKind(kind)
    return [name for name, entry in REGISTRY.items() if entry.kind is kind]


def trainable(likelihood: str | None = None) -> list[str]:
    """The methods with a from-scratch trainer (one that trains ``likelihood``, when given)."""
    return [
        name
        for name, entry in REGISTRY.items()
        if entry.train is not None and (likelihood is None or likelihood in entry.train_likelihoods)
    ]


def select_defaults() -> list[str]:
    """The methods ``select`` fits when none are named: by kind (Laplace, VI, then the calibration
    baseline), in registry order within a kind."""
    order = list(MethodKind)
    chosen = [name for name, entry in REGISTRY.items() if entry.select_default]
    return sorted(chosen, key=lambda name: order.index(REGISTRY[name].kind))


def sharding() -> list[str]:
    """The methods whose fits shard the fitting rows under ``torchrun``."""
    return [name for name, entry in REGISTRY.items() if entry.shards]


def method_entry(name: str) -> MethodEntry:
    """The entry of ``name``; an unknown name is an error listing the known ones."""
    key = name.value if isinstance(name, Enum) else str(name)
    if key not in REGISTRY:
        raise BayescliError(f"unknown method '{key}'; the methods are {', '.join(REGISTRY)}")
    return REGISTRY[key]


def settings_class(name: str) -> type:
    """The settings dataclass of method ``name``."""
    return _attribute(method_entry(name).settings)


def fit_function(name: str) -> Any:
    """``fit(source, settings) → Posterior`` of method ``name``."""
    return _attribute(method_entry(name).fit)


def train_function(name: str) -> Any:
    """The from-scratch trainer of method ``name`` (an error if it has none)."""
    entry = method_entry(name)
    if entry.train is None:
        raise BayescliError(
            f"{name} has no from-scratch trainer; methods that train: {', '.join(trainable())}"
        )
    return _attribute(entry.train)


def posterior_class_name(method: str) -> str:
    """``module:Class`` reading posterior files whose ``method`` entry is ``method``."""
    for entry in REGISTRY.values():
        if entry.posterior_method == method:
            return entry.posterior
    known = sorted({e.posterior_method for e in REGISTRY.values()})
    raise BayescliError(f"unknown posterior method '{method}'; this bayescli reads {', '.join(known)}")


def setting_fields(name: str) -> dict[str, dataclasses.Field]:
    """The settings' fields by name (public ones: a leading underscore marks internal state)."""
    return {f.name: f for f in dataclasses.fields(settings_class(name)) if not f.name.startswith("_")}


def setting_rows(name: str) -> list[tuple[str, str, Any]]:
    """``(setting, type, default)`` of each public setting of method ``name`` (its entry's
    variant defaults applied): what ``--set NAME=VALUE`` takes, for help pages."""
    hints = typing.get_type_hints(settings_class(name))
    defaults = create_settings(name)
    return [(f, type_text(hints[f]), getattr(defaults, f)) for f in setting_fields(name)]


def type_text(annotation: Any) -> str:
    """A settings field's type for help: ``float or None``, an enum's values as ``nll|ece|brier``."""
    options = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    names = []
    for kind in options:
        if kind is type(None):
            names.append("None")
        elif isinstance(kind, type) and issubclass(kind, Enum):
            names.append("|".join(str(m.value) for m in kind))
        else:
            names.append(getattr(kind, "__name__", str(kind)))
    return " or ".join(names)


def create_settings(name: str, settings: Any = None, **values: Any) -> Any:
    """Method ``name``'s settings: ``settings`` (an instance, or ``None`` for the defaults, with
    the entry's variant defaults) with ``values`` replacing fields. An unknown field is an error
    naming the method's settings; values are validated by the dataclass."""
    cls = settings_class(name)
    fields = setting_fields(name)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise BayescliError(
            f"{name} has no setting {', '.join(unknown)}; its settings: {', '.join(sorted(fields))}"
        )
    if settings is not None:
        if not isinstance(settings, cls):
            raise BayescliError(f"{name} takes {cls.__name__} settings, got {type(settings).__name__}")
        return dataclasses.replace(settings, **values) if values else settings
    return cls(**{**method_entry(name).defaults, **values})


def parse_setting(name: str, setting: str, text: str) -> Any:
    """``text`` as the type of ``name``'s setting ``setting`` (``--set setting=text``)."""
    fields = setting_fields(name)
    if setting not in fields:
        raise BayescliError(f"{name} has no setting '{setting}'; its settings: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(settings_class(name))
    return _convert(text, hints[setting], setting)


def _convert(text: str, annotation: Any, setting: str) -> Any:
    options = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    if text.lower() in ("none", "null") and type(None) in options:
        return None
    for kind in options:
        if kind is type(None):
            continue
        try:
            if kind is bool:
                if text.lower() in ("true", "1", "yes", "on"):
                    return True
                if text.lower() in ("false", "0", "no", "off"):
                    return False
                raise ValueError(text)
            if isinstance(kind, type) and issubclass(kind, Enum):
                return kind(text)
            if kind is int:
                return int(text)
            if kind is float:
                return parse_number(text, f"setting {setting}")
            if kind is str:
                return text
        except ValueError:
            continue
    raise BayescliError(f"setting {setting} cannot be '{text}' (it takes {_describe(annotation)})")


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _describe(annotation: Any) -> str:
    options = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    names = []
    for kind in options:
        if isinstance(kind, type) and issubclass(kind, Enum):
            names.append(" | ".join(repr(m.value) for m in kind))
        else:
            names.append(getattr(kind, "__name__", str(kind)))
    return " or ".join(names)
