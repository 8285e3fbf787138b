import pytest
import torch
from conftest import random_head
from oracles import autograd_jacobian, explicit_ggn, explicit_jacobian_head
from tolerance import assert_below

from bayescli.errors import BayescliError
from bayescli.posterior.curvature import last_layer_curvature
from bayescli.posterior.gaussian import augment
from bayescli.posterior.laplace import head_parameters
from bayescli.posterior.network_curvature import all_layer_curvature

N, D, K = 300, 6, 4


@pytest.fixture
def problem():
    gen = torch.Generator().manual_seed(0)
    phi = torch.randn(N, D, generator=gen, dtype=torch.float64)
    head = random_head(D, K)
    w = head_parameters(head)
    phi_aug = augment(phi)
    probs = (phi_aug @ w.T).softmax(-1)
    labels = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return phi_aug, w, probs, labels


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# Everything is float64 and a sum of N = 300 well-scaled terms (|φ̃| ≲ 4, Λ entries ≤ 1/4):
# rounding gives a relative error ≲ N·eps ≈ 7e-14. F64_SUM = 1e-10 leaves a margin above 1000×;
# the looser bounds below are kept where an engine (BackPACK) reorders the sums in its own way.
F64_SUM = 1e-10


@pytest.mark.parametrize("backend", ["closed-form", "backpack"])
def test_exact_ggn_diag_and_kflr_match_closed_form_oracle(problem, backend):
    phi_aug, w, probs, _ = problem
    diag = last_layer_curvature(phi_aug, w, None, "diag", "ggn", backend, batch_size=64).diag
    lam_diag = probs - probs**2
    assert_below(rel(diag, lam_diag.T @ phi_aug**2), F64_SUM, what=f"diag GGN ({backend})")
    G, A = last_layer_curvature(phi_aug, w, None, "kron", "ggn", backend, batch_size=64).kron
    lam = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    assert_below(rel(G, lam.sum(0)), F64_SUM, what=f"KFLR G ({backend})")
    assert_below(rel(A, phi_aug.T @ phi_aug / N), F64_SUM, what=f"KFLR A ({backend})")


def test_full_ggn_equals_explicit_jacobian_ggn(problem):
    phi_aug, w, probs, _ = problem
    full = last_layer_curvature(phi_aug, w, None, "full", "ggn", batch_size=64).full
    oracle = explicit_ggn(explicit_jacobian_head(phi_aug, K), probs)
    assert_below(rel(full, oracle), F64_SUM, what="full GGN vs explicit Jacobians")
    # the diagonal structure is the diagonal of the exact GGN
    diag = last_layer_curvature(phi_aug, w, None, "diag", "ggn").diag
    assert_below(rel(diag.reshape(-1), oracle.diagonal()), F64_SUM, what="diag GGN vs explicit diagonal")


def test_empirical_fisher_matches_per_sample_gradients(problem):
    phi_aug, w, probs, labels = problem
    grads = []
    for x, y in zip(phi_aug, labels, strict=True):
        wr = w.clone().requires_grad_(True)
        torch.nn.functional.cross_entropy((x @ wr.T)[None], y[None]).backward()
        grads.append(wr.grad.reshape(-1))
    grads = torch.stack(grads)
    full = last_layer_curvature(phi_aug, w, labels, "full", "ef").full
    assert_below(rel(full, grads.T @ grads), F64_SUM, what="full EF vs per-sample gradients")
    diag = last_layer_curvature(phi_aug, w, labels, "diag", "ef", "backpack").diag
    assert_below(rel(diag.reshape(-1), (grads**2).sum(0)), F64_SUM, what="diag EF (backpack)")


