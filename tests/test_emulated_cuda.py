"""The CUDA emulation used to check device discipline on CPU-only machines (tests/emulated_cuda.py).

Every test compares numbers against the same computation on plain CPU tensors: the emulation is
only useful if it gives the CPU run's numbers while behaving like a GPU (mixed devices raise,
host transfers are counted).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from emulated_cuda import (
    CUDA0,
    EmulatedCudaTensor,
    TransferStats,
    cpu_generator,
    current_stats,
    emulated,
    emulated_cuda,
    is_emulated,
    machine_without_gpu,
)

from bayescli import devices

DEVICE_SPECS = ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0)]


def same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """``actual`` (emulated) holds exactly ``expected`` (plain CPU): same kernels, same bits."""
    assert is_emulated(actual), type(actual)
    assert actual.device == CUDA0
    host = actual.detach().cpu()
    assert type(host) is torch.Tensor
    torch.testing.assert_close(host, expected, rtol=0, atol=0)


def _seeded(fn, seed: int = 0):
    torch.manual_seed(seed)
    return fn()


# ---------------------------------------------------------------------------------------------
# Factories
# ---------------------------------------------------------------------------------------------

FACTORIES = {
    "zeros": lambda d: torch.zeros(2, 3, device=d),
    "ones": lambda d: torch.ones(4, dtype=torch.float64, device=d),
    "empty": lambda d: torch.empty(2, 2, device=d).fill_(3.0),
    "full": lambda d: torch.full((2, 2), 7.5, device=d),
    "arange": lambda d: torch.arange(1, 10, 2, device=d),
    "linspace": lambda d: torch.linspace(-1, 1, 5, device=d),
    "logspace": lambda d: torch.logspace(0, 2, 3, device=d),
    "eye": lambda d: torch.eye(3, device=d),
    "tensor": lambda d: torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=d),
    "as_tensor": lambda d: torch.as_tensor(np.arange(6.0).reshape(2, 3), device=d),
    "scalar": lambda d: torch.tensor(2.5, device=d),
    "randn": lambda d: _seeded(lambda: torch.randn(3, 4, device=d)),
    "rand": lambda d: _seeded(lambda: torch.rand(5, device=d)),
    "randint": lambda d: _seeded(lambda: torch.randint(0, 10, (6,), device=d)),
    "randperm": lambda d: _seeded(lambda: torch.randperm(7, device=d)),
    "zeros_like": lambda d: torch.zeros_like(torch.ones(2, 3), device=d),
    "full_like": lambda d: torch.full_like(torch.ones(3), 4.0, device=d),
}


@pytest.mark.parametrize("spec", DEVICE_SPECS, ids=str)
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_factory_on_cuda_gives_emulated_tensor_with_cpu_values(name, spec):
    expected = FACTORIES[name]("cpu")
    with emulated_cuda():
        t = FACTORIES[name](spec)
        assert t.device.type == "cuda" and t.is_cuda and t.device == CUDA0
        assert t.get_device() == 0 and not t.is_cpu
        same(t, expected)


def test_like_factories_follow_an_emulated_input():
    base = torch.arange(6.0).reshape(2, 3)
    with emulated_cuda():
        x = base.to("cuda")
        same(torch.zeros_like(x), torch.zeros(2, 3))
        same(torch.ones_like(x), torch.ones(2, 3))
        same(torch.full_like(x, 2.0), torch.full((2, 3), 2.0))
        same(torch.empty_like(x).fill_(1.0), torch.ones(2, 3))
        same(_seeded(lambda: torch.rand_like(x)), _seeded(lambda: torch.rand(2, 3)))
        same(x.new_zeros(4), torch.zeros(4))
        same(x.new_tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
        same(x.new_full((2,), 3.0), torch.full((2,), 3.0))
        host = torch.zeros_like(x, device="cpu")
        assert type(host) is torch.Tensor and torch.equal(host, torch.zeros(2, 3))


def test_requires_grad_factory_is_a_leaf_on_the_device():
    with emulated_cuda():
        t = torch.tensor([1.0, 2.0, 3.0], device="cuda", requires_grad=True)
        assert t.is_leaf and t.requires_grad
        (t * t).sum().backward()
        same(t.grad, torch.tensor([2.0, 4.0, 6.0]))


# ---------------------------------------------------------------------------------------------
# Device discipline
# ---------------------------------------------------------------------------------------------


def test_arithmetic_equals_cpu():
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    expected = torch.tanh(a @ b * 2 - 1).exp().sum(0) / 3
    with emulated_cuda() as stats:
        ga, gb = a.to("cuda"), b.cuda()
        out = torch.tanh(ga @ gb * 2 - 1).exp().sum(0) / 3
        same(out, expected)
    assert stats.h2d == 2 and stats.h2d_bytes == a.nbytes + b.nbytes
    assert stats.d2h == 1 and stats.d2h_bytes == expected.nbytes  # the .cpu() in same()


@pytest.mark.parametrize(
    "op",
    [
        lambda g, c: g + c,
        lambda g, c: c + g,  # the host tensor first
        lambda g, c: torch.mul(c, g),
        lambda g, c: torch.cat([c, g]),
        lambda g, c: torch.stack([g, c]),
        lambda g, c: torch.where(g > 0, c, g),
        lambda g, c: torch.dot(c, g),
        lambda g, c: g.index_add(0, torch.tensor([0, 1, 2]), c),
        lambda g, c: torch.add(g, g, out=c),
        lambda g, c: c.add_(g),
        lambda g, c: F.mse_loss(g, c),
    ],
)
def test_mixing_a_host_tensor_raises_like_cuda(op):
    with emulated_cuda(), pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        op(torch.ones(3, device="cuda"), torch.ones(3))


def test_cross_entropy_with_host_targets_raises_and_device_targets_match():
    logits, target = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    expected = F.cross_entropy(logits, target)
    with emulated_cuda():
        g = logits.to("cuda")
        with pytest.raises(RuntimeError, match=r"cuda:0 and cpu.*nll_loss"):
            F.cross_entropy(g, target)
        same(F.cross_entropy(g, target.to("cuda")), expected)


def test_zero_dim_host_tensor_mixes_like_a_scalar():
    x, s = torch.arange(4.0), torch.tensor(2.5)
    with emulated_cuda() as stats:
        g = x.to("cuda")
        same(g * s, x * s)
        same(s + g, s + x)
        same(g.add_(torch.tensor(1.0)), x + 1)
    assert stats.syncs == 0
    with emulated_cuda(), pytest.raises(RuntimeError, match="same device"):
        torch.tensor(0.0).add_(torch.ones((), device="cuda"))  # but never as an output


# ---------------------------------------------------------------------------------------------
# Host transfers
# ---------------------------------------------------------------------------------------------


def test_scalar_reads_count_syncs():
    x = torch.tensor([1.5, -2.0, 3.0])
    with emulated_cuda() as stats:
        g = x.to("cuda")
        assert g.sum().item() == x.sum().item()
        assert float(g.max()) == 3.0
        assert int(g.argmax()) == 2
        assert bool((g < 0).any()) is True
        assert f"{g.mean():.4f}" == f"{x.mean().item():.4f}"
        assert torch.equal(g, g) is True
    assert stats.syncs == 6
    assert stats.d2h == 0 and stats.h2d == 1
    assert all(e.startswith(("sync", "h2d")) for e in stats.events)


def test_copies_to_the_host_are_counted_and_plain():
    x = torch.arange(12.0).reshape(3, 4)
    with emulated_cuda() as stats:
        g = x.to("cuda")
        assert stats.h2d == 1 and stats.d2h == 0
        for host in (g.cpu(), g.to("cpu"), g.to(torch.device("cpu"), torch.float64), g.to(torch.ones(1))):
            assert type(host) is torch.Tensor and host.device.type == "cpu"
            torch.testing.assert_close(host, x.to(host.dtype), rtol=0, atol=0)
        assert stats.d2h == 4 and stats.d2h_bytes == 3 * x.nbytes + 2 * x.nbytes
        assert g.tolist() == x.tolist()
        out = torch.empty(3, 4)
        out.copy_(g)
        assert torch.equal(out, x)
        assert stats.d2h == 6
        g.copy_(torch.zeros(3, 4))  # host→device
        same(g, torch.zeros(3, 4))
    assert stats.h2d == 2 and stats.syncs == 0


def test_constructors_from_host_data_upload_once_and_device_scalars_sync():
    data = [[1.0, 2.0], [3.0, 4.0]]
    with emulated_cuda() as stats:
        t = torch.tensor(data, device="cuda", dtype=torch.float64)
        assert stats.h2d == 1 and stats.h2d_bytes == 4 * 8
        a = torch.as_tensor(np.arange(3), device="cuda")
        n = t.new_tensor([5.0])
        assert stats.h2d == 3 and stats.d2h == 0
        same(t, torch.tensor(data, dtype=torch.float64))
        same(a, torch.arange(3))
        same(n, torch.tensor([5.0], dtype=torch.float64))
        assert torch.as_tensor(t) is t and is_emulated(torch.tensor(t))
        host = torch.tensor([t.sum(), t.max()])  # Python data holding device scalars: a read each
        assert type(host) is torch.Tensor and host.tolist() == [10.0, 4.0]
        assert stats.syncs == 2
        pinned = torch.ones(2).pin_memory()
        assert type(pinned) is torch.Tensor and torch.equal(pinned, torch.ones(2))
        with pytest.raises(RuntimeError, match="cannot pin"):
            t.pin_memory()


def test_numpy_of_an_emulated_tensor_raises_like_cuda():
    with emulated_cuda() as stats:
        g = torch.ones(3, device="cuda")
        with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
            g.numpy()
        with pytest.raises(TypeError, match="Use Tensor.cpu"):
            np.asarray(g)
        assert stats.d2h == 0
        np.testing.assert_array_equal(g.cpu().numpy(), np.ones(3, dtype=np.float32))
        np.testing.assert_array_equal(g.numpy(force=True), np.ones(3, dtype=np.float32))
    assert stats.d2h == 2


def test_printing_shows_the_device_and_counts_a_copy():
    with emulated_cuda() as stats:
        g = torch.tensor([1.0, 2.0], device="cuda")
        assert repr(g) == "tensor([1., 2.], device='cuda:0')"
        p = torch.nn.Parameter(torch.zeros(1)).to("cuda")
        assert "device='cuda:0'" in str(p)
        r = torch.arange(3.0, device="cuda").requires_grad_()
        assert repr(r) == "tensor([0., 1., 2.], device='cuda:0', requires_grad=True)"
        assert repr(r * 2) == "tensor([0., 2., 4.], device='cuda:0', grad_fn=<MulBackward0>)"
        assert repr(r.detach().double()) == "tensor([0., 1., 2.], device='cuda:0', dtype=torch.float64)"
        assert repr(torch.zeros(0, 2, device="cuda")) == "tensor([], device='cuda:0', size=(0, 2))"
    assert stats.d2h == 6


def test_events_name_the_bayescli_frame_and_reset_clears():
    outer = current_stats()  # None, or an emulated-GPU session's (make test-gpu)
    with emulated_cuda() as stats:
        g = torch.ones(2, device="cuda")
        devices.synchronize(g.device)
        g.sum().item()
        assert stats.synchronize == 1 and stats.syncs == 1
        assert any(e.startswith("synchronize") and "bayescli/devices.py" in e for e in stats.events), (
            stats.events
        )
        assert any(e.startswith("sync") and "test_emulated_cuda.py" in e for e in stats.events), stats.events
        assert current_stats() is stats
        assert "sync aten._local_scalar_dense" in stats.report()
        stats.reset()
        assert stats == TransferStats()
    assert current_stats() is outer


def test_list_indexing_uploads_the_index():
    x = torch.arange(15.0).reshape(5, 3)
    with emulated_cuda() as stats:
        g = x.to("cuda")
        stats.reset()
        same(g[[0, 2]], x[[0, 2]])
        same(g[[0, 1], [2, 0]], x[[0, 1], [2, 0]])
        same(g[torch.tensor([4, 1])], x[torch.tensor([4, 1])])
        same(g[1:3, None], x[1:3, None])
        assert stats.h2d == 3 and stats.implicit_syncs == 0
        same(g[g > 6], x[x > 6])  # a device mask: CUDA must read back how many
        assert stats.implicit_syncs == 1
        g[[0, 1]] = [[9.0, 9.0, 9.0], [8.0, 8.0, 8.0]]
        x[[0, 1]] = torch.tensor([[9.0, 9.0, 9.0], [8.0, 8.0, 8.0]])
        same(g, x)


def test_batch_loop_uploads_each_batch_and_reads_nothing_back():
    torch.manual_seed(0)
    batches = [torch.randn(8, 4) for _ in range(5)]
    weight = torch.randn(4, 3)
    expected = sum(torch.softmax(b @ weight, -1).sum(0) for b in batches)
    with emulated_cuda() as stats:
        dev = devices.resolve_device("auto")
        assert dev.type == "cuda"
        w = weight.to(dev)
        total = torch.zeros(3, device=dev)
        stats.reset()
        for b in batches:
            total += torch.softmax(b.to(dev, non_blocking=True) @ w, -1).sum(0)
        assert stats.h2d == len(batches) and stats.h2d_bytes == sum(b.nbytes for b in batches)
        assert stats.d2h == 0 and stats.syncs == 0 and stats.host_reads == 0
        same(total, expected)
        assert stats.d2h == 1


# ---------------------------------------------------------------------------------------------
# Ops: the emulated run gives the CPU run's numbers
# ---------------------------------------------------------------------------------------------


def _spd(n: int = 4) -> torch.Tensor:
    a = torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return a @ a.T + n * torch.eye(n, dtype=torch.float64)


OPS = {
    "eigh": (lambda a: torch.linalg.eigh(a), lambda: (_spd(),)),
    "cholesky_ex": (lambda a: torch.linalg.cholesky_ex(a), lambda: (_spd(),)),
    "solve_triangular": (
        lambda a, b: torch.linalg.solve_triangular(torch.linalg.cholesky_ex(a).L, b, upper=False),
        lambda: (_spd(), torch.arange(8.0, dtype=torch.float64).reshape(4, 2)),
    ),
    "digamma": (torch.special.digamma, lambda: (torch.linspace(0.1, 5, 7),)),
    "lgamma": (torch.lgamma, lambda: (torch.linspace(0.1, 5, 7),)),
    "softmax": (lambda a: torch.softmax(a, -1), lambda: (torch.randn(3, 5),)),
    "log_softmax": (lambda a: F.log_softmax(a, 1), lambda: (torch.randn(3, 5),)),
    "logsumexp": (lambda a: torch.logsumexp(a, 0), lambda: (torch.randn(3, 5),)),
    "einsum": (lambda a, b: torch.einsum("nk,nc->kc", a, b), lambda: (torch.randn(6, 3), torch.randn(6, 2))),
    "index_add": (
        lambda a, i, s: a.index_add(0, i, s),
        lambda: (torch.zeros(4, 2), torch.tensor([0, 3, 0, 1]), torch.randn(4, 2)),
    ),
    "scatter": (
        lambda a, i, s: a.scatter(1, i, s),
        lambda: (torch.zeros(2, 4), torch.tensor([[0, 3], [2, 1]]), torch.randn(2, 2)),
    ),
    "scatter_add": (
        lambda a, i, s: a.scatter_add(0, i, s),
        lambda: (torch.zeros(3), torch.tensor([0, 2, 2, 0]), torch.randn(4)),
    ),
    "sort": (lambda a: torch.sort(a, dim=-1, descending=True), lambda: (torch.randn(3, 6),)),
    "argsort": (lambda a: torch.argsort(a), lambda: (torch.randn(9),)),
    "topk": (lambda a: torch.topk(a, 3), lambda: (torch.randn(9),)),
    "cumsum": (lambda a: torch.cumsum(a, 0), lambda: (torch.randn(7, dtype=torch.float64),)),
    "gather": (lambda a, i: a.gather(1, i), lambda: (torch.randn(3, 4), torch.tensor([[0], [3], [1]]))),
    "one_hot": (lambda i: F.one_hot(i, 4), lambda: (torch.tensor([0, 3, 1]),)),
    "bincount_like": (
        lambda i: i.new_zeros(4).index_add(0, i, torch.ones_like(i)),
        lambda: (torch.tensor([0, 3, 3, 1]),),
    ),
    "matmul_f64": (
        lambda a, b: (a.double() @ b.double()).float(),
        lambda: (torch.randn(3, 4), torch.randn(4, 2)),
    ),
    "clamp_where": (lambda a: torch.where(a > 0, a.clamp(max=0.5), -a), lambda: (torch.randn(10),)),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_equals_cpu_without_host_transfers(name):
    fn, make = OPS[name]
    torch.manual_seed(0)
    inputs = make()
    expected = fn(*inputs)
    with emulated_cuda() as stats:
        gin = [t.to("cuda") for t in inputs]
        stats.reset()
        out = fn(*gin)
        assert stats.host_reads == 0 and stats.h2d == 0, stats.events
        exp_flat, _ = torch.utils._pytree.tree_flatten(
            tuple(expected) if isinstance(expected, tuple) else expected
        )
        out_flat, _ = torch.utils._pytree.tree_flatten(tuple(out) if isinstance(out, tuple) else out)
        assert len(out_flat) == len(exp_flat)
        for o, e in zip(out_flat, exp_flat, strict=True):
            same(o, e)


def test_linalg_cholesky_error_check_is_an_implicit_sync():
    a = _spd()
    with emulated_cuda() as stats:
        same(torch.linalg.cholesky(a.to("cuda")), torch.linalg.cholesky(a))
    assert stats.implicit_syncs == 1 and stats.syncs == 0


# ---------------------------------------------------------------------------------------------
# Random numbers
# ---------------------------------------------------------------------------------------------


def test_draws_with_a_cpu_generator_equal_the_cpu_draws():
    probs = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]])
    cpu = cpu_generator("cpu", 5)
    expected = (
        torch.multinomial(probs, 6, replacement=True, generator=cpu),
        torch.empty(4, 2).normal_(mean=1.0, std=2.0, generator=cpu),
        torch.randn(3, generator=cpu),
        torch.rand(2, 2, dtype=torch.float64, generator=cpu),
    )
    with emulated_cuda() as stats:
        gen = cpu_generator("cuda", 5)
        assert gen.device.type == "cpu"
        p = probs.to("cuda")
        draws = (
            torch.multinomial(p, 6, replacement=True, generator=gen),
            torch.empty(4, 2, device="cuda").normal_(mean=1.0, std=2.0, generator=gen),
            torch.randn(3, generator=gen, device="cuda"),
            torch.rand(2, 2, dtype=torch.float64, generator=gen, device=p.device),
        )
        for d, e in zip(draws, expected, strict=True):
            same(d, e)
    assert stats.syncs == 0


def test_generator_on_cuda_and_devices_generator_give_cpu_streams(monkeypatch):
    expected = torch.randn(4, generator=torch.Generator().manual_seed(3))
    before = torch.Generator  # torch._C.Generator, or an enclosing emulation's factory
    with emulated_cuda():
        g = torch.Generator(device="cuda").manual_seed(3)
        assert isinstance(g, torch.Generator) and g.device.type == "cpu"
        same(torch.randn(4, device="cuda", generator=g), expected)
        same(torch.randn(4, device="cuda", generator=devices.generator("cuda", 3)), expected)
        monkeypatch.setattr(devices, "generator", cpu_generator)
        same(torch.randn(4, device="cuda", generator=devices.generator(CUDA0, 3)), expected)
    assert torch.Generator is before


# ---------------------------------------------------------------------------------------------
# Autograd and modules
# ---------------------------------------------------------------------------------------------


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 5)
    )


@pytest.mark.parametrize(
    "move", [lambda m: m.to("cuda"), lambda m: m.cuda(), lambda m: m.to(torch.device("cuda", 0))]
)
def test_module_on_cuda_forward_backward_equal_cpu(move):
    x, y = (
        torch.randn(7, 1, 6, 6, generator=torch.Generator().manual_seed(2)),
        torch.tensor([0, 1, 2, 3, 4, 0, 1]),
    )
    net = _net()
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    expected = [p.grad.clone() for p in net.parameters()]
    with emulated_cuda() as stats:
        gnet = move(_net())
        for p in gnet.parameters():
            assert isinstance(p, torch.nn.Parameter) and is_emulated(p) and p.requires_grad
        stats.reset()
        gloss = F.cross_entropy(gnet(x.to("cuda")), y.to("cuda"))
        gloss.backward()
        assert stats.host_reads == 0 and stats.h2d == 2, stats.events
        same(gloss.detach(), loss.detach())
        for p, e in zip(gnet.parameters(), expected, strict=True):
            same(p.grad, e)


class _TwoOutputs(torch.autograd.Function):
    """Two outputs, one unused: autograd materialises a zero gradient for the other."""

    @staticmethod
    def forward(ctx, a):
        return a * 2, a * 3

    @staticmethod
    def backward(ctx, g1, g2):
        return g1 * 2 + g2 * 3


# Backward formulas that build fresh tensors "like" the gradient (max/sort/topk scatter into
# zeros, eigh and split fill in unused outputs): those must come out emulated too.
BACKWARD = {
    "max_dim": lambda x: x.max(1).values.sum(),
    "sort_part": lambda x: torch.sort(x, 1).values[:, :2].sum(),
    "topk": lambda x: x.topk(2, 1).values.sum(),
    "median": lambda x: x.median(1).values.sum(),
    "eigh_vectors": lambda x: (
        torch.linalg.eigh(x.T @ x + torch.eye(5, dtype=x.dtype, device=x.device))[1].abs().sum()
    ),
    "split_unused": lambda x: x.split(2, 1)[0].sum(),
    "index_host": lambda x: x[[0, 2]].sum() + x[:, torch.tensor([1, 1])].pow(2).sum(),
    "custom_unused_output": lambda x: _TwoOutputs.apply(x)[0].sum(),
    "logsumexp_lgamma": lambda x: x.logsumexp(1).sum() + torch.lgamma(x.abs() + 1).sum(),
}


@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_backward_formulas_give_emulated_gradients_equal_to_cpu(name):
    fn = BACKWARD[name]
    x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    xc = x.clone().requires_grad_()
    fn(xc).backward()
    with emulated_cuda():
        g = x.to("cuda").requires_grad_()
        fn(g).backward()
        same(g.grad, xc.grad)


def test_fgsm_step_through_the_input_equals_cpu():
    x, y = torch.rand(4, 1, 6, 6, generator=torch.Generator().manual_seed(4)), torch.tensor([1, 0, 3, 2])
    net = _net().eval()
    xc = x.clone().requires_grad_()
    F.cross_entropy(net(xc), y).backward()
    expected = (x + 0.1 * xc.grad.sign()).clamp(0, 1)
    with emulated_cuda() as stats:
        gnet = _net().eval().to("cuda")
        xg = x.to("cuda").requires_grad_()
        F.cross_entropy(gnet(xg), y.to("cuda")).backward()
        adv = (xg + 0.1 * xg.grad.sign()).clamp(0, 1).detach()
        assert stats.host_reads == 0
        same(adv, expected)


def test_autograd_grad_wrt_an_emulated_input():
    x = torch.linspace(-1, 1, 5, dtype=torch.float64)
    expected = torch.autograd.grad((x.requires_grad_().sin() * x).sum(), x)[0]
    with emulated_cuda():
        g = x.detach().to("cuda").requires_grad_()
        (grad,) = torch.autograd.grad((g.sin() * g).sum(), g)
        same(grad, expected)
        # Through a host copy: the gradient comes back to the device (one upload).
        (back,) = torch.autograd.grad((g.cpu() ** 2).sum(), g)
        same(back, 2 * x.detach())


def test_custom_function_and_functional_call_on_the_device():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a * a

        @staticmethod
        def backward(ctx, grad):
            (a,) = ctx.saved_tensors
            return 2 * a * grad

    x = torch.tensor([1.0, -2.0, 3.0])
    lin = torch.nn.Linear(3, 2)
    params = {k: v.detach() * 2 for k, v in lin.named_parameters()}
    expected = torch.func.functional_call(lin, params, (x,))
    with emulated_cuda():
        g = x.to("cuda").requires_grad_()
        Square.apply(g).sum().backward()
        same(g.grad, 2 * x)
        glin = copy.deepcopy(lin).to("cuda")
        gparams = {k: v.to("cuda") for k, v in params.items()}
        same(torch.func.functional_call(glin, gparams, (x.to("cuda"),)), expected)


def test_inference_mode_and_no_grad():
    x = torch.randn(3, 4)
    net = torch.nn.Linear(4, 2)
    expected = net(x).detach()
    with emulated_cuda():
        gnet = copy.deepcopy(net).to("cuda")
        gx = x.to("cuda")
        with torch.inference_mode():
            out = gnet(gx)
            assert torch.is_inference(out) and not out.requires_grad
            same(out, expected)
            assert gx.add_(0) is gx
        with torch.no_grad():
            same(gnet(gx), expected)


def test_views_of_normal_tensors_in_inference_mode():
    # A model's buffers are normal tensors; viewing them inside inference mode (normalisation
    # constants reshaped for broadcasting) gives normal views, as on real devices.
    mean, x = torch.tensor([0.5, 0.25]), torch.randn(3, 2, 4, 4)
    expected = x - mean.view(1, -1, 1, 1)
    with emulated_cuda():
        gmean, gx = mean.to("cuda"), x.to("cuda")
        with torch.inference_mode():
            view = gmean.view(1, -1, 1, 1)
            assert not torch.is_inference(view)
            same(gx - view, expected)


def test_optimizer_steps_equal_cpu():
    x, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(5)), torch.randn(6, 2)

    def train(net, xs, ys):
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(net(xs), ys).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
        return net

    torch.manual_seed(0)
    expected = train(torch.nn.Linear(4, 2), x, y)
    with emulated_cuda():
        torch.manual_seed(0)
        gnet = torch.nn.Linear(4, 2).to("cuda")
        train(gnet, x.to("cuda"), y.to("cuda"))
        same(gnet.weight.detach(), expected.weight.detach())
        same(gnet.bias.detach(), expected.bias.detach())


def test_in_place_ops_views_and_deepcopy():
    x = torch.arange(6.0).reshape(2, 3)
    with emulated_cuda():
        g = x.to("cuda")
        assert g.mul_(2) is g
        view = g[:, 1]
        view.zero_()
        same(g, torch.tensor([[0.0, 0.0, 4.0], [6.0, 0.0, 10.0]]))
        same(g.t().contiguous(), torch.tensor([[0.0, 6.0], [0.0, 0.0], [4.0, 10.0]]))
        twin = copy.deepcopy(g)
        twin.add_(1)
        same(g, torch.tensor([[0.0, 0.0, 4.0], [6.0, 0.0, 10.0]]))
        same(twin, torch.tensor([[1.0, 1.0, 5.0], [7.0, 1.0, 11.0]]))
        with pytest.raises(NotImplementedError, match="shape or strides"):
            torch.ones(2, device="cuda").unsqueeze_(0)


# ---------------------------------------------------------------------------------------------
# torch.cuda stubs
# ---------------------------------------------------------------------------------------------


def test_torch_cuda_is_stubbed_inside_and_restored_after():
    before = torch.cuda.is_available()
    originals = (torch.cuda.is_available, torch.cuda.synchronize, torch.Generator)
    with emulated_cuda() as stats:
        assert torch.cuda.is_available() is True
        assert torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
        assert torch.cuda.get_device_name() == "emulated"
        torch.cuda.set_device(0)
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == 0
        torch.cuda.synchronize()
        torch.cuda.synchronize(CUDA0)
        assert stats.synchronize == 2
        torch.cuda.manual_seed(11)
        a = torch.randn(3, device="cuda")
        torch.manual_seed(11)
        same(a, torch.randn(3))
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.zeros(1, device="cuda:1")
    assert torch.cuda.is_available() == before
    assert (torch.cuda.is_available, torch.cuda.synchronize, torch.Generator) == originals


def test_without_a_gpu_the_stubs_leave_cuda_absent():
    if not machine_without_gpu():
        pytest.skip("asserts a CPU-only machine: a real GPU or an emulated-GPU run makes CUDA available")
    with emulated_cuda():
        assert torch.cuda.is_available()
    assert not torch.cuda.is_available()
    with emulated_cuda(patch_generator=False), pytest.raises(RuntimeError):
        torch.Generator(device="cuda")  # CPU-only: the real generator needs the CUDA runtime


def test_nested_blocks_keep_their_own_stats_even_when_equal():
    with emulated_cuda() as outer:
        with emulated_cuda() as inner:
            assert outer == inner and current_stats() is inner  # equal (empty), not the same
        assert current_stats() is outer
        torch.ones(1, device="cuda").item()
    assert outer.syncs == 1 and inner.syncs == 0


def test_emulated_helper_wraps_without_counting():
    x = torch.arange(3.0)
    with emulated_cuda() as stats:
        g = emulated(x)
        assert isinstance(g, EmulatedCudaTensor) and g.elem is not None
        same(g + 1, x + 1)
    assert stats.h2d == 0 and stats.d2h == 1
