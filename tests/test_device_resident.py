"""``--device cuda`` keeps the maths on the device: checked on an emulated GPU.

With a CUDA device, features, curvature sums (float64), eigendecompositions (float64), the prior
search, predictives, links, top-k inputs and metrics run where the backbone runs, and posterior
files stay device-free. This machine has no GPU, so ``tests/emulated_cuda.py`` emulates one: its
tensors say ``cuda:0`` but compute with the CPU's kernels, an op that mixes them with host
tensors raises as CUDA does, and every copy back to the host and every scalar read is counted.
Generators seeded on "cuda" are CPU generators there, so a run on the emulated device must give
the CPU run's numbers exactly (same kernels, same draws). Each command is checked for:

1. **no mixing**: the command succeeds with ``--device cuda`` (a stray host tensor would raise);
2. **same numbers** as ``--device cpu`` (posterior tensors, δ, reports, per-input outputs);
3. **nothing back per batch**: a run over 4× as many batches makes exactly as many host reads.
   Reads that do not scale with the data (a metric's scalar, one copy of each result) are
   allowed; a per-batch ``.item()``/``.cpu()`` would add one read per extra batch. Iterative
   solvers' reads are left out of the count (``SOLVERS``): they read one scalar a step and may
   take a step more or less when the features of other batchings differ in the last bits.
"""

from __future__ import annotations

import json

import pytest
from device_harness import BATCHES, SAME_DRAWS, results, run_cli, same, same_tensors
from tolerance import assert_close

from bayescli.io import load_tensors
from bayescli.predictive import links


def test_fit_laplace_on_the_device_equals_cpu_and_reads_nothing_per_batch(cli, digits_ckpt, tmp_path):
    common = ("fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt,
              "--data", "digits:train", "--quiet")  # fmt: skip
    reads, events = {}, {}
    for bs in BATCHES:
        out = tmp_path / f"gpu{bs}.safetensors"
        res, reads[bs], events[bs] = run_cli(cli, *common, "--batch-size", bs, "--out", out, device="cuda")
        assert res.code == 0, res.err
    cpu = cli(*common, "--batch-size", 32, "--out", tmp_path / "cpu.safetensors", "--device", "cpu")
    assert cpu.code == 0, cpu.err
    meta_gpu, meta_cpu = same_tensors(tmp_path / "gpu32.safetensors", tmp_path / "cpu.safetensors")
    same(meta_gpu["prior_precision"], meta_cpu["prior_precision"], "prior precision")
    same(meta_gpu["log_likelihood"], meta_cpu["log_likelihood"], "log-likelihood")
    assert reads[BATCHES[0]] == reads[BATCHES[1]], f"host reads {reads}: 34 vs 9 batches\n{events[32]}"


@pytest.mark.parametrize(
    ("link", "suffix"), [("probit", ".jsonl"), ("bridge", ".safetensors"), ("mc", ".safetensors")]
)
def test_predict_on_the_device_equals_cpu_and_reads_nothing_per_batch(
    cli, digits_posterior, tmp_path, monkeypatch, link, suffix
):
    # 500 MC samples: the MC link's chunks hold 52 inputs, so 360 vs 120 inputs are 7 vs 3 chunks;
    # the bridge's chunks are cut to 50 inputs for the same reason (8 vs 3). On "cuda" a chunk is
    # the device's budget (devices.chunk_elements), cut to the same rows: 10 classes, BRIDGE_BYTES
    # a number; 500 × 10 draws of MC_BUFFERS float32 buffers
    monkeypatch.setattr("bayescli.predictive.links.BRIDGE_CHUNK_ELEMENTS", 500)
    budget = {"bridge": 50 * 10 * links.BRIDGE_BYTES, "mc": 52 * 500 * 10 * links.MC_BUFFERS * 4}
    monkeypatch.setattr("bayescli.devices.CUDA_CHUNK_MAX_BYTES", budget.get(link, 1 << 30))
    common = ("predict", "--posterior", digits_posterior, "--data", "digits:test", "--link", link,
              "--samples", 500, "--quiet")  # fmt: skip
    reads, events = {}, {}
    runs = {"32": ("--batch-size", 32), "128": ("--batch-size", 128), "120 rows": ("--limit", 120)}
    for name, opts in runs.items():
        out = tmp_path / f"gpu{name.split()[0]}{suffix}"
        res, reads[name], events[name] = run_cli(cli, *common, *opts, "--out", out, device="cuda")
        assert res.code == 0, res.err
    cpu = cli(*common, "--batch-size", 32, "--out", tmp_path / f"cpu{suffix}", "--device", "cpu")
    assert cpu.code == 0, cpu.err
    if link == "mc" and not SAME_DRAWS:
        pass  # a real GPU draws other samples: the run above checks the device discipline only
    elif suffix == ".jsonl":
        gpu_rows = (tmp_path / f"gpu32{suffix}").read_text().splitlines()[1:]
        cpu_rows = (tmp_path / f"cpu{suffix}").read_text().splitlines()[1:]
        same([json.loads(r) for r in gpu_rows], [json.loads(r) for r in cpu_rows], "rows")
    else:
        same_tensors(tmp_path / f"gpu32{suffix}", tmp_path / f"cpu{suffix}")
    # not per batch (12 vs 3), not per chunk or input (360 vs 120 inputs): per-input rows are
    # copied back 4,096 at a time, metrics read one scalar each
    assert len(set(reads.values())) == 1, f"host reads {reads}\n{events['32']}"


