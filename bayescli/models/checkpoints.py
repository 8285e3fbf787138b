"""Real-world checkpoint files: read by their content, and matched to an architecture by its names.

:func:`read_checkpoint` sniffs the first bytes, never the extension:

* **safetensors**: an 8-byte little-endian header length, then the JSON header (``{``);
* **torch zip** (``torch.save`` since torch 1.6): ``PK\\x03\\x04`` and a ``<dir>/data.pkl`` record;
* **legacy torch** (``_use_new_zipfile_serialization=False``): a pickle of torch's magic number.

Torch files are read with ``torch.load(weights_only=True)`` (tensors and plain containers only).
When that refuses because the file pickles classes (a whole ``torch.save(model, path)``, or an
``argparse.Namespace`` beside the weights), :mod:`bayescli.models.unpickle` reads it without running any of
its code and every pickled ``nn.Module`` is replaced by its state dict. Files whose pickle calls
something that only runs code (``os.system``, ``builtins.exec``, …) are refused. Lightning
checkpoints (``state_dict`` and ``pytorch-lightning_version`` keys) are recognised.

:func:`load_weights` finds the weights for a network: among every dict of tensors in the
checkpoint (``state_dict``, ``model``, EMA copies, …) and every prefix mapping (strip a dotted
prefix from the keys, as ``module.``/``_orig_mod.``/Lightning's ``model.`` wrappers add, and/or add
one the architecture has), it takes the one that gives the most of the architecture's names with
equal shapes, lets torch's own ``load_state_dict`` decide which missing buffers are acceptable
(BatchNorm's ``num_batches_tracked`` in state dicts of old torch versions), and explains a misfit
by its most likely cause.
"""

from __future__ import annotations

import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from bayescli.errors import BayescliError
from bayescli.io import load_tensors
from bayescli.models.unpickle import (
    Inert,
    UnpickleError,
    is_legacy_torch_file,
    is_module,
    module_state_dict,
    read_torch_pickle,
    runs_code,
)

_MAX_DEPTH = 6  # how deep wrappers are searched for dicts of tensors and pickled modules
# safetensors caps its JSON header at 100 MB; a larger length field is not a safetensors file
MAX_SAFETENSORS_HEADER = 100_000_000
_ACCEPTED = "safetensors (preferred), or a torch.save file (zip or legacy) of a state dict or a whole module"


@dataclass
class Checkpoint:
    """What a checkpoint file holds and how it was read.

    ``content`` is the object read (whole pickled modules already replaced by their state dicts),
    ``metadata`` bayescli's own safetensors metadata (``{}`` for other files), ``format`` one of
    ``safetensors``, ``torch-zip``, ``torch-legacy`` (read weights-only), ``module-pickle-zip``,
    ``module-pickle-legacy`` (pickled modules read by :mod:`bayescli.models.unpickle`), or
    ``object-pickle-zip``/``object-pickle-legacy`` (pickled objects but no module, likewise).
    """

    path: Path
    content: object
    format: str
    metadata: dict = field(default_factory=dict)
    lightning_version: str | None = None  # set for Lightning checkpoints
    hyper_parameters: dict | None = None  # Lightning's ``hyper_parameters``; objects in it are Inert records
    modules: dict[str, str] = field(default_factory=dict)  # content path → class of each pickled module
    notes: list[str] = field(default_factory=list)  # what was read, for summaries

    def describe(self) -> dict:
        """``checkpoint_format``, ``checkpoint_notes`` and ``lightning_version`` (None unless Lightning)."""
        return {
            "checkpoint_format": self.format,
            "checkpoint_notes": list(self.notes),
            "lightning_version": self.lightning_version,
        }


