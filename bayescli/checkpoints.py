"""Real-world checkpoint files: reading them safely and finding the state dict inside.

Checkpoints come as ``.safetensors`` or as torch pickles (``.pt .pth .th .tar .bin .ckpt``), the
latter read with ``torch.load(weights_only=True)``, which accepts tensors and plain containers only.
Training code wraps the weights (``{"state_dict": …}``, ``{"model": …, "optimizer": …}``, EMA
copies, Lightning's ``{"state_dict": {"model.…": …}}``) and prefixes their names (``module.`` from
``DataParallel``/DDP, ``_orig_mod.`` from ``torch.compile``, ``model.`` from Lightning).
:func:`resolve_state_dict` picks the dict of tensors that fits the architecture, strips those
prefixes where the architecture lacks them, and says what it did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from bayescli.errors import BayescliError
from bayescli.io import load_tensors

TORCH_SUFFIXES = (".pt", ".pth", ".th", ".tar", ".bin", ".ckpt")
# Prefixes added by wrappers, stripped (repeatedly, in any order) when the architecture lacks them.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")
_MAX_DEPTH = 4


def read_checkpoint(path: str | Path) -> tuple[object, dict]:
    """The checkpoint's content and its bayescli metadata (empty for torch pickles)."""
    p = Path(path)
    if not p.is_file():
        raise BayescliError(f"checkpoint not found: {p}")
    suffix = p.suffix.lower()
    if suffix == ".safetensors":
        return load_tensors(p)
    if suffix not in TORCH_SUFFIXES:
        raise BayescliError(
            f"unsupported checkpoint format '{suffix or p.name}': use .safetensors (preferred) or a "
            f"torch file ({' '.join(TORCH_SUFFIXES)}) holding a state dict"
        )
    try:
        obj = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for bad or unsafe pickles
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BayescliError(
            f"cannot load {p} as a weights-only checkpoint ({first[:200]}); save it with "
            "torch.save(model.state_dict(), ...) or convert it to .safetensors"
        ) from None
    return obj, {}


def tensor_dicts(obj: object) -> dict[str, dict[str, torch.Tensor]]:
    """Every dict of tensors inside ``obj``, keyed by its dotted path (``""`` for ``obj`` itself).

    Lists and tuples are entered with their index as the path component; non-tensor leaves are
    skipped, so ``{"state_dict": {...}, "epoch": 3}`` yields ``{"state_dict": {...}}``.
    """
    found: dict[str, dict[str, torch.Tensor]] = {}

    def walk(node: object, path: str, depth: int) -> None:
        if isinstance(node, dict):
            tensors = {str(k): v for k, v in node.items() if isinstance(v, torch.Tensor)}
            if tensors and len(tensors) == len(node):
                found[path] = tensors
                return
            children = node.items()
        elif isinstance(node, list | tuple):
            children = enumerate(node)
        else:
            return
        if depth < _MAX_DEPTH:
            for k, v in children:
                walk(v, f"{path}.{k}" if path else str(k), depth + 1)

    walk(obj, "", 0)
    return found


def _matches(state: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> int:
    return sum(1 for k, v in state.items() if k in expected and v.shape == expected[k])


def _strip(
    state: dict[str, torch.Tensor], expected: dict[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Remove the wrapper prefixes that every key carries, as far as that fits ``expected`` best.

    Wrappers nest (``module._orig_mod.``), so the whole chain of shared prefixes is peeled off and
    the shortest peeling with the most matching names is kept: an architecture whose own names
    start with ``model.`` keeps them.
    """
    chain = [(state, [])]
    while True:
        current, stripped = chain[-1]
        shared = (p for p in WRAPPER_PREFIXES if current and all(k.startswith(p) for k in current))
        prefix = next(shared, None)
        if prefix is None:
            break
        chain.append(({k[len(prefix) :]: v for k, v in current.items()}, [*stripped, prefix]))
    return max(chain, key=lambda item: _matches(item[0], expected))


@dataclass
class ResolvedState:
    """The state dict chosen for an architecture and how it was found."""

    state: dict[str, torch.Tensor]
    key: str
    stripped: list[str] = field(default_factory=list)
    candidates: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        return {"checkpoint_key": self.key or None, "stripped_prefixes": self.stripped}


def resolve_state_dict(obj: object, expected: dict[str, torch.Size], key: str | None = None) -> ResolvedState:
    """Pick the dict of tensors in ``obj`` that fits ``expected`` (name → shape) best.

    ``key`` (dotted, e.g. ``state_dict`` or ``ema.module``) selects one explicitly. Candidates are
    ranked by how many expected names they provide with the right shape after prefix stripping;
    ties keep the first found (the outer ``state_dict``/``model`` before EMA copies inside it).
    """
    candidates = tensor_dicts(obj)
    if not candidates:
        raise BayescliError("the checkpoint holds no dict of tensors; save model.state_dict()")
    if key is not None:
        if key not in candidates:
            raise BayescliError(
                f"--checkpoint-key '{key}' is not a dict of tensors in the checkpoint; "
                f"choose one of: {', '.join(repr(k) for k in candidates)}"
            )
        candidates = {key: candidates[key]}
    best: ResolvedState | None = None
    best_score = -1
    for path, state in candidates.items():
        state, stripped = _strip(state, expected)
        score = _matches(state, expected)
        if score > best_score:
            best, best_score = ResolvedState(state, path, stripped, list(candidates)), score
    return best


def mismatch_message(state: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> str | None:
    """One line naming the first missing, unexpected and mis-shaped keys and the likely fix."""
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [k for k in expected if k in state and state[k].shape != expected[k]]
    if not (missing or unexpected or shapes):
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (first '{missing[0]}')")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (first '{unexpected[0]}')")
    if shapes:
        k = shapes[0]
        parts.append(
            f"{len(shapes)} with other shapes (first '{k}': checkpoint {tuple(state[k].shape)}, "
            f"model {tuple(expected[k])})"
        )
    if missing and unexpected and len(missing) == len(unexpected):
        fix = "the names differ by a prefix: pass --checkpoint-key or re-save without the wrapper"
    elif shapes and not (missing or unexpected):
        fix = "same layers, other sizes: check the model variant (--model) and the class count"
    else:
        fix = "the checkpoint belongs to another architecture: check --model"
    return f"{'; '.join(parts)} — {fix}"
