"""torch.distributed helpers on 2 CPU processes (Gloo), started the way torchrun starts them."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from bayescli import parallel
from bayescli.errors import AllRanksError, BayescliError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _together(rank: int) -> str | None:
    try:
        with parallel.together():
            if rank == 0:
                raise BayescliError("missing file x.png")
    except AllRanksError as exc:
        return str(exc)
    return None


def _worker(rank: int, size: int, port: int, queue) -> None:
    # The environment torchrun sets; parallel.init reads nothing else.
    env = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": rank, "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    w = parallel.init(torch.device("cpu"), timeout_s=60)
    rows = parallel.shard(10, w)
    mine = torch.arange(10.0)[rows.start : rows.stop]
    out = {
        "world": (w.rank, w.size, w.is_main),
        "rows": (rows.start, rows.stop),
        "sum": parallel.all_reduce_sum(mine.sum().reshape(1)).item(),
        "gathered": parallel.gather(mine.reshape(-1, 1) * 2).flatten().tolist(),
        "max": parallel.all_reduce_max(float(rank)),
        "bcast": parallel.broadcast(torch.tensor([float(rank + 7)]), src=1).item(),
        "no_error": parallel.first_error(None),
        "error": parallel.first_error("bad shard: NaN in inputs" if rank == 1 else None),
        "together": _together(rank),
    }
    queue.put((rank, out))
    parallel.barrier()
    parallel.shutdown()


def test_two_processes_shard_sum_and_gather():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0]["world"] == (0, 2, True) and results[1]["world"] == (1, 2, False)
    # Contiguous shards that cover 0..10 exactly once, with 10 = 5 + 5.
    assert results[0]["rows"] == (0, 5) and results[1]["rows"] == (5, 10)
    for r in (0, 1):
        assert results[r]["sum"] == 45.0  # Σ 0..9, integers exact in float64
        assert results[r]["gathered"] == [2.0 * i for i in range(10)]  # dataset order
        assert results[r]["max"] == 1.0
        assert results[r]["bcast"] == 8.0  # rank 1's value
        assert results[r]["no_error"] is None
        # Rank 1's failure reaches rank 0 too, so both stop with the same message.
        assert results[r]["error"] == "rank 1: bad shard: NaN in inputs"
        assert results[r]["together"] == "rank 0: missing file x.png"


@pytest.mark.parametrize("n,size", [(0, 3), (7, 3), (10, 4), (1000, 7)])
def test_shards_partition_the_rows(n, size):
    rows = [list(parallel.shard(n, parallel.World(r, size))) for r in range(size)]
    assert sum(rows, []) == list(range(n))
    assert max(map(len, rows)) - min(map(len, rows)) <= 1


def test_single_process_helpers_are_identities(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    w = parallel.init(torch.device("cpu"))
    assert (w.rank, w.size, w.distributed) == (0, 1, False)
    t = torch.arange(4.0)
    assert torch.equal(parallel.gather(t), t) and torch.equal(parallel.all_reduce_sum(t), t.double())
    assert parallel.shard(5) == range(0, 5)


def test_together_passes_a_single_process_error_through():
    with pytest.raises(AllRanksError, match="^bad input$"), parallel.together():
        raise BayescliError("bad input")
    with parallel.together():
        pass