def sniff_format(path: Path) -> str | None:
    """``safetensors``, ``zip``, ``torchscript``, ``legacy``, ``truncated-safetensors``,
    ``truncated-zip`` (a file that starts as one of those formats but is cut short or damaged) or
    None, from the file's bytes."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
        if len(head) == 9 and head[8:9] == b"{":
            header = int.from_bytes(head[:8], "little")
            if 2 <= header <= size - 8:
                return "safetensors"
            if header <= MAX_SAFETENSORS_HEADER:  # a JSON header longer than the file: cut short
                return "truncated-safetensors"
        if head.startswith(b"PK\x03\x04"):
            try:
                with zipfile.ZipFile(path) as archive:
                    names = archive.namelist()
            except zipfile.BadZipFile:  # the central directory sits at the end: lost when cut
                return "truncated-zip"
            if any(n.endswith("/constants.pkl") for n in names):
                return "torchscript"
            return "zip" if any(n.count("/") == 1 and n.endswith("/data.pkl") for n in names) else None
        f.seek(0)
        return "legacy" if head[:1] == b"\x80" and is_legacy_torch_file(f) else None


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint file by its content (see the module doc); never runs code from it.

    Raises :class:`BayescliError` for missing files, other formats (naming the ones accepted),
    TorchScript archives, corrupt files, pickles that call code-running functions and pickles
    that hold neither a torch module nor a dict of tensors.
    """
    p = Path(path)
    if not p.is_file():
        raise BayescliError(f"checkpoint not found: {p}")
    kind = sniff_format(p)
    if kind == "safetensors":
        tensors, meta = load_tensors(p)
        return Checkpoint(
            p, tensors, "safetensors", meta, notes=[f"safetensors file of {len(tensors)} tensors"]
        )
    if kind == "torchscript":
        raise BayescliError(
            f"{p} is a TorchScript archive, which is code that bayescli does not run; where you trust it, "
            "save its weights with torch.save(torch.jit.load(path).state_dict(), ...)"
        )
    if kind is not None and kind.startswith("truncated-"):
        what, lost = (
            ("a safetensors file", "its header runs past the end")
            if kind == "truncated-safetensors"
            else ("a torch.save (zip) archive", "its central directory is missing")
        )
        raise BayescliError(
            f"{p} starts as {what} but is truncated or corrupt ({p.stat().st_size} bytes; {lost}); "
            "download or save it again"
        )
    if kind is None:
        raise BayescliError(f"unsupported checkpoint format: {p} is not {_ACCEPTED}")
    try:
        with open(p, "rb") as f:  # a file object: torch.load picks safetensors by a path's suffix
            content = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # weights-only refuses pickled classes: read them as inert records
        return _lightning(_read_restricted(p, kind))
    except Exception as exc:  # torch raises many types for corrupt files
        raise BayescliError(
            f"cannot load {p} as a weights-only checkpoint ({_first_line(exc)}); it may be truncated or "
            "corrupt: save it with torch.save(model.state_dict(), ...) or convert it to .safetensors"
        ) from None
    return _lightning(Checkpoint(p, content, f"torch-{kind}", notes=[f"torch {kind} file read weights-only"]))


def _read_restricted(path: Path, layout: str) -> Checkpoint:
    """A torch file that pickles classes, read by :mod:`bayescli.models.unpickle` (nothing from it runs)."""
    try:
        read = read_torch_pickle(path)
    except Exception as exc:  # malformed pickles raise anything from UnpicklingError to TypeError
        raise BayescliError(
            f"cannot read {path} ({_first_line(exc)}); save the weights with "
            "torch.save(model.state_dict(), ...) or as .safetensors"
        ) from None
    attacks = [name for name in read.calls if runs_code(name)]
    if attacks:
        raise BayescliError(
            f"{path} is a pickle that would call {', '.join(attacks)} when loaded with torch.load: "
            "bayescli ran nothing and refuses it; get the weights as .safetensors or a state dict "
            "from a source you trust"
        )
    modules: dict[str, str] = {}
    try:
        content = _plain(read.content, "", 0, modules, {})
    except UnpickleError as exc:
        raise BayescliError(f"cannot read the module tree pickled in {path}: {exc}") from None
    if not modules and not tensor_dicts(content):
        what = f"pickles {', '.join(read.globals[:3])} (read as inert records, nothing run)"
        raise BayescliError(
            f"{path} is not a weights-only checkpoint and holds no torch module tree; it "
            f"{what if read.globals else 'holds no tensors'}: save it with "
            "torch.save(model.state_dict(), ...) or convert it to .safetensors"
        )
    notes = [f"torch {layout} file that pickles classes, read without running its code"]
    notes += [
        f"whole pickled module {cls}" + (f" at '{where}'" if where else "") for where, cls in modules.items()
    ]
    kind = "module" if modules else "object"
    return Checkpoint(path, content, f"{kind}-pickle-{layout}", modules=modules, notes=notes)


