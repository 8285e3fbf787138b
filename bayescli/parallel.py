"""torch.distributed helpers: who this process is, which rows are its own, sums and gathers.

Started under ``torchrun`` (environment ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``), :func:`init` joins the process group — NCCL when the compute
device is CUDA, Gloo otherwise — and every helper acts across processes. Started plainly, the
world has one process and every helper is the identity, so library code calls them
unconditionally.

Shards are contiguous row ranges in rank order (:func:`shard`): their union is exactly the
dataset, with no duplicated or dropped row, and :func:`gather` concatenates per-rank results back
in dataset order. Sums go through :func:`all_reduce_sum` in float64, so a fit on several
processes reproduces the one-process sums up to the order of float64 additions.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from bayescli.errors import AllRanksError, BayescliError

SETTLE_SECONDS = 2.0  # how long ranks > 0 wait for rank 0's message when there is no process group


@dataclass(frozen=True)
class World:
    """This process's place: ``rank`` of ``size`` processes, ``local_rank`` on its machine."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise BayescliError(
            f"environment variable {name} must be an integer, got {os.environ[name]!r}"
        ) from None


def world() -> World:
    """The world as the launcher describes it (one process when not under torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), _env_int("LOCAL_RANK", 0))
    return World(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0))


def init(device: torch.device | None = None, timeout_s: float = 1800.0) -> World:
    """Join the process group when started by a launcher; returns the world.

    ``device`` picks the backend (NCCL for CUDA, Gloo otherwise) and, for CUDA, this process's
    GPU: ``cuda:LOCAL_RANK``. Idempotent.
    """
    w = world()
    if not w.distributed or dist.is_initialized():
        return w
    if not dist.is_available():
        raise BayescliError("WORLD_SIZE > 1 but this torch build has no torch.distributed; run one process")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise BayescliError(f"WORLD_SIZE is set but {name} is not; start the processes with torchrun")
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.set_device(w.local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return world()


def device_for(device: torch.device) -> torch.device:
    """``device`` with this process's GPU index under a launcher (``cuda`` → ``cuda:LOCAL_RANK``)."""
    w = world()
    if device.type == "cuda" and w.distributed:
        return torch.device("cuda", w.local_rank)
    return device


def shard(n: int, w: World | None = None, align: int = 1) -> range:
    """This process's rows of ``n``: contiguous, disjoint, covering ``0..n`` in rank order.

    With ``align = B`` the boundaries fall on multiples of ``B`` (blocks ``[rank·b/size,
    (rank+1)·b/size)`` of the ``b = ⌈n/B⌉`` batches), so every process reads exactly the batches a
    single process would (what per-batch seeded transforms need); when there are fewer batches
    than processes the boundaries fall back to single rows.
    """
    w = w or world()
    blocks = -(-n // align) if align > 1 else n
    if blocks < w.size:
        align, blocks = 1, n
    return range(min(w.rank * blocks // w.size * align, n), min((w.rank + 1) * blocks // w.size * align, n))


def local_rows(n: int, align: int = 1) -> torch.Tensor:
    """This process's rows of ``n`` (:func:`shard`) as an index tensor, for ``Data.subset``."""
    rows = shard(n, align=align)
    return torch.arange(rows.start, rows.stop)


def _comm_device() -> torch.device:
    """NCCL communicates CUDA tensors, Gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over all processes (float64; a new tensor on ``tensor``'s device)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor.double()
    buf = tensor.detach().to(_comm_device(), torch.float64).contiguous()
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.to(tensor.device)


def all_reduce_max(value: float) -> float:
    """The largest ``value`` over all processes (e.g. agreeing that some rank failed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    buf = torch.tensor([value], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return float(buf.item())


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every process's ``tensor`` ``[n_r, ...]`` along dim 0 in rank order.

    Shards may differ in length (padding is removed); the result lives on ``tensor``'s device and
    keeps its dtype.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    comm = _comm_device()
    size = dist.get_world_size()
    counts = torch.zeros(size, dtype=torch.int64, device=comm)
    counts[dist.get_rank()] = tensor.shape[0]
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    longest = int(counts.max())
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=comm)
    padded[: tensor.shape[0]] = tensor.to(comm)
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(c)] for p, c in zip(parts, counts.tolist(), strict=True)]).to(tensor.device)


def gather_objects(obj: object) -> list:
    """Every process's ``obj`` (picklable, e.g. a dict of skipped files) as a list in rank order.

    Objects travel between this job's own processes only (never from files).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``tensor`` as held by rank ``src`` (same shape on every rank; e.g. the chosen δ)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    buf = tensor.detach().to(_comm_device()).contiguous()
    dist.broadcast(buf, src=src)
    return buf.to(tensor.device)


def first_error(message: str | None) -> str | None:
    """Collective: the message of the lowest rank that failed (``None`` if none did), on every rank.

    Each rank passes its own error (or ``None``) at the same point of the program, so that a
    failure on one rank ends every rank with the same message instead of leaving the others
    waiting in a collective.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return message
    size, rank = dist.get_world_size(), dist.get_rank()
    failed = torch.zeros(size, dtype=torch.float64, device=_comm_device())
    failed[rank] = 1.0 if message is not None else 0.0
    dist.all_reduce(failed, op=dist.ReduceOp.SUM)
    ranks = failed.nonzero().flatten().tolist()
    if not ranks:
        return None
    src = int(ranks[0])
    data = (message or "").encode()[:4096] if rank == src else b""
    length = broadcast(torch.tensor([len(data)], dtype=torch.int64), src)
    buf = torch.zeros(int(length.item()), dtype=torch.uint8)
    if rank == src:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    text = bytes(broadcast(buf, src).tolist()).decode(errors="replace")
    return f"rank {src}: {text}"


@contextlib.contextmanager
def together() -> Iterator[None]:
    """Run a block on every rank; if it fails on any, raise :class:`AllRanksError` on all.

    The block's own :class:`BayescliError` is caught and shared through :func:`first_error` at
    the end of the block, so no rank is left waiting in a later collective. With one process the
    error passes through unchanged (as an ``AllRanksError``).
    """
    message = None
    try:
        yield
    except AllRanksError:
        raise
    except BayescliError as exc:
        message = str(exc)
    agreed = first_error(message)
    if agreed is not None:
        raise AllRanksError(agreed if world().distributed else message) from None


def settle_after_error() -> None:
    """Before a process exits on an error every rank shares: the other ranks wait until rank 0 has
    printed it (torchrun stops every process as soon as one exits, which could cut rank 0 off).

    Call on every rank; after the process group is up it is a barrier, before it the other ranks
    give rank 0 a moment.
    """
    w = world()
    if not w.distributed:
        return
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    elif not w.is_main:
        time.sleep(SETTLE_SECONDS)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    """Leave the process group (no-op when there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
