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
        "objects": parallel.gather_objects({rank: ("f.png", "bad")}),
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
        assert results[r]["objects"] == [{0: ("f.png", "bad")}, {1: ("f.png", "bad")}]


@pytest.mark.parametrize("n,size", [(0, 3), (7, 3), (10, 4), (1000, 7)])
def test_shards_partition_the_rows(n, size):
    rows = [list(parallel.shard(n, parallel.World(r, size))) for r in range(size)]
    assert sum(rows, []) == list(range(n))
    assert max(map(len, rows)) - min(map(len, rows)) <= 1


@pytest.mark.parametrize("n,size,align", [(1000, 3, 64), (130, 2, 64), (100, 4, 64), (64, 2, 64), (0, 2, 8)])
def test_aligned_shards_fall_on_batch_boundaries(n, size, align):
    rows = [parallel.shard(n, parallel.World(r, size), align) for r in range(size)]
    assert sum((list(r) for r in rows), []) == list(range(n))
    if -(-n // align) >= size:  # enough batches: every boundary is a batch boundary
        assert all(r.start % align == 0 for r in rows)
    else:  # too few batches for the processes: single-row shards
        assert rows == [parallel.shard(n, parallel.World(r, size)) for r in range(size)]


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


def _bayescli(args: list, launcher: list | None = None):
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *(launcher or []), "-m", "bayescli", *map(str, args)]
    return subprocess.Popen(
        cmd, cwd=Path(__file__).parents[1], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


TEARDOWN_ABORT = "terminate called without an active exception"


def _finish(proc) -> tuple[int, str]:
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err


def _torchrun(nproc: int) -> list:
    return ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(_free_port())]  # fmt: skip


@pytest.mark.parametrize("hessian", ["kron", "diag"])
def test_torchrun_two_processes_fit_the_one_process_posterior(digits_ckpt, tmp_path, hessian):
    """Each process fits its half of digits:train; the summed posterior is the one-process one."""
    from bayescli.io import load_tensors

    args = ["--model", "builtin:small-cnn", "--checkpoint", digits_ckpt, "--data", "digits:train",
            "--hessian", hessian, "--prior-precision", "auto", "--device", "cpu", "--quiet"]  # fmt: skip
    code, err = _finish(_bayescli(["fit-laplace", *args, "--out", tmp_path / "one.safetensors"]))
    assert code == 0, err
    two = _bayescli(["fit-laplace", *args, "--out", tmp_path / "two.safetensors"], _torchrun(2))
    code, err = _finish(two)
    assert code == 0, err
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


def test_torchrun_evaluate_equals_one_process(digits_posterior, tmp_path):
    """Sharded suites gathered before the metrics: the same report as one process.

    Deterministic methods only (an MC link draws per process); gaussian_noise is seeded per batch,
    and batch-aligned shards read the same batches, so even the noisy copies are identical.
    """
    import json

    args = ["evaluate", "--posterior", digits_posterior, "--data", "digits:test", "--limit", "200",
            "--batch-size", "32", "--methods", "map,glm-probit,glm-bridge", "--ood", "patches",
            "--ood-limit", "90", "--rotation", "0:60:60", "--corruption", "gaussian_noise", "--severity", "3",
            "--device", "cpu", "--quiet"]  # fmt: skip
    code, err = _finish(_bayescli([*args, "--out", tmp_path / "one.json"]))
    assert code == 0, err
    code, err = _finish(_bayescli([*args, "--out", tmp_path / "two.json"], _torchrun(2)))
    assert code == 0, err
    one = json.loads((tmp_path / "one.json").read_text())["results"]
    two = json.loads((tmp_path / "two.json").read_text())["results"]

    def leaves(tree, path=""):
        if isinstance(tree, dict):
            for k, v in tree.items():
                yield from leaves(v, f"{path}.{k}")
        elif isinstance(tree, list):
            for i, v in enumerate(tree):
                yield from leaves(v, f"{path}[{i}]")
        else:
            yield path, tree

    a, b = dict(leaves(one)), dict(leaves(two))
    assert a.keys() == b.keys() and "ood.patches.glm-probit.max_prob.auroc" in {k[1:] for k in a}
    for key, value in a.items():
        if isinstance(value, float):
            # Each input's outputs are computed from the same float32 features either way; only
            # float64 metric sums may regroup: 1e-5 is the prediction tolerance.
            assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        else:
            assert b[key] == value, key


