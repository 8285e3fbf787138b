import pytest
import torch
from conftest import random_head
from oracles import autograd_jacobian, explicit_jacobian_head

from bayescli.posterior import LaplacePosterior
from bayescli.posterior.gaussian import DiagGaussian, FullGaussian, KronGaussian, augment
from bayescli.posterior.prior import log_marglik

N, D, K = 200, 5, 4


@pytest.fixture
def fitted():
    gen = torch.Generator().manual_seed(1)
    phi = torch.randn(N, D, generator=gen, dtype=torch.float64)
    head = random_head(D, K, seed=1)
    labels = (augment(phi) @ torch.cat([head.weight, head.bias[:, None]], 1).T).detach().argmax(1)
    return phi, head, labels


def explicit_cov(post: LaplacePosterior) -> torch.Tensor:
    """Dense posterior covariance from the structure's definition."""
    g = post.gaussian
    if isinstance(g, DiagGaussian):
        return torch.diag(1 / (g.h.reshape(-1) + g.delta))
    if isinstance(g, KronGaussian):
        prec = torch.kron(g.G, g.A) + g.delta * torch.eye(g.G.shape[0] * g.A.shape[0], dtype=g.G.dtype)
        return torch.linalg.inv(prec)
    return torch.linalg.inv(g.H + g.delta * torch.eye(g.H.shape[0], dtype=g.H.dtype))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_glm_logit_gaussian_equals_brute_force_jacobian(fitted, structure):
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, structure)
    post.set_prior_precision(0.7)
    x = torch.randn(30, D, dtype=torch.float64)
    lg = post.logit_gaussian(x)
    jac = explicit_jacobian_head(augment(x), K)
    cov = jac @ explicit_cov(post) @ jac.transpose(1, 2)
    assert rel(lg.covariance(), cov) < 1e-5
    assert rel(lg.var, cov.diagonal(dim1=1, dim2=2)) < 1e-5
    assert torch.allclose(lg.mean, head(x), atol=1e-10)
    v = torch.randn(30, K, dtype=torch.float64)
    assert rel(lg.cov_matvec(v), torch.einsum("nkl,nl->nk", cov, v)) < 1e-5


def test_kron_pushforward_never_needs_dense_covariance(fitted):
    phi, head, labels = fitted
    lg = LaplacePosterior.fit_last_layer(phi, labels, head, "kron").logit_gaussian(phi)
    assert lg.kind == "eig" and lg.cov is None and lg.spectrum.shape == (N, K)


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_all_layer_glm_equals_explicit_jacobian(structure):
    from bayescli.models import Classifier

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    clf = Classifier(net, "2").double()
    x = torch.randn(50, 5, dtype=torch.float64)
    y = net(x).argmax(1)
    post = LaplacePosterior.fit_all_layers(clf, [(x, y)], structure)
    post.set_prior_precision(2.0)
    xt = torch.randn(7, 5, dtype=torch.float64)
    lg = post.logit_gaussian_inputs(clf, xt)
    jac = autograd_jacobian(net, xt)
    g = post.gaussian
    sigma = (
        torch.diag(1 / (g.h + 2.0))
        if structure == "diag"
        else torch.linalg.inv(g.H + 2.0 * torch.eye(g.H.shape[0], dtype=torch.float64))
    )
    assert rel(lg.covariance(), jac @ sigma @ jac.transpose(1, 2)) < 1e-6


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_weight_samples_have_the_posterior_covariance(fitted, structure):
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, structure)
    post.set_prior_precision(5.0)
    draws = post.gaussian.sample(40_000, torch.Generator().manual_seed(0))
    cov = explicit_cov(post)
    emp = torch.cov(draws.T)
    assert (emp - cov).abs().max() < 0.05 * cov.diagonal().max()
    assert (draws.mean(0) - post.gaussian.mean.reshape(-1)).abs().max() < 0.05 * cov.diagonal().max().sqrt()


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_marglik_auto_finds_grid_maximiser(fitted, structure):
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, structure)
    delta = post.optimise_prior_marglik()
    grid = torch.logspace(-4, 4, 20001, dtype=torch.float64)
    values = log_marglik(post.gaussian, post.log_likelihood, grid)
    best = grid[values.argmax()].item()
    assert delta == pytest.approx(best, rel=2e-3)
    assert post.log_marglik() >= values.max().item() - 1e-6
    assert post.meta["prior"]["method"] == "marglik" and len(post.meta["prior"]["curve"]) > 10


def test_log_det_matches_dense_determinant(fitted):
    phi, head, labels = fitted
    for structure in ("diag", "kron", "full"):
        post = LaplacePosterior.fit_last_layer(phi, labels, head, structure)
        dense = torch.linalg.inv(explicit_cov(post))  # prior precision 1 after fitting
        assert post.gaussian.log_det_precision(1.0).item() == pytest.approx(
            torch.logdet(dense).item(), rel=1e-8
        )


def test_save_load_reproduces_predictions_exactly(fitted, tmp_path):
    phi, head, labels = fitted
    for structure in ("diag", "kron", "full"):
        post = LaplacePosterior.fit_last_layer(phi, labels, head, structure)
        post.optimise_prior_marglik()
        post.save(tmp_path / f"{structure}.safetensors")
        again = LaplacePosterior.load(tmp_path / f"{structure}.safetensors")
        a, b = post.logit_gaussian(phi), again.logit_gaussian(phi)
        assert torch.equal(a.mean, b.mean) and torch.equal(a.var, b.var)
        assert again.prior_precision == post.prior_precision and again.structure == structure


def test_gaussian_constructors_check_shapes():
    with pytest.raises(ValueError):
        KronGaussian(torch.zeros(3, 4), torch.eye(2), torch.eye(4))
    with pytest.raises(ValueError):
        DiagGaussian(torch.zeros(3), torch.zeros(4))
    FullGaussian(torch.zeros(3), torch.eye(3))
