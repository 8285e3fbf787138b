import pytest
import torch
from conftest import random_head
from oracles import autograd_jacobian, explicit_ggn, explicit_jacobian_head

from bayescli.errors import BayescliError
from bayescli.posterior.curvature import all_layer_curvature, last_layer_curvature
from bayescli.posterior.gaussian import augment
from bayescli.posterior.laplace import head_parameters

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


@pytest.mark.parametrize("backend", ["closed-form", "backpack"])
def test_exact_ggn_diag_and_kflr_match_closed_form_oracle(problem, backend):
    phi_aug, w, probs, _ = problem
    diag = last_layer_curvature(phi_aug, w, None, "diag", "ggn", backend, batch_size=64).diag
    lam_diag = probs - probs**2
    assert rel(diag, lam_diag.T @ phi_aug**2) < 1e-5
    G, A = last_layer_curvature(phi_aug, w, None, "kron", "ggn", backend, batch_size=64).kron
    lam = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    assert rel(G, lam.sum(0)) < 1e-5
    assert rel(A, phi_aug.T @ phi_aug / N) < 1e-5


def test_full_ggn_equals_explicit_jacobian_ggn(problem):
    phi_aug, w, probs, _ = problem
    full = last_layer_curvature(phi_aug, w, None, "full", "ggn", batch_size=64).full
    oracle = explicit_ggn(explicit_jacobian_head(phi_aug, K), probs)
    assert rel(full, oracle) < 1e-10
    # the diagonal structure is the diagonal of the exact GGN
    diag = last_layer_curvature(phi_aug, w, None, "diag", "ggn").diag
    assert rel(diag.reshape(-1), oracle.diagonal()) < 1e-10


def test_empirical_fisher_matches_per_sample_gradients(problem):
    phi_aug, w, probs, labels = problem
    grads = []
    for x, y in zip(phi_aug, labels, strict=True):
        wr = w.clone().requires_grad_(True)
        torch.nn.functional.cross_entropy((x @ wr.T)[None], y[None]).backward()
        grads.append(wr.grad.reshape(-1))
    grads = torch.stack(grads)
    full = last_layer_curvature(phi_aug, w, labels, "full", "ef").full
    assert rel(full, grads.T @ grads) < 1e-10
    diag = last_layer_curvature(phi_aug, w, labels, "diag", "ef", "backpack").diag
    assert rel(diag.reshape(-1), (grads**2).sum(0)) < 1e-6


@pytest.mark.parametrize("backend", ["closed-form", "backpack"])
def test_mc_curvature_matches_exact_in_expectation(problem, backend):
    phi_aug, w, _, _ = problem
    exact = last_layer_curvature(phi_aug, w, None, "kron", "ggn").kron[0]
    runs = [
        last_layer_curvature(phi_aug, w, None, "kron", "ggn-mc", backend, seed=s).kron[0] for s in range(40)
    ]
    mean = torch.stack(runs).mean(0)
    single = rel(runs[0], exact)
    assert rel(mean, exact) < 0.05 < single  # one MC label per input is noisy; its mean is not
    diag_exact = last_layer_curvature(phi_aug, w, None, "diag", "ggn").diag
    diag_mc = torch.stack(
        [last_layer_curvature(phi_aug, w, None, "diag", "ggn-mc", backend, seed=s).diag for s in range(40)]
    ).mean(0)
    assert rel(diag_mc, diag_exact) < 0.05


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
    assert rel(full, oracle) < 1e-8
    diag = all_layer_curvature(net, iter(batches), "diag", "ggn").diag
    assert rel(diag, oracle.diagonal()) < 1e-8


def test_all_layer_kron_is_refused_with_advice():
    with pytest.raises(BayescliError, match="--hessian diag"):
        all_layer_curvature(tiny_mlp(), iter([]), "kron")