def _plain(obj: object, path: str, depth: int, modules: dict[str, str], memo: dict[int, object]) -> object:
    """``obj`` with each pickled module replaced by its state dict and other records by their data.

    A record of a dict subclass becomes a dict of its items, a record with a dict state (an
    ``argparse.Namespace``, an EMA wrapper) a dict of that state; other records stay as they are.
    Containers that change are copied (keeping a state dict's ``_metadata``); ``memo`` keeps shared
    and cyclic references finite.
    """
    if id(obj) in memo:
        return memo[id(obj)]
    if depth > _MAX_DEPTH:
        return obj
    memo[id(obj)] = obj
    out: object = obj
    if isinstance(obj, Inert) and is_module(obj):
        out = module_state_dict(obj)
        modules[path] = obj.origin
    elif isinstance(obj, Inert) and (obj.dictitems or isinstance(obj.state, dict)):
        items = obj.dictitems or obj.state
        out = {k: _plain(v, _join(path, k), depth + 1, modules, memo) for k, v in items.items()}
    elif isinstance(obj, dict):
        items = {k: _plain(v, _join(path, k), depth + 1, modules, memo) for k, v in obj.items()}
        if any(items[k] is not v for k, v in obj.items()):
            out = _with_metadata(OrderedDict(items), obj)
    elif isinstance(obj, list | tuple):
        items = [_plain(v, _join(path, i), depth + 1, modules, memo) for i, v in enumerate(obj)]
        if any(a is not b for a, b in zip(items, obj, strict=True)):
            out = type(obj)(items) if type(obj) in (list, tuple) else items
    memo[id(obj)] = out
    return out


def _lightning(ckpt: Checkpoint) -> Checkpoint:
    """Record Lightning's version and hyper-parameters when the checkpoint is Lightning's."""
    content = ckpt.content
    if isinstance(content, dict) and "state_dict" in content and "pytorch-lightning_version" in content:
        ckpt.lightning_version = str(content["pytorch-lightning_version"])
        hp = content.get("hyper_parameters")
        ckpt.hyper_parameters = dict(hp) if isinstance(hp, dict) else None
        ckpt.notes.append(f"Lightning checkpoint (version {ckpt.lightning_version})")
    return ckpt


def tensor_dicts(obj: object) -> dict[str, OrderedDict[str, torch.Tensor]]:
    """Every dict of tensors inside ``obj``, keyed by its dotted path (``""`` for ``obj`` itself).

    Lists and tuples are entered with their index as the path component; non-tensor leaves are
    skipped, so ``{"state_dict": {...}, "epoch": 3}`` yields ``{"state_dict": {...}}``. A state
    dict's ``_metadata`` (module versions) is kept.
    """
    found: dict[str, OrderedDict[str, torch.Tensor]] = {}

    def walk(node: object, path: str, depth: int) -> None:
        if isinstance(node, dict):
            if node and all(isinstance(v, torch.Tensor) for v in node.values()):
                found[path] = _with_metadata(OrderedDict((str(k), v) for k, v in node.items()), node)
                return
            children = node.items()
        elif isinstance(node, list | tuple):
            children = enumerate(node)
        else:
            return
        if depth < _MAX_DEPTH:
            for k, v in children:
                walk(v, _join(path, k), depth + 1)

    walk(obj, "", 0)
    return found


@dataclass
class ResolvedState:
    """The weights chosen for an architecture, under its names, and how they were found.

    Key ``k`` of the chosen dict became ``added + k[len(stripped):]``; keys outside ``stripped``
    are in ``ignored`` (not loaded).
    """

    state: OrderedDict[str, torch.Tensor]
    key: str  # dotted path of the chosen dict ("" = the checkpoint itself), or the --checkpoint-key given
    stripped: str = ""
    added: str = ""
    ignored: list[str] = field(default_factory=list)
    candidates: list[str] = field(default_factory=list)
    checkpoint: Checkpoint | None = None

    def describe(self) -> dict:
        """Provenance for outputs: ``checkpoint_key``, ``stripped_prefixes``, ``added_prefixes``,
        ``ignored_keys`` (a count) and the checkpoint's :meth:`Checkpoint.describe` keys."""
        return {
            "checkpoint_key": self.key or None,
            "stripped_prefixes": [self.stripped] if self.stripped else [],
            "added_prefixes": [self.added] if self.added else [],
            "ignored_keys": len(self.ignored),
            **(self.checkpoint.describe() if self.checkpoint else {}),
        }