def test_two_nodes_by_rendezvous_fit_the_one_process_posterior(digits_ckpt, tmp_path):
    """Multi-node is torchrun's rendezvous: two "nodes" of one process each on localhost."""
    from bayescli.io import load_tensors

    fit = ["fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt,
           "--data", "digits:train", "--hessian", "kron", "--prior-precision", "auto", "--device", "cpu",
           "--quiet"]  # fmt: skip
    code, err = _finish(_bayescli([*fit, "--out", tmp_path / "one.safetensors"]))
    assert code == 0, err
    port = _free_port()
    nodes = [
        _bayescli(
            [*fit, "--out", tmp_path / "nodes.safetensors"],
            [
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "bayescli-test",
            ],
        )  # fmt: skip
        for _ in range(2)
    ]
    for node in nodes:
        code, err = _finish(node)
        assert code == 0, err
    t1, m1 = load_tensors(tmp_path / "one.safetensors")
    t2, m2 = load_tensors(tmp_path / "nodes.safetensors")
    assert m2["processes"] == 2
    for key in t1:
        scale = float(t1[key].abs().max())
        assert torch.allclose(t2[key].double(), t1[key].double(), rtol=1e-6, atol=1e-6 * scale), key
    assert m2["prior_precision"] == pytest.approx(m1["prior_precision"], rel=1e-6)


def test_a_failure_on_one_rank_ends_every_rank_with_one_message(tmp_path):
    """An unreadable image in the second process's shard: both processes exit 2, one message, no file."""
    import numpy as np
    from PIL import Image

    from bayescli.data import load_data
    from bayescli.io import load_tensors
    from bayescli.options import TrainConfig
    from bayescli.training.classifier import save_checkpoint, train_classifier

    rng = np.random.default_rng(0)
    for c, cls in enumerate(("a", "b")):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(12):
            pixels = rng.integers(0, 128, size=(8, 8, 3)) + 127 * c
            Image.fromarray(pixels.astype(np.uint8)).save(tmp_path / "imgs" / cls / f"{i:03d}.png")
    clf, meta = train_classifier(
        "builtin:small-cnn", load_data(f"imagefolder:{tmp_path / 'imgs'}"), None, TrainConfig(epochs=1)
    )
    save_checkpoint(tmp_path / "cnn.safetensors", clf, meta)
    broken = tmp_path / "imgs" / "b" / "011.png"
    broken.write_bytes(b"not a png")  # the last row: rank 1's shard
    out = tmp_path / "post.safetensors"
    args = ["fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", tmp_path / "cnn.safetensors",
            "--data", f"imagefolder:{tmp_path / 'imgs'}", "--device", "cpu", "--quiet",
            "--out", out]  # fmt: skip
    code, err = _finish(_bayescli(args, _torchrun(2)))
    assert code != 0  # torchrun's own status: a worker failed
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: rank 1: cannot read {broken}"), err
    assert err.count("exitcode") >= 1 and "exitcode  : 2" in err, err
    assert not out.exists()

    # Skipped on rank 1, recorded by rank 0; each process caches its own shard's features.
    cache = tmp_path / "feats"
    skipping = [*args, "--skip-unreadable", "--feature-cache", cache]
    code, err = _finish(_bayescli(skipping, _torchrun(2)))
    if code != 0 and TEARDOWN_ABORT in err:
        # Intermittently, under load, a rank aborts in torch's own teardown after a successful
        # run (std::terminate at interpreter exit, SIGABRT), the process group already destroyed
        # by the CLI: not this test's subject, so such a run is repeated once.
        code, err = _finish(_bayescli(skipping, _torchrun(2)))
    assert code == 0, err
    _, meta = load_tensors(out)
    assert meta["n_data"] == 23 and meta["data"]["unreadable"]["paths"] == [str(broken)]
    assert sorted(p.name for p in tmp_path.glob("feats.rank*")) == ["feats.rank0-of-2", "feats.rank1-of-2"]


def test_commands_that_do_not_shard_refuse_to_run_on_several_processes(cli, monkeypatch, tmp_path):
    """Under a launcher (RANK/WORLD_SIZE set), predict would repeat its work on every process."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "m.safetensors"
    res = cli("train", "--model", "builtin:mlp", "--data", "digits:train", "--epochs", "1", "--out", out)
    assert res.code == 2 and "start it without torchrun" in res.err and len(res.err.strip().splitlines()) == 1
    assert not out.exists()
    # under torchrun: every process refuses, rank 0 says it once
    code, err = _finish(
        _bayescli(["train", "--model", "builtin:mlp", "--data", "digits:train", "--out", out], _torchrun(2))
    )
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(errors) == 1 and "start it without torchrun" in errors[0], err