def test_evaluate_on_the_device_equals_cpu_and_reads_nothing_per_batch(cli, digits_posterior, tmp_path):
    common = ("evaluate", "--posterior", digits_posterior, "--data", "digits:test",
              "--ood", "noise:uniform", "--rotation", "0,90", "--corruption", "gaussian_noise",
              "--severity", 3, "--fgsm", "2/255", "--conformal", 0.1, "--samples", 50,
              "--methods", "map,temp,glm-probit,glm-mc,glm-bridge,bnn-mc", "--fidelity-inputs", 0,
              "--quiet")  # fmt: skip
    # (no link fidelity: its 2,000-draw MC reference is chunked by the device's budget, so the same
    # seed gives other draws than the CPU's cache-sized chunks; tests/test_chunking.py covers chunks)
    reads, events = {}, {}
    for bs in BATCHES:
        res, reads[bs], events[bs] = run_cli(
            cli, *common, "--batch-size", bs, "--out", tmp_path / f"gpu{bs}.json", device="cuda"
        )
        assert res.code == 0, res.err
    cpu = cli(*common, "--batch-size", 32, "--out", tmp_path / "cpu.json", "--device", "cpu")
    assert cpu.code == 0, cpu.err
    if SAME_DRAWS:  # glm-mc and bnn-mc draw seeded samples, other ones on a real GPU
        same(results(tmp_path / "gpu32.json"), results(tmp_path / "cpu.json"), "report")
    assert json.loads((tmp_path / "gpu32.json").read_text())["environment"]["device"] == "cuda"
    # every suite reads its metrics' scalars once: nothing scales with the 12 vs 3 batches
    assert reads[BATCHES[0]] == reads[BATCHES[1]], f"host reads {reads}\n{events[32]}"


@pytest.mark.parametrize("command", ["topk", "conformal"])
def test_set_commands_on_the_device_equal_cpu(cli, digits_posterior, tmp_path, command):
    extra = ("--method", "glm-probit", "--score", "raps") if command == "conformal" else ()
    common = (command, "--posterior", digits_posterior, "--data", "digits:test", *extra, "--quiet")
    reads = {}
    for bs in BATCHES:
        res, reads[bs], _ = run_cli(
            cli, *common, "--batch-size", bs, "--out", tmp_path / f"gpu{bs}.json", device="cuda"
        )
        assert res.code == 0, res.err
    cpu = cli(*common, "--batch-size", 32, "--out", tmp_path / "cpu.json", "--device", "cpu")
    assert cpu.code == 0, cpu.err
    same(results(tmp_path / "gpu32.json"), results(tmp_path / "cpu.json"), command)
    assert reads[BATCHES[0]] == reads[BATCHES[1]], reads


@pytest.mark.parametrize("method", ["dirichlet-fvi", "glm-vi", "ggp-vi"])
def test_fit_vi_runs_on_the_device_and_equals_cpu(cli, digits_ckpt, tmp_path, method):
    # Posterior maths of these methods on their own device (Dirichlet fVI) or back on the host
    # after one copy of the features (GLM VI, GGP VI): either way the same file as on the CPU.
    common = ("fit-vi", "--method", method, "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt,
              "--data", "digits:train", "--quiet")  # fmt: skip
    res, _, _ = run_cli(cli, *common, "--out", tmp_path / "gpu.safetensors", device="cuda")
    assert res.code == 0, res.err
    cpu = cli(*common, "--out", tmp_path / "cpu.safetensors", "--device", "cpu")
    assert cpu.code == 0, cpu.err
    if SAME_DRAWS:  # VI fits draw seeded noise, other draws on a real GPU
        same_tensors(tmp_path / "gpu.safetensors", tmp_path / "cpu.safetensors")


def test_dirichlet_fvi_predictive_on_the_device_equals_cpu_in_few_large_chunks(
    cli, digits_ckpt, tmp_path, monkeypatch
):
    # Minka's fixed point reads its active-row count back once per iteration and chunk: on a GPU
    # the predictive uses one chunk per matmul block, not the CPU's cache-sized sub-chunks (cut
    # to ~20 inputs here, so that sub-chunking would read back per 20 inputs: 18 vs 6 chunks).
    monkeypatch.setattr("bayescli.posterior.vi.dirichlet_fvi_posterior.CACHE_CHUNK_ELEMENTS", 2000)
    post = tmp_path / "dfvi.safetensors"
    fit = cli("fit-vi", "--method", "dirichlet-fvi", "--model", "builtin:small-cnn", "--checkpoint",
              digits_ckpt, "--data", "digits:train", "--out", post, "--device", "cpu", "--quiet")  # fmt: skip
    assert fit.code == 0, fit.err
    common = ("predict", "--posterior", post, "--data", "digits:test", "--bridge", "--quiet")
    reads = {}
    for limit in (360, 120):
        out = tmp_path / f"gpu{limit}.safetensors"
        res, reads[limit], events = run_cli(cli, *common, "--limit", limit, "--out", out, device="cuda")
        assert res.code == 0, res.err
    cpu = cli(*common, "--limit", 360, "--out", tmp_path / "cpu.safetensors", "--device", "cpu")
    assert cpu.code == 0, cpu.err
    # Other chunks, other vector/tail paths of digamma in the last bits; Minka stops a row once
    # |Δz| ≤ 1e-5·z, so rounding can move its stopping step: α agrees to that tolerance, not to SAME.
    gpu, _ = load_tensors(tmp_path / "gpu360.safetensors")
    ref, _ = load_tensors(tmp_path / "cpu.safetensors")
    for key in ("alpha", "probs"):
        assert_close(gpu[key], ref[key], rtol=1e-5, atol=1e-12, what=f"{key} on the device")
    assert reads[360] == reads[120], f"host reads {reads}\n{events}"