def resolve_weights(
    net: nn.Module, checkpoint: Checkpoint | str | Path, key: str | None = None
) -> ResolvedState:
    """Choose the dict of tensors and the prefix mapping that fit ``net`` best; loads nothing.

    ``key`` (dotted, e.g. ``state_dict`` or ``ema.module``) selects a dict explicitly; a dict's path
    followed by a key prefix (``state_dict.model_ema``) selects only the keys under that prefix.
    Ranking: most names of ``net.state_dict()`` reached with equal shapes, then most names reached,
    fewest keys left outside the stripped prefix, the dict found first, the shortest prefixes.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else read_checkpoint(checkpoint)
    expected = {k: v.shape for k, v in net.state_dict().items()}
    candidates = tensor_dicts(ckpt.content)
    if not candidates:
        raise BayescliError(f"checkpoint {ckpt.path} holds no dict of tensors; save model.state_dict()")
    chosen = candidates if key is None else {key: _select(candidates, key)}
    adds = _prefixes([list(expected)])
    best: tuple | None = None
    for index, (path, state) in enumerate(chosen.items()):
        groups: dict[str, list[str]] = {}
        for k in state:
            groups.setdefault(k.split(".")[0], []).append(k)
        for strip in _prefixes(list(groups.values())):
            inside = [k for k in state if k.startswith(strip)]
            for add in adds:
                names = [add + k[len(strip) :] for k in inside]
                shaped = sum(
                    1 for n, k in zip(names, inside, strict=True) if expected.get(n) == state[k].shape
                )
                named = sum(1 for n in names if n in expected)
                rank = (-shaped, -named, len(state) - len(inside), index, len(strip) + len(add))
                if best is None or rank < best[0]:
                    best = (rank, path, strip, add)
    _, path, strip, add = best
    state = chosen[path]
    mapped = OrderedDict((add + k[len(strip) :], v) for k, v in state.items() if k.startswith(strip))
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        renamed = {_rename_module(m, strip, add): v for m, v in metadata.items()}
        mapped._metadata = OrderedDict((m, v) for m, v in renamed.items() if m is not None)
    ignored = [k for k in state if not k.startswith(strip)]
    return ResolvedState(mapped, path, strip, add, ignored, list(candidates), ckpt)


def load_weights(
    net: nn.Module,
    checkpoint: Checkpoint | str | Path,
    key: str | None = None,
    *,
    model: str | None = None,
    resolved: ResolvedState | None = None,
) -> ResolvedState:
    """Resolve (:func:`resolve_weights`, unless ``resolved`` was already found for ``net``) and
    load the checkpoint's weights into ``net``.

    Tensors whose shapes differ are held back and the rest go through
    ``net.load_state_dict(strict=False)``, so each module's own ``_load_from_state_dict`` decides
    what may be missing. Any missing, unexpected or mis-shaped key raises :class:`BayescliError`
    with one line naming the first of each and the likely cause (prefix, class count, model variant,
    architecture); ``model`` names the architecture there. ``net`` is then partly overwritten.
    """
    resolved = resolved or resolve_weights(net, checkpoint, key)
    expected = {k: v.shape for k, v in net.state_dict().items()}
    wrong = [k for k, v in resolved.state.items() if k in expected and v.shape != expected[k]]
    fitting = _with_metadata(
        OrderedDict((k, v) for k, v in resolved.state.items() if k not in wrong), resolved.state
    )
    where = f"checkpoint {resolved.checkpoint.path} does not match {model or type(net).__name__}"
    try:
        result = net.load_state_dict(fitting, strict=False)
    except RuntimeError as exc:  # a module's own loading hook refused the weights
        raise BayescliError(f"{where}: torch refused the weights ({_first_line(exc)})") from None
    missing = [k for k in result.missing_keys if k not in wrong]  # held back above, not missing
    if wrong or missing or result.unexpected_keys:
        raise BayescliError(
            f"{where}: {_diagnose(resolved, expected, wrong, missing, result.unexpected_keys)}"
        )
    return resolved


def _diagnose(
    resolved: ResolvedState,
    expected: dict[str, torch.Size],
    wrong: list[str],
    missing: list[str],
    unexpected: list[str],
) -> str:
    """The first missing, unexpected and mis-shaped keys, then the most likely cause and fix."""
    state = resolved.state
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (first '{missing[0]}')")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (first '{unexpected[0]}')")
    if wrong:
        k = wrong[0]
        parts.append(
            f"{len(wrong)} with other shapes (first '{k}': checkpoint {tuple(state[k].shape)}, "
            f"model {tuple(expected[k])})"
        )
    detail = "; ".join(parts)
    prefix = _displacing_prefix([*unexpected, *resolved.ignored], set(missing))
    if resolved.stripped and {resolved.added + k for k in resolved.ignored} & set(missing):
        prefix = resolved.stripped  # the keys outside it fit as they are, those under it once stripped
    if prefix:
        return (
            f"{detail} — keys under '{prefix}' fit the model only without that prefix, but no one prefix "
            "mapping fits every key: pick the weights with --checkpoint-key DICT[.PREFIX] or re-save "
            "them with one naming"
        )
    heads = {k.rpartition(".")[0] for k in wrong}
    if wrong and not (missing or unexpected):
        rows = {(state[k].shape[0], expected[k][0]) for k in wrong}
        if len(heads) == 1 and len(rows) == 1 and all(state[k].shape[1:] == expected[k][1:] for k in wrong):
            ours, theirs = rows.pop()
            return (
                f"{detail} — the checkpoint's head '{heads.pop()}' has {ours} classes and the model's "
                f"{theirs}: build the model with the checkpoint's class count ({ours})"
            )
        return (
            f"{detail} — same layer names, other sizes: check the model variant (--model) and its arguments"
        )
    if sum(1 for k in expected if k in state) < len(expected) / 2:
        return (
            f"{detail} — most of the model's layers are not in it: "
            "it belongs to another architecture: check --model"
        )
    return (
        f"{detail} — some layers differ: it is another version or variant of the architecture: check --model"
    )


def _displacing_prefix(keys: list[str], missing: set[str]) -> str | None:
    """The dotted prefix that, removed, turns most of ``keys`` into ``missing`` names (None if none)."""
    votes: dict[str, int] = {}
    for k in keys:
        parts = k.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[i:]) in missing:
                p = ".".join(parts[:i]) + "."
                votes[p] = votes.get(p, 0) + 1
    return max(votes, key=votes.__getitem__) if votes else None


def _select(
    candidates: dict[str, OrderedDict[str, torch.Tensor]], key: str
) -> OrderedDict[str, torch.Tensor]:
    """The dict at ``key``, or the keys under prefix ``rest.`` of the dict at ``path`` for ``path.rest``."""
    if key in candidates:
        return candidates[key]
    for path, state in candidates.items():
        if not path or key.startswith(path + "."):
            prefix = (key[len(path) + 1 :] if path else key) + "."
            inside = OrderedDict((k, v) for k, v in state.items() if k.startswith(prefix))
            if inside:
                return _with_metadata(inside, state)
    raise BayescliError(
        f"--checkpoint-key '{key}' is not a dict of tensors in the checkpoint, nor one followed by a key "
        f"prefix; choose one of: {', '.join(repr(k) for k in candidates)}"
    )


def _prefixes(groups: list[list[str]]) -> list[str]:
    """``""`` and, per group of keys, every dotted prefix all its keys share (``a.``, ``a.b.``, …)."""
    out = [""]
    for keys in groups:
        split = [k.split(".") for k in keys]
        shortest = min(len(s) for s in split)
        for depth in range(1, shortest):
            if any(s[:depth] != split[0][:depth] for s in split):
                break
            out.append(".".join(split[0][:depth]) + ".")
    return list(dict.fromkeys(out))


def _rename_module(name: str, strip: str, add: str) -> str | None:
    """A module path of ``_metadata`` (``""`` = root) under the mapping; None if outside ``strip``."""
    dotted = f"{name}." if name else ""
    if not dotted.startswith(strip):
        return None
    return (add + dotted[len(strip) :])[:-1]


def _with_metadata(new: OrderedDict, old: object) -> OrderedDict:
    """``new`` carrying ``old``'s state-dict ``_metadata`` (module versions), if it has any."""
    metadata = getattr(old, "_metadata", None)
    if metadata is not None:
        new._metadata = metadata
    return new


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]
