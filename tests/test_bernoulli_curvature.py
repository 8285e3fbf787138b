"""BCE (multi-label) last-layer curvature against autograd Hessians, per-sample gradients and BackPACK."""

import math
import warnings

import pytest
import torch
from oracles import explicit_jacobian_head
from tolerance import assert_below, assert_close

from bayescli.errors import BayescliError
from bayescli.posterior.bernoulli_curvature import (
    BernoulliCurvatureAccumulator,
    bernoulli_last_layer_curvature,
    bernoulli_log_likelihood,
)
from bayescli.posterior.gaussian import DiagGaussian, FullGaussian, augment

N, D, K = 200, 5, 3
P = K * (D + 1)


@pytest.fixture
def problem():
    gen = torch.Generator().manual_seed(0)
    phi_aug = augment(torch.randn(N, D, generator=gen, dtype=torch.float64))
    w = torch.randn(K, D + 1, generator=gen, dtype=torch.float64)
    probs = torch.sigmoid(phi_aug @ w.T)
    labels = torch.bernoulli(probs, generator=gen)
    return phi_aug, w, probs, labels


def bce(w_flat: torch.Tensor, phi_aug: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed loss as a function of the row-major flattened head ``W̃``."""
    logits = phi_aug @ w_flat.reshape(K, D + 1).T
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")


def per_sample_grads(w, phi_aug, labels):
    g = torch.func.vmap(torch.func.grad(bce), in_dims=(None, 0, 0))
    return g(w.reshape(-1), phi_aug[:, None], labels[:, None])  # [N, P]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# float64 sums of N = 200 terms of size ≲ 10 (|φ̃| ≲ 3, λ ≤ 1/4): rounding gives a relative error
# ≲ N·eps ≈ 5e-14 (observed ≤ 1e-15). 1e-11 leaves a margin above 1000×.
F64_SUM = 1e-11


def test_ggn_is_the_autograd_hessian_of_bce(problem):
    """For a linear head the GGN is the exact Hessian of the loss w.r.t. W̃; full is block-diagonal."""
    phi_aug, w, _, labels = problem
    hess = torch.func.hessian(bce)(w.reshape(-1), phi_aug, labels)  # [P, P]
    full = bernoulli_last_layer_curvature(phi_aug, w, None, "full", "ggn", batch_size=64).full
    assert_below(rel(full, hess), F64_SUM, what="full GGN vs autograd Hessian")
    # the off-diagonal class blocks of the Hessian are zero: classes do not couple
    mask = torch.block_diag(*[torch.ones(D + 1, D + 1, dtype=torch.bool)] * K)
    assert_below(hess[~mask].abs().max().item() / hess.abs().max().item(), 1e-14, what="cross-class blocks")
    diag = bernoulli_last_layer_curvature(phi_aug, w, None, "diag", "ggn", batch_size=64).diag
    assert diag.shape == (K, D + 1)
    assert_below(rel(diag.reshape(-1), hess.diagonal()), F64_SUM, what="diag GGN vs Hessian diagonal")


def test_ggn_equals_explicit_jacobian_sandwich(problem):
    """Σ_n J_nᵀ diag(p(1−p)) J_n with J_n = I_K ⊗ φ̃ᵀ built explicitly."""
    phi_aug, w, probs, _ = problem
    jac = explicit_jacobian_head(phi_aug, K)
    lam = torch.diag_embed(probs * (1 - probs))
    oracle = torch.einsum("nkp,nkl,nlq->pq", jac, lam, jac)
    full = bernoulli_last_layer_curvature(phi_aug, w, None, "full", "ggn").full
    assert_below(rel(full, oracle), F64_SUM, what="full GGN vs Jᵀ Λ J")


def test_kron_factors_match_their_definitions(problem):
    phi_aug, w, probs, _ = problem
    G, A = bernoulli_last_layer_curvature(phi_aug, w, None, "kron", "ggn", batch_size=64).kron
    assert_below(rel(G, torch.diag((probs * (1 - probs)).sum(0))), F64_SUM, what="kron G = Σ Λ_n")
    assert_below(rel(A, phi_aug.T @ phi_aug / N), F64_SUM, what="kron A = mean φ̃φ̃ᵀ")


def _backpack_per_class(phi_aug, w, labels, ext_name):
    """BackPACK's ``BCEWithLogitsLoss`` accepts one output per input only (``_check_input_dims``),
    so each class is its own ``Linear(D+1 → 1)``: the BCE is a sum over classes of independent
    losses, so its curvature w.r.t. row ``k`` of ``W̃`` is that of the class-``k`` problem."""
    from backpack import backpack, extend
    from backpack.extensions import KFLR, DiagGGNExact

    ext = {"diag_ggn_exact": DiagGGNExact, "kflr": KFLR}[ext_name]
    out = []
    for k in range(K):
        lin = extend(torch.nn.Linear(D + 1, 1, bias=False).double())
        lin.weight.data.copy_(w[k : k + 1])
        loss = extend(torch.nn.BCEWithLogitsLoss(reduction="sum"))(lin(phi_aug), labels[:, k : k + 1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            with backpack(ext()):
                loss.backward()
        out.append(getattr(lin.weight, ext_name))
    return out


def test_diag_and_kron_match_backpack(problem):
    phi_aug, w, _, labels = problem
    diag = bernoulli_last_layer_curvature(phi_aug, w, None, "diag", "ggn").diag
    oracle = torch.cat(_backpack_per_class(phi_aug, w, labels, "diag_ggn_exact"))
    assert_below(rel(diag, oracle), F64_SUM, what="diag GGN vs BackPACK DiagGGNExact")
    G, A = bernoulli_last_layer_curvature(phi_aug, w, None, "kron", "ggn").kron
    kflr = _backpack_per_class(phi_aug, w, labels, "kflr")
    g_oracle = torch.diag(torch.cat([f[0].reshape(1) for f in kflr]))  # per class G_k is [1, 1]
    assert_below(rel(G, g_oracle), F64_SUM, what="kron G vs BackPACK KFLR")
    assert_below(rel(A, kflr[0][1]), F64_SUM, what="kron A vs BackPACK KFLR (batch mean)")


def test_empirical_fisher_matches_per_sample_gradients(problem):
    phi_aug, w, _, labels = problem
    grads = per_sample_grads(w, phi_aug, labels)
    full = bernoulli_last_layer_curvature(phi_aug, w, labels, "full", "ef", batch_size=64).full
    assert_below(rel(full, grads.T @ grads), F64_SUM, what="full EF vs per-sample gradients")
    diag = bernoulli_last_layer_curvature(phi_aug, w, labels, "diag", "ef", batch_size=64).diag
    assert_below(rel(diag.reshape(-1), (grads**2).sum(0)), F64_SUM, what="diag EF vs per-sample gradients")
    G, A = bernoulli_last_layer_curvature(phi_aug, w, labels, "kron", "ef").kron
    err = torch.sigmoid(phi_aug @ w.T) - labels
    assert_below(rel(G, err.T @ err), F64_SUM, what="kron EF G = Σ e eᵀ")
    assert_below(rel(A, phi_aug.T @ phi_aug / N), F64_SUM, what="kron EF A")


def test_mc_ggn_is_unbiased(problem):
    """The mean of R seeded ggn-mc diagonals is within 10 standard errors of the exact GGN.

    Var(ê²) for ê = p − ŷ, ŷ ~ Bern(p): E[ê⁴] − λ² = λ(p³ + (1−p)³) − λ², so the standard error
    of the mean of R runs is √(Σ_n Var(ê_nk²) φ̃_nd⁴ / R) per entry.
    """
    phi_aug, w, probs, _ = problem
    exact = bernoulli_last_layer_curvature(phi_aug, w, None, "diag", "ggn").diag
    runs = 200
    mean = (
        sum(
            bernoulli_last_layer_curvature(phi_aug, w, None, "diag", "ggn-mc", seed=s).diag
            for s in range(runs)
        )
        / runs
    )
    lam = probs * (1 - probs)
    var4 = lam * (probs**3 + (1 - probs) ** 3) - lam**2
    se = (var4.T @ phi_aug**4 / runs).sqrt()
    assert_below(((mean - exact).abs() / se).max().item(), 10.0, what="ggn-mc mean vs exact (in SEs)")


def _tensors(curv):
    return [t for t in (curv.diag, *(curv.kron or ()), curv.full) if t is not None]


def test_batch_accumulation_equals_one_batch(problem):
    phi_aug, w, _, labels = problem
    for structure in ("diag", "kron", "full"):
        one = bernoulli_last_layer_curvature(phi_aug, w, labels, structure, "ggn", batch_size=64)
        acc = BernoulliCurvatureAccumulator(w, structure, "ggn", batch_size=64)
        for lo, hi in ((0, 7), (7, 71), (71, 72), (72, 150), (150, N)):
            acc.update(phi_aug[lo:hi], labels[lo:hi])
        streamed = acc.finish()
        assert streamed.n_data == N
        for a, b in zip(_tensors(streamed), _tensors(one), strict=True):
            assert torch.equal(a, b), structure  # the same chunks of 64 rows: bit-identical
        # other chunk sizes only reorder float64 sums
        big = bernoulli_last_layer_curvature(phi_aug, w, labels, structure, "ggn", batch_size=N)
        for a, b in zip(_tensors(one), _tensors(big), strict=True):
            assert_below(rel(a, b), F64_SUM, what=f"{structure}: batch size 64 vs {N}")
    loss = bce(w.reshape(-1), phi_aug, labels)
    assert_close(acc.log_likelihood, -loss, rtol=1e-12, what="streamed log-lik")


def test_log_likelihood_matches_direct_formula_and_is_stable(problem):
    phi_aug, w, probs, labels = problem
    direct = (labels * probs.log() + (1 - labels) * (1 - probs).log()).sum()
    acc = BernoulliCurvatureAccumulator(w, "diag", "ggn", batch_size=64)
    acc.update(phi_aug, labels)
    acc.finish()
    # float64 sum of 600 terms of size ≲ 10: relative rounding ≲ 1e-13; 1e-11 leaves 100×
    assert_close(acc.log_likelihood, direct, rtol=1e-11, what="Bernoulli log-likelihood")
    # log sigmoid(−800) underflows to log 0 naively; the softplus form gives −800 exactly
    logits = torch.tensor([[800.0, -800.0, 0.0]])
    ll = bernoulli_log_likelihood(logits, torch.tensor([[0.0, 0.0, 1.0]]))
    assert_close(ll, -800.0 - math.log(2), rtol=1e-15, what="log-likelihood for extreme logits")
    unlabelled = BernoulliCurvatureAccumulator(w, "diag", "ggn")
    unlabelled.update(phi_aug)
    unlabelled.finish()
    assert unlabelled.log_likelihood is None


def test_curvature_feeds_the_gaussian_posteriors(problem):
    """Diag and full results plug into DiagGaussian / FullGaussian and give the logit variance
    ``J (H + δI)⁻¹ Jᵀ`` computed with the autograd Hessian."""
    phi_aug, w, _, labels = problem
    delta = 2.0
    hess = torch.func.hessian(bce)(w.reshape(-1), phi_aug, labels)
    x = phi_aug[:5, :D]
    jac = explicit_jacobian_head(phi_aug[:5], K)
    cov = torch.linalg.inv(hess + delta * torch.eye(P, dtype=hess.dtype))
    oracle = torch.einsum("nkp,pq,nkq->nk", jac, cov, jac)
    full = bernoulli_last_layer_curvature(phi_aug, w, None, "full", "ggn").full
    var = FullGaussian(w, full, delta).push_last_layer(x, bias=True).var
    assert_below(rel(var, oracle), 1e-10, what="FullGaussian from BCE curvature")
    diag = bernoulli_last_layer_curvature(phi_aug, w, None, "diag", "ggn").diag
    dvar = DiagGaussian(w, diag, delta).push_last_layer(x, bias=True).var
    d_oracle = torch.einsum("nkp,p,nkp->nk", jac, 1 / (hess.diagonal() + delta), jac)
    assert_below(rel(dvar, d_oracle), 1e-10, what="DiagGaussian from BCE curvature")


def test_bad_inputs_raise_one_line_errors(problem):
    phi_aug, w, _, labels = problem
    with pytest.raises(BayescliError, match="0 or 1"):
        bernoulli_last_layer_curvature(phi_aug, w, labels * 2, "diag", "ef")
    with pytest.raises(BayescliError, match=r"shape \[N, K\]"):
        bernoulli_last_layer_curvature(phi_aug, w, labels[:, 0].long(), "diag", "ef")
    with pytest.raises(BayescliError, match="0 or 1"):
        bernoulli_log_likelihood(phi_aug @ w.T, labels - 0.5)
    with pytest.raises(BayescliError, match="needs labelled"):
        bernoulli_last_layer_curvature(phi_aug, w, None, "diag", "ef")
    with pytest.raises(BayescliError, match="features must be"):
        bernoulli_last_layer_curvature(phi_aug[:, :D], w, None, "diag", "ggn")
    with pytest.raises(BayescliError, match="limit"):
        BernoulliCurvatureAccumulator(torch.zeros(200, 101), "full")
    with pytest.raises(BayescliError, match="empty"):
        BernoulliCurvatureAccumulator(w).finish()
