"""Chunk sizes come from the device (``bayescli.devices.chunk_elements``).

On a CPU every chunked loop keeps its cache-sized constant (today's numbers and speed); on CUDA a
chunk is the device's memory budget over the loop's bytes per element, so the loops run in few,
large kernels. CUDA is emulated (``tests/emulated_cuda.py``: an 80 GiB device, so a 4 GiB
budget): the chunk counts on "cuda" are the budget's, and the results equal the CPU's chunked
computation to the rounding that another chunking allows.
"""

from __future__ import annotations

import math

import pytest
import torch
from emulated_cuda import emulated_cuda
from tolerance import assert_close

import bayescli.dirichlet as dirichlet
import bayescli.evaluation.detectors as det
import bayescli.posterior.vi.dirichlet_fvi_posterior as dfvi
import bayescli.predictive.links as links
import bayescli.predictive.sigmoid_links as sl
from bayescli import devices
from bayescli.options import Subset
from bayescli.posterior.curvature import CurvatureAccumulator, curvature_row_bytes
from bayescli.posterior.gaussian import LogitGaussian

BUDGET = 4 << 30  # min(CUDA_CHUNK_MAX_BYTES, 80 GiB / 16)


def _lg(n: int, k: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> LogitGaussian:
    gen = torch.Generator().manual_seed(seed)
    mean = 3 * torch.randn(n, k, generator=gen, dtype=dtype)
    return LogitGaussian(mean, torch.rand(n, k, generator=gen, dtype=dtype) + 0.1)


def _on_cuda(lg: LogitGaussian) -> LogitGaussian:
    return LogitGaussian(lg.mean.to("cuda"), lg.var.to("cuda"))


def test_cpu_chunks_are_the_cache_sized_constants():
    # the CPU numbers the modules had before the policy: CPU results and speed unchanged
    assert (links.BRIDGE_CHUNK_ELEMENTS, links.MC_CHUNK_ELEMENTS) == (1 << 18, 1 << 18)
    assert (sl.MC_CHUNK_ELEMENTS, sl.QUADRATURE_CHUNK) == (1 << 18, 1 << 14)
    assert (dfvi.PREDICT_CHUNK_ELEMENTS, dfvi.CACHE_CHUNK_ELEMENTS, dfvi.MINKA_CHUNK_ELEMENTS) == (
        1 << 23,
        1 << 19,
        1 << 18,
    )
    assert det.CHUNK_ELEMENTS == 1 << 25
    cpu = torch.device("cpu")
    for elements in (1, 1 << 18, 1 << 25):
        assert devices.chunk_elements(cpu, elements, 1 << 20) == elements
    assert devices.chunk_rows(cpu, 1000, 1 << 18, 128) == 262  # the bridge's rows at K = 1000
    assert dfvi.predict_chunk_rows(10, 1000, cpu) == (1 << 23) // (10 * 1000)
    acc = CurvatureAccumulator(torch.zeros(10, 33), "kron", batch_size=1024)
    assert acc.batch_size == 1024


def test_cuda_budget_is_a_fraction_of_total_memory_capped_and_floored(monkeypatch):
    with emulated_cuda():
        assert devices.cuda_chunk_bytes("cuda") == BUDGET
        assert devices.chunk_elements("cuda", 1 << 18, 128) == BUDGET // 128
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 8 << 30))
        assert devices.cuda_chunk_bytes("cuda") == 512 << 20  # 8 GiB / 16
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 256 << 20))
        assert devices.cuda_chunk_bytes("cuda") == devices.CUDA_CHUNK_MIN_BYTES


