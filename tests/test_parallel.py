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


def _fit(args: list, out, extra_env: dict | None = None, launcher: list | None = None):
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    cmd = [sys.executable, *(launcher or []), "-m", "bayescli", "fit-laplace", *map(str, args)]
    root = Path(__file__).parents[1]
    return subprocess.run(
        [*cmd, "--out", str(out)], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("hessian", ["kron", "diag"])
def test_torchrun_two_processes_fit_the_one_process_posterior(digits_ckpt, tmp_path, hessian):
    """Each process fits its half of digits:train; the summed posterior is the one-process one."""
    from bayescli.io import load_tensors

    args = ["--model", "builtin:small-cnn", "--checkpoint", digits_ckpt, "--data", "digits:train",
            "--hessian", hessian, "--prior-precision", "auto", "--device", "cpu", "--quiet"]  # fmt: skip
    one = _fit(args, tmp_path / "one.safetensors")
    assert one.returncode == 0, one.stderr
    run = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port())]  # fmt: skip
    two = _fit(args, tmp_path / "two.safetensors", launcher=run)
    assert two.returncode == 0, two.stderr
    t1, m1 = load_tensors(tmp_path / "one.safetensors")
    t2, m2 = load_tensors(tmp_path / "two.safetensors")
    assert m2["processes"] == 2 and m1["processes"] == 1 and m1["n_data"] == m2["n_data"]
    # Float32 partial sums regrouped at the shard boundary: agreement to float32 accumulation
    # error (~1e-7 relative), asserted at the 1e-6.
    for key in t1:
        scale = t1[key].double().abs().max()
        assert (t1[key].double() - t2[key].double()).abs().max() <= 1e-6 * scale, key
    assert abs(m1["prior_precision"] - m2["prior_precision"]) <= 1e-6 * m1["prior_precision"]
    assert abs(m1["log_likelihood"] - m2["log_likelihood"]) <= 1e-6 * abs(m1["log_likelihood"])
