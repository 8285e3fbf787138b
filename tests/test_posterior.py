import math

import pytest
import torch
from conftest import random_head
from oracles import autograd_jacobian, explicit_ggn, explicit_jacobian_head
from tolerance import assert_below, assert_close

from bayescli.posterior import LaplacePosterior
from bayescli.posterior.gaussian import DiagGaussian, FullGaussian, KronGaussian, augment
from bayescli.posterior.prior import log_marglik, optimise_marglik

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


# float64; on this head λ_max(H) ≈ 46, so κ(H + δI) ≤ 70 for δ ≥ 0.7: inverses and pushforwards
# lose ≲ κ·eps ≈ 2e-14 relative, and 1e-8 leaves a margin above 10⁵ (observed ≤ 1e-14)
F64_SOLVE = 1e-8


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_glm_logit_gaussian_equals_brute_force_jacobian(fitted, structure):
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, structure)
    post.set_prior_precision(0.7)
    x = torch.randn(30, D, dtype=torch.float64)
    lg = post.logit_gaussian(x)
    jac = explicit_jacobian_head(augment(x), K)
    cov = jac @ explicit_cov(post) @ jac.transpose(1, 2)
    assert_below(rel(lg.covariance(), cov), F64_SOLVE, what=f"logit covariance ({structure})")
    assert_below(rel(lg.var, cov.diagonal(dim1=1, dim2=2)), F64_SOLVE, what=f"logit variances ({structure})")
    assert_close(lg.mean, head(x), atol=1e-10, what=f"logit mean ({structure})")  # float64, |logit| ≲ 10
    v = torch.randn(30, K, dtype=torch.float64)
    matvec = torch.einsum("nkl,nl->nk", cov, v)
    assert_below(rel(lg.cov_matvec(v), matvec), F64_SOLVE, what=f"covariance matvec ({structure})")


def test_kron_pushforward_never_needs_dense_covariance(fitted):
    phi, head, labels = fitted
    lg = LaplacePosterior.fit_last_layer(phi, labels, head, "kron").logit_gaussian(phi)
    assert lg.kind == "eig" and lg.cov is None and lg.spectrum.shape == (N, K)


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_all_layer_glm_equals_explicit_jacobian(structure):
    from bayescli.models.specs import Classifier

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
    assert_below(rel(lg.covariance(), jac @ sigma @ jac.mT), F64_SOLVE, what=f"all-layer GLM ({structure})")


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_weight_samples_have_the_posterior_covariance(fitted, structure):
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, structure)
    post.set_prior_precision(5.0)
    draws = post.gaussian.sample(40_000, torch.Generator().manual_seed(0))
    cov = explicit_cov(post)
    emp = torch.cov(draws.T)
    # 40,000 seeded draws: an empirical covariance entry has SE ≤ √(2/40,000)·max Σ_ii = 0.007·max Σ_ii
    # and a mean entry SE ≤ 0.005·√max Σ_ii, so 0.05 is ≥ 7 SE (the max over 576 entries)
    scale = cov.diagonal().max().item()
    assert_close(emp, cov, atol=0.05 * scale, what=f"sample covariance ({structure})")
    mean = post.gaussian.mean.reshape(-1)
    assert_close(draws.mean(0), mean, atol=0.05 * scale**0.5, what=f"sample mean ({structure})")


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_marglik_auto_finds_grid_maximiser(fitted, structure):
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, structure)
    delta = post.optimise_prior_marglik()
    grid = torch.logspace(-4, 4, 200_001, dtype=torch.float64)
    values = log_marglik(post.gaussian, post.log_likelihood, grid)
    best = grid[values.argmax()].item()
    # the grid locates the maximiser within half a step (10^(4e-5) − 1 ≈ 9.2e-5 relative), the
    # optimiser within xatol = 1e-6 decades (2.3e-6): 2e-3 is ≥ 20× their sum
    assert_close(delta, best, rtol=2e-3, what=f"marglik argmax ({structure})")
    # the optimum is at least the grid's best up to float64 rounding of values of order 1e2
    assert_below(
        max(values.max().item() - post.log_marglik(), 0.0), 1e-6, what=f"marglik value ({structure})"
    )
    assert post.metadata()["prior"]["method"] == "marglik" and len(post.metadata()["prior"]["curve"]) > 10


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_marglik_delta_is_stationary_and_stable_to_round_off(fitted, structure):
    """δ is where the slope vanishes, and curvature that differs by round-off (other batchings,
    other process counts) gives the same δ: the flat top of the objective would not fix it."""
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, structure)
    delta = post.optimise_prior_marglik()
    g, ll, t, h = post.gaussian, post.log_likelihood, math.log10(delta), 1e-4
    # central difference in log10 δ: truncation h²/6·|f‴| ≈ 2e-9·|f‴| (|f‴| ≲ 3|f''| here),
    # rounding 1e-16·|f|/h ≈ 1e-10; a root within 1e-7·|f''| is ≥ 10× both
    fd = (log_marglik(g, ll, 10 ** (t + h)) - log_marglik(g, ll, 10 ** (t - h))).item() / (2 * h)
    sides = log_marglik(g, ll, 10 ** (t + 0.1)) + log_marglik(g, ll, 10 ** (t - 0.1))
    bend = abs(sides.item() - 2 * post.log_marglik()) / 0.01  # |f''| per decade²
    assert_below(abs(fd), 1e-7 * max(bend, 1.0), what=f"slope at δ ({structure})")
    gen = torch.Generator().manual_seed(3)

    def nudged(x: torch.Tensor) -> torch.Tensor:  # 1e-13 relative, ~500× float64 rounding
        return x.double() * (1 + 1e-13 * torch.randn(x.shape, generator=gen, dtype=torch.float64))

    if isinstance(g, KronGaussian):
        other = KronGaussian(g.mean, nudged(g.G), nudged(g.A))
    elif isinstance(g, DiagGaussian):
        other = DiagGaussian(g.mean.double(), nudged(g.h))
    else:
        H = nudged(g.H)
        other = FullGaussian(g.mean, 0.5 * (H + H.T))
    moved, _ = optimise_marglik(other, ll)
    # dδ/δ ≈ (slope change ~1e-13·|terms|) / |f''| ~ 1e-13; 1e-9 leaves 1e4 of margin, and a
    # value-based search (flat to round-off over ~1e-7 in log δ) fails it
    assert_below(abs(moved / delta - 1), 1e-9, what=f"δ under round-off ({structure})")


