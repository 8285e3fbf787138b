"""Batched extraction of penultimate features ``φ(x)`` and logits, with an optional cache.

The backbone runs once per input set; everything downstream (curvature, predictives, links)
works on the features. A cache file is keyed by the checkpoint's SHA-256, the head and the data
provenance, so a stale cache is never reused.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bayescli.data import ArrayData
from bayescli.errors import BayescliError
from bayescli.io import load_tensors, save_tensors
from bayescli.models import LoadedModel
from bayescli.progress import track


@dataclass
class Features:
    """``phi [N, D]``, MAP ``logits [N, K]`` and ``labels [N]`` (or ``None``), on the CPU."""

    phi: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor | None
    seconds: float = 0.0

    def __len__(self) -> int:
        return int(self.phi.shape[0])


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` → CUDA when available, else CPU; otherwise ``cpu``/``cuda``/``cuda:i``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BayescliError(f"unknown device '{device}'; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BayescliError(f"device {device} requested but CUDA is not available; use --device cpu")
    return dev


def check_input_shape(model: LoadedModel, data: ArrayData) -> None:
    """Raise if ``data`` cannot be fed to ``model`` (recorded input shape, or a failed probe)."""
    expected = model.metadata.get("input_shape")
    if expected and list(data.input_shape) != list(expected):
        raise BayescliError(
            f"{data.spec} has inputs of shape {list(data.input_shape)} but {model.spec} expects "
            f"{list(expected)}; use data of the shape the model was trained on"
        )


def cache_key(model: LoadedModel, data: ArrayData) -> str:
    """Hex digest identifying (checkpoint bytes, head, data provenance and size)."""
    ident = {"sha256": model.sha256, "head": model.classifier.head_name, "data": data.info, "n": len(data)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def extract_features(
    model: LoadedModel,
    data: ArrayData,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    cache: str | Path | None = None,
) -> Features:
    """Run the backbone over ``data`` once; returns φ, logits and labels.

    The first batch verifies that ``head(features(x))`` reproduces the full forward pass.
    With ``cache``, a matching cache file is read instead, and a fresh one written otherwise.
    """
    key = cache_key(model, data)
    if cache is not None and Path(cache).is_file():
        tensors, meta = load_tensors(cache)
        if meta.get("key") == key:
            return Features(tensors["phi"], tensors["logits"], tensors.get("labels"), 0.0)
    check_input_shape(model, data)
    device = torch.device(device)
    clf = model.classifier.to(device).eval()
    phis, logits = [], []
    start = time.perf_counter()
    n_batches = (len(data) + batch_size - 1) // batch_size
    for i, (xb, _) in enumerate(track(data.batches(batch_size), n_batches, f"features {data.spec}")):
        xb = xb.to(device)
        if i == 0:
            try:
                clf.check_split(xb)
            except RuntimeError as exc:
                raise BayescliError(
                    f"{model.spec} cannot process inputs of shape {list(data.input_shape)} "
                    f"({str(exc).splitlines()[0][:160]}); check --data and --model"
                ) from None
        with torch.inference_mode():
            phi = clf.features(xb)
            phis.append(phi.float().cpu())
            logits.append(clf.head(phi).float().cpu())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    feats = Features(torch.cat(phis), torch.cat(logits), data.y, time.perf_counter() - start)
    if not torch.isfinite(feats.phi).all():
        raise BayescliError(f"{model.spec} produced non-finite features on {data.spec}; check the checkpoint")
    if cache is not None:
        tensors = {"phi": feats.phi, "logits": feats.logits}
        if feats.labels is not None:
            tensors["labels"] = feats.labels
        save_tensors(cache, tensors, {"key": key, "data": data.info, "checkpoint_sha256": model.sha256})
    return feats