@pytest.mark.parametrize("backend", ["closed-form", "backpack"])
def test_mc_curvature_matches_exact_in_expectation(problem, backend):
    phi_aug, w, _, _ = problem
    exact = last_layer_curvature(phi_aug, w, None, "kron", "ggn").kron[0]
    runs = [
        last_layer_curvature(phi_aug, w, None, "kron", "ggn-mc", backend, seed=s).kron[0] for s in range(40)
    ]
    mean = torch.stack(runs).mean(0)
    single = rel(runs[0], exact)
    # one MC label per input: single runs are off by 0.06–0.23 (RMS ≈ 0.13), so the mean of 40
    # seeded runs by ≈ 0.13/√40 ≈ 0.02; 0.05 is 2.5 such standard errors (a statistical bound:
    # the labels are seeded, so the observed error is the same on every CPU)
    assert_below(rel(mean, exact), 0.05, what="mean of 40 MC curvatures")
    assert single > 0.05  # and a single run is measurably noisy (the test can tell them apart)
    diag_exact = last_layer_curvature(phi_aug, w, None, "diag", "ggn").diag
    diag_mc = torch.stack(
        [last_layer_curvature(phi_aug, w, None, "diag", "ggn-mc", backend, seed=s).diag for s in range(40)]
    ).mean(0)
    assert_below(rel(diag_mc, diag_exact), 0.05, what="mean of 40 MC diagonals")


def test_mc_curvature_is_seeded(problem):
    phi_aug, w, _, _ = problem
    a = last_layer_curvature(phi_aug, w, None, "diag", "ggn-mc", seed=3).diag
    b = last_layer_curvature(phi_aug, w, None, "diag", "ggn-mc", seed=3).diag
    assert torch.equal(a, b)


def test_full_structure_refuses_big_heads():
    w = torch.zeros(10, 2501)
    with pytest.raises(BayescliError, match="kron"):
        last_layer_curvature(torch.zeros(3, 2501), w, None, "full")


def tiny_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def test_all_layer_diag_and_full_match_explicit_ggn():
    net = tiny_mlp()
    x = torch.randn(40, 5, dtype=torch.float64)
    jac = autograd_jacobian(net, x)
    oracle = explicit_ggn(jac, net(x).softmax(-1).detach())
    batches = [(x[:25], None), (x[25:], None)]
    full = all_layer_curvature(net, iter(batches), "full", "ggn").full
    # float64 over 40 inputs and 66 parameters; autograd and BackPACK order the sums differently
    assert_below(rel(full, oracle), F64_SUM, what="all-layer full GGN")
    diag = all_layer_curvature(net, iter(batches), "diag", "ggn").diag
    assert_below(rel(diag, oracle.diagonal()), F64_SUM, what="all-layer diag GGN")


def test_all_layer_kron_is_refused_with_advice():
    with pytest.raises(BayescliError, match="hessian='diag'"):
        all_layer_curvature(tiny_mlp(), iter([]), "kron")


class _Concat(torch.nn.Module):
    """Two branches joined by ``torch.cat`` (as SqueezeNet's Fire modules): BackPACK cannot convert it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = torch.nn.Linear(5, 3), torch.nn.Linear(5, 4), torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(torch.cat([self.a(x), self.b(x)], dim=1)))


def test_all_layer_diag_falls_back_to_jacobians_where_backpack_cannot_convert(monkeypatch):
    from bayescli.posterior import network_curvature as curvature

    net = _Concat().double()
    x = torch.randn(40, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(2))
    jac = autograd_jacobian(net, x)
    probs = net(x).softmax(-1).detach()
    # small chunks: the fallback must sum over several Jacobian chunks per batch
    monkeypatch.setattr(curvature, "_JACOBIAN_FLOATS", 3 * 3 * sum(p.numel() for p in net.parameters()))
    batches = [(x[:25], y[:25]), (x[25:], y[25:])]
    diag = all_layer_curvature(net, iter(batches), "diag", "ggn")
    assert diag.n_data == 40
    assert_below(rel(diag.diag, explicit_ggn(jac, probs).diagonal()), F64_SUM, what="fallback diag GGN")
    ef = all_layer_curvature(net, iter(batches), "diag", "ef").diag
    grads = torch.einsum("nk,nkp->np", probs - torch.nn.functional.one_hot(y, 3).double(), jac)
    assert_below(rel(ef, grads.square().sum(0)), F64_SUM, what="fallback diag EF")
    # on a network BackPACK converts, the fallback gives BackPACK's diagonal
    mlp = tiny_mlp()
    backpack = all_layer_curvature(mlp, iter(batches), "diag", "ggn").diag
    gen = torch.Generator().manual_seed(0)
    fallback = curvature._all_layer_diag_jacobian(mlp, iter(batches), curvature.CurvatureType.GGN, gen).diag
    assert_below(rel(fallback, backpack), F64_SUM, what="fallback vs BackPACK diag GGN")