def test_log_det_matches_dense_determinant(fitted):
    phi, head, labels = fitted
    for structure in ("diag", "kron", "full"):
        post = LaplacePosterior.fit_last_layer(phi, labels, head, structure)
        dense = torch.linalg.inv(explicit_cov(post))  # prior precision 1 after fitting
        # dense.inv().logdet() loses ≲ κ·eps with κ(H + I) ≈ 47 here: 1e-8 relative is ≥ 10⁵×
        ours = post.gaussian.log_det_precision(1.0)
        assert_close(ours, torch.logdet(dense), rtol=1e-8, what=f"log det ({structure})")


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


def dense_curvature(phi: torch.Tensor, head: torch.nn.Linear, structure: str) -> torch.Tensor:
    """``H [P, P]`` of each structure from the explicit last-layer GGN ``Σ_n Jₙᵀ Λₙ Jₙ``."""
    phi_aug = augment(phi)
    probs = head(phi).softmax(-1).detach()
    ggn = explicit_ggn(explicit_jacobian_head(phi_aug, K), probs)
    if structure == "full":
        return ggn
    if structure == "diag":
        return torch.diag(ggn.diagonal())
    lam = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    return torch.kron(lam.sum(0), phi_aug.T @ phi_aug / len(phi))  # KFLR: G summed, A averaged


def dense_log_marglik(phi, labels, head, hessian: torch.Tensor, delta: float) -> float:
    """``log p(D|θ*) − ½δ‖θ*‖² + (P/2) log δ − ½ log det(H + δI)`` with dense linear algebra
    (the ``(P/2) log 2π`` of the prior normaliser cancels the Laplace integral's)."""
    theta = torch.cat([head.weight, head.bias[:, None]], 1).detach().reshape(-1)
    log_lik = torch.log_softmax(head(phi), -1).gather(1, labels[:, None]).sum().item()
    p = theta.numel()
    _, logdet = torch.linalg.slogdet(hessian + delta * torch.eye(p, dtype=hessian.dtype))
    return log_lik - 0.5 * delta * theta.dot(theta).item() + 0.5 * p * math.log(delta) - 0.5 * logdet.item()


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_log_marglik_equals_dense_oracle_at_several_deltas(fitted, structure):
    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, structure)
    hessian = dense_curvature(phi, head, structure)
    norm = torch.linalg.matrix_norm(hessian, 2).item()
    p = hessian.shape[0]
    for delta in (1e-3, 0.1, 3.0, 50.0, 1e3):
        expected = dense_log_marglik(phi, labels, head, hessian, delta)
        # log det of a P×P SPD matrix: absolute error ≲ P·eps·κ(H + δI); the other terms are
        # float64 sums over N = 200 inputs (error ≲ N·eps·|value|); 100× both.
        atol = 100 * p * 2.2e-16 * (norm / delta + 1) + 100 * N * 2.2e-16 * abs(expected)
        got = post.log_marglik(delta)
        assert_close(got, expected, atol=atol, what=f"log marglik vs dense oracle, delta={delta:g}")
    # the optimiser's δ maximises the dense oracle too: compare with its neighbours on a grid
    best = post.optimise_prior_marglik()
    at_best = dense_log_marglik(phi, labels, head, hessian, best)
    for factor in (0.9, 1.1):
        assert at_best >= dense_log_marglik(phi, labels, head, hessian, best * factor)


def test_val_nll_picks_the_grid_value_with_lowest_dense_oracle_nll(fitted):
    from bayescli.fitting.laplace import LaplaceSettings, select_prior
    from bayescli.models.features import Features

    phi, head, labels = fitted
    post = LaplacePosterior.fit_last_layer(phi, labels, head, "full")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(150, D, generator=gen, dtype=torch.float64)
    logits = head(x).detach()
    # labels drawn from a softer model than the MAP: the MAP is overconfident, so the best δ is
    # neither the smallest nor the largest on the grid
    y = torch.multinomial((logits / 4).softmax(-1), 1, generator=gen).squeeze(1)
    grid = [float(v) for v in torch.logspace(-3, 3, 13)]
    jac = explicit_jacobian_head(augment(x), K)
    hessian = dense_curvature(phi, head, "full")
    curve = []
    for delta in grid:
        cov = jac @ torch.linalg.inv(hessian + delta * torch.eye(K * (D + 1), dtype=torch.float64)) @ jac.mT
        var = cov.diagonal(dim1=1, dim2=2)
        probs = torch.softmax(logits / torch.sqrt(1 + math.pi * var / 8), -1)
        curve.append(-probs.gather(1, y[:, None]).log().mean().item())
    best = grid[min(range(len(grid)), key=curve.__getitem__)]
    assert grid[0] < best < grid[-1]
    sel = select_prior(post, Features(x, logits, y), LaplaceSettings(), grid=grid)
    assert sel.chosen == best and post.prior_precision == best
    assert [row["nll"] for row in sel.curve] == pytest.approx(curve, rel=1e-9)
