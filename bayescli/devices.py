"""Where the maths runs: the ``--device`` choice, seeded generators on it, and host boundaries.

With a CUDA device the whole last-layer pipeline stays on it — features, curvature sums
(float64), eigendecompositions (float64), the prior search, predictives, links and metrics —
and only scalars and the final outputs come back to the host. Posterior files are device-free:
tensors are written from the host and read to whichever device the command uses.
"""

from __future__ import annotations

import torch

from bayescli.errors import BayescliError


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


def generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` on ``device`` (random draws must be made on the device of
    the tensors they fill; CPU and CUDA streams differ, so seeded draws are per device)."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels on ``device`` (so wall-clock timings mean something); CPU: no-op."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
