"""File formats: atomic writes, JSON, safetensors with JSON metadata, state-dict checkpoints.

Every writer goes through :func:`atomic_path`: data lands in a temporary file in the target's
directory and is renamed over the target only once complete, so an error or Ctrl-C never leaves
a half-written file. Readers never unpickle arbitrary objects.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from bayescli.errors import BayescliError

METADATA_KEY = "bayescli"


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it to ``path`` on success only."""
    target = Path(path)
    if target.parent and not target.parent.exists():
        raise BayescliError(f"output directory {target.parent} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp creates 0600 files; give the result the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)
        os.replace(tmp_path, target)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def plain(obj: Any) -> Any:
    """``obj`` as JSON-ready Python: tensors and NumPy values to lists/numbers, paths and enums to
    strings, and NaN/inf to ``None`` (JSON has no such numbers; every reader can parse null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, str | int | bool) or obj is None:
        return obj.value if isinstance(obj, Enum) else obj
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return plain(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, Enum):
        return plain(obj.value)
    if hasattr(obj, "tolist"):  # NumPy arrays and scalars
        return plain(obj.tolist())
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def to_json(obj: Any, indent: int | None = 2) -> str:
    """Serialise ``obj`` (dicts, lists, numbers, tensors, paths) to strict JSON."""
    return json.dumps(plain(obj), indent=indent, allow_nan=False)


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as JSON, atomically."""
    text = to_json(obj)
    with atomic_path(path) as tmp:
        tmp.write_text(text + "\n")


def write_jsonl(path: str | Path, header: Any, rows: Iterator[dict]) -> None:
    """Write ``header`` as the first line and each row as one line (JSON Lines), atomically.

    Rows are serialised as they come, so memory does not grow with their number. Rows of plain
    Python values (as ``tolist()`` gives) go straight to the encoder; anything else, or a NaN/inf,
    takes the :func:`plain` route.
    """
    encode = json.JSONEncoder(allow_nan=False).encode
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(to_json(header, indent=None) + "\n")
        for row in rows:
            try:
                line = encode(row)
            except (TypeError, ValueError):
                line = encode(plain(row))
            fh.write(line + "\n")


def read_json(path: str | Path) -> Any:
    """Read a JSON file, with a clear error when it is missing or malformed."""
    p = Path(path)
    if not p.is_file():
        raise BayescliError(f"file not found: {p}")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BayescliError(f"{p} is not valid JSON ({exc}); regenerate it") from None


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict) -> None:
    """Write ``tensors`` to a ``.safetensors`` file with ``metadata`` as a JSON header, atomically."""
    plain = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    header = {METADATA_KEY: to_json(metadata, indent=None)}
    with atomic_path(path) as tmp:
        save_file(plain, str(tmp), metadata=header)


def load_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a ``.safetensors`` file; returns ``(tensors, metadata)`` (metadata may be empty)."""
    p = Path(path)
    if not p.is_file():
        raise BayescliError(f"file not found: {p}")
    try:
        tensors = load_file(str(p))
        with safe_open(str(p), framework="pt") as f:
            raw = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise BayescliError(
            f"{p} is not a readable safetensors file ({str(exc).splitlines()[0]}); "
            "it may be truncated or corrupt, re-create it"
        ) from None
    meta: dict = {}
    if METADATA_KEY in raw:
        try:
            meta = json.loads(raw[METADATA_KEY])
        except json.JSONDecodeError:
            raise BayescliError(f"{p} has corrupt bayescli metadata; re-create it") from None
    return tensors, meta


def peek_metadata(path: str | Path) -> dict:
    """The bayescli metadata of a ``.safetensors`` file from its header alone, without reading the
    tensors; ``{}`` when the file is missing or unreadable (reading it in full says why)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
        return json.loads(raw.get(METADATA_KEY, "{}"))
    except (SafetensorError, OSError, ValueError):  # JSONDecodeError is a ValueError
        return {}


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
