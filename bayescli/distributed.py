"""Explicit multi-process set-up for library users under ``torchrun``.

``bayescli.distributed.init()`` joins the process group (NCCL for CUDA, Gloo for CPU) and returns
this process's device (``cuda:LOCAL_RANK`` for CUDA). Nothing else in the library joins a process
group on its own; the CLI calls this for the commands that shard their work (fit-laplace,
evaluate). In a plain process it only resolves the device.
"""

from __future__ import annotations

import torch

from bayescli import parallel
from bayescli.devices import resolve_device


def init(device: torch.device | str = "auto", timeout_s: float = 1800.0) -> torch.device:
    """Join the process group when started by a launcher; returns this process's device."""
    dev = resolve_device(device) if isinstance(device, str) else torch.device(device)
    parallel.init(dev, timeout_s)
    return parallel.device_for(dev)


def is_distributed() -> bool:
    """Whether this process is one of several started by a launcher (``WORLD_SIZE > 1``)."""
    return parallel.world().distributed