def test_bridge_of_10000_inputs_at_k1000_is_one_chunk_on_cuda(monkeypatch):
    calls = []

    def spy(mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        calls.append(mu.shape)
        return var  # the shapes are what is checked here, not the maths

    monkeypatch.setattr(links.dirichlet, "bridge_alpha", spy)
    lg = _lg(10_000, 1000)
    links.bridge(lg)
    assert len(calls) == math.ceil(10_000 / 262)  # the CPU's cache-sized chunks
    calls.clear()
    with emulated_cuda() as stats:
        links.bridge(_on_cuda(lg))
    assert calls == [(10_000, 1000)] and stats.host_reads == 0, stats.report()


@pytest.mark.parametrize("correction", ["zero-sum", "none"])
def test_bridge_on_cuda_in_one_chunk_equals_cpu_chunks(correction):
    # rows are independent, so only the evaluation of α differs: on the host the direct form
    # e^t/Σ, on a GPU both forms merged; the same float64 ops on each element, so α agrees to a few
    # ulps of exp (its argument |t| ≲ 700 carries 700 ulps of absolute rounding: rtol 1e-12)
    lg = _lg(3000, 1000, seed=1)
    cpu = links.bridge(lg, correction)
    with emulated_cuda():
        gpu = links.bridge(_on_cuda(lg), correction).cpu()
    assert_close(gpu, cpu, rtol=1e-12, what=f"bridge α on cuda, {correction}")


def test_monte_carlo_chunks_on_cuda_are_the_budget_and_equal_the_cpu_with_those_chunks(monkeypatch):
    n, k, m = 600, 100, 1000
    rows = BUDGET // (links.MC_BUFFERS * 4 * m * k)  # 2,684 inputs: one chunk
    lg = _lg(n, k, seed=2)
    drawn = []
    real = links._draws

    def spy(lg: LogitGaussian, eps: torch.Tensor, sl: slice) -> torch.Tensor:
        drawn.append(len(eps))
        return real(lg, eps, sl)

    monkeypatch.setattr(links, "_draws", spy)
    with emulated_cuda() as stats:
        gpu = links.monte_carlo(_on_cuda(lg), m, torch.Generator().manual_seed(0))
        gpu = [t.cpu() for t in (gpu.probs, gpu.std, gpu.expected_entropy)]
    assert drawn == [min(rows, n)] and stats.host_reads == 3, stats.report()
    # the CPU with the CPU's chunks (3 inputs each) draws the same normals in other blocks; with
    # the GPU's chunk it draws the same ones: then the same float32 ops per element (the softmax's
    # reductions over K may block differently: a few float32 ulps of the probabilities)
    drawn.clear()
    links.monte_carlo(lg, m, torch.Generator().manual_seed(0))
    assert len(drawn) == math.ceil(n / (links.MC_CHUNK_ELEMENTS // (m * k)))
    monkeypatch.setattr(links, "MC_CHUNK_ELEMENTS", rows * m * k)
    cpu = links.monte_carlo(lg, m, torch.Generator().manual_seed(0))
    for name, a, b in zip(
        ("probs", "std", "entropy"), gpu, (cpu.probs, cpu.std, cpu.expected_entropy), strict=True
    ):
        assert_close(a, b, rtol=1e-5, atol=1e-7, what=f"MC {name} on cuda")


def test_sigmoid_quadrature_on_cuda_in_one_chunk_equals_cpu_chunks(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    mean = 5 * torch.randn(400, 50, generator=gen, dtype=torch.float64)
    var = 4 * torch.rand(400, 50, generator=gen, dtype=torch.float64)
    monkeypatch.setattr(sl, "QUADRATURE_CHUNK", 700)  # 29 chunks on the CPU
    cpu = sl.sigmoid_gaussian_moments(mean, var)
    assert devices.chunk_elements(torch.device("cuda"), 700, sl.QUADRATURE_LABEL_BYTES) > 0  # no GPU needed
    with emulated_cuda() as stats:
        gpu = [t.cpu() for t in sl.sigmoid_gaussian_moments(mean.to("cuda"), var.to("cuda"))]
    assert stats.host_reads == 3, stats.report()  # the three results, nothing per chunk
    # elementwise float64 maths and 64-term dot products per label: ≤ 64 ulps of values ≤ 1
    for name, a, b in zip(("m", "1 - m", "v"), gpu, cpu, strict=True):
        assert_close(a, b, atol=64 * 2**-52, what=f"quadrature {name} on cuda")


def _minka_problem(n: int = 300, k: int = 20, m: int = 8) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(4)
    scale = torch.logspace(-1, 1.5, n, dtype=torch.float64)[:, None, None]
    probs = (scale * torch.randn(n, 1, k, generator=gen, dtype=torch.float64)).expand(n, m, k)
    probs = (probs + torch.randn(n, m, k, generator=gen, dtype=torch.float64)).softmax(-1).transpose(0, 1)
    a_bar = probs.mean(0)
    a_bar = a_bar / a_bar.sum(-1, keepdim=True)
    return a_bar, probs.log().mean(0), m


def test_minka_masked_on_cuda_equals_the_gathered_cpu_loop(monkeypatch):
    monkeypatch.setattr(dirichlet, "MINKA_STEPS_PER_READ", 2)  # several read blocks
    a_bar, a_log, m = _minka_problem()
    k, tol = a_bar.shape[1], 1e-10
    z_cpu, it_cpu = dirichlet.fit_precision(a_bar, a_log, m, k, 1e6, tol=tol)
    assert 2 < it_cpu < 100  # several blocks, each row converged
    with emulated_cuda() as stats:
        z_gpu, it_gpu = dirichlet.fit_precision(a_bar.to("cuda"), a_log.to("cuda"), m, k, 1e6, tol=tol)
        z_gpu = z_gpu.cpu()
    # every row takes the gathered loop's steps; the sums over K of a gathered row may round
    # differently in the last bit, which can move a row's stop by one step: |Δz| ≤ tol·z, and a
    # converged Newton iterate is within a few ulps of the root
    assert abs(it_gpu - it_cpu) <= 1
    assert_close(z_gpu, z_cpu, rtol=1e-12, what="Minka z on cuda")
    # one read before each block of steps and one for the slowest row's count: not one a step
    in_minka = [e for e in stats.events if "_minka_iterate_masked" in e]
    assert len(in_minka) == math.ceil(it_gpu / 2) + 2, "\n".join(in_minka)


def test_vectorised_minka_on_cuda_reads_once_when_no_row_straggles():
    a_bar, a_log, m = _minka_problem(k=1000)
    k = a_bar.shape[1]
    z_cpu, _ = dirichlet.fit_precision_vectorised(a_bar, a_bar.log(), a_log, m, k, 1e6)
    with emulated_cuda() as stats:
        a = a_bar.to("cuda")
        z_gpu, it = dirichlet.fit_precision_vectorised(a, a.log(), a_log.to("cuda"), m, k, 1e6)
        z_gpu = z_gpu.cpu()
    assert_close(z_gpu, z_cpu, rtol=1e-5, what="vectorised Minka z on cuda")
    reads = [e for e in stats.report().splitlines() if "bayescli/dirichlet.py" in e]
    assert len(reads) <= 2 + 2 * math.ceil(it / dirichlet.MINKA_STEPS_PER_READ), "\n".join(reads)


def test_dirichlet_fvi_predictive_on_cuda_in_one_chunk_equals_cpu_chunks(monkeypatch):
    k, d, members, n = 50, 16, 4, 300
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(k, d, generator=gen) + 0.3 * torch.randn(members, k, d, generator=gen)
    params = {"weight": w, "bias": torch.zeros(members, k)}
    post = dfvi.DirichletFVIPosterior("ensemble", Subset.LAST_LAYER, params, torch.ones(k), members, 5000,
                                      0.01, 0.0, 0)  # fmt: skip
    phi = torch.randn(n, d, generator=gen).relu()
    calls = []
    real = dfvi.ensemble_member_logits

    def spy(params: dict, phi: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        calls.append(len(phi))
        return real(params, phi, buffer)

    monkeypatch.setattr(dfvi, "ensemble_member_logits", spy)
    with emulated_cuda():
        gpu = post.alpha_features(phi.to("cuda")).cpu()
    assert calls == [n]  # one chunk: the budget holds 10⁷ inputs of 4 × 50
    calls.clear()
    monkeypatch.setattr(dfvi, "MEMBER_CHUNK_ELEMENTS", 40 * k)
    monkeypatch.setattr(dfvi, "MINKA_CHUNK_ELEMENTS", 17 * k)
    cpu = post.alpha_features(phi)
    assert len(calls) == math.ceil(n / 40)
    # float32 member GEMMs of other shapes round the logits differently (~1e-7 relative), and
    # Minka's vectorised steps stop at ~1e-8: α agrees to 1e-5 relative
    assert_close(gpu, cpu, rtol=1e-5, what="Dirichlet fVI α on cuda")


def test_mahalanobis_on_cuda_in_one_chunk_equals_cpu_chunks(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    phi, labels = torch.randn(500, 12, generator=gen), torch.randint(0, 4, (500,), generator=gen)
    test = 3 * torch.randn(70, 12, generator=gen)
    monkeypatch.setattr(det, "CHUNK_ELEMENTS", 7 * 12)  # 7-row chunks on the CPU
    cpu = det.Mahalanobis.fit(phi, labels, 4).score(test)
    assert det._rows(24, torch.device("cpu")) == 3
    with emulated_cuda():
        assert det._rows(24, torch.device("cuda")) == BUDGET // (det.CHUNK_BYTES * 24)
        gpu = det.Mahalanobis.fit(phi.to("cuda"), labels.to("cuda"), 4).score(test.to("cuda")).cpu()
    # float64 scatter sums of 500 terms in other groupings: ~500 ulps relative
    assert_close(gpu, cpu, rtol=1e-12, what="Mahalanobis score on cuda")


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_curvature_on_cuda_in_one_chunk_equals_cpu_chunks(structure):
    gen = torch.Generator().manual_seed(7)
    k, d1, n = 6, 9, 2500
    w = torch.randn(k, d1, generator=gen)
    phi, labels = torch.randn(n, d1, generator=gen), torch.randint(0, k, (n,), generator=gen)
    cpu_acc = CurvatureAccumulator(w, structure, batch_size=256)
    for start in range(0, n, 100):
        cpu_acc.update(phi[start : start + 100], labels[start : start + 100])
    cpu = cpu_acc.finish()
    with emulated_cuda():
        acc = CurvatureAccumulator(w.to("cuda"), structure, batch_size=256)
        assert acc.batch_size == BUDGET // curvature_row_bytes(k, d1, acc.structure)
        for start in range(0, n, 100):
            acc.update(phi[start : start + 100].to("cuda"), labels[start : start + 100].to("cuda"))
        gpu = acc.finish()
        gpu_totals = [t.cpu() for t in (gpu.diag, *(gpu.kron or ()), gpu.full) if t is not None]
    cpu_totals = [t for t in (cpu.diag, *(cpu.kron or ()), cpu.full) if t is not None]
    for a, b in zip(gpu_totals, cpu_totals, strict=True):
        # float64 sums of 2,500 terms grouped into 1 vs 10 chunks: ≤ 2,500 ulps of the largest
        scale = float(b.abs().max())
        assert_close(a, b, atol=n * 2**-52 * scale, what=f"{structure} curvature on cuda")
