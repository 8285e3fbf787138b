"""Dense (segmentation) last-layer Laplace against brute force on a tiny float64 net.

Oracle: the network's output ``[N, K, H, W]`` differentiated w.r.t. the dense head's weight and bias by
``torch.autograd.functional.jacobian`` — through the backbone's head *and* the bilinear upsampling
after it, nothing of bayescli's carried-features construction used — gives per-pixel Jacobians
``J_i [K, P]`` (``P = K(C+1)``, row-major ``W̃``). From them: the GGN ``Σ_valid J_iᵀ Λ_i J_i`` over the
pixels whose mask is not ``ignore_index``, the KFLR factors ``G = Σ Λ_i``, ``A = (1/n) Σ ψ_iψ_iᵀ``
(``ψ_i`` read off ``J_i``), dense precisions ``P`` and the per-pixel covariances ``J_i P⁻¹ J_iᵀ``.

Tolerances: everything is float64. The curvature sums have ~10³ terms of size ≤ 1 (rounding
≤ 10³·1e-16 relative); the predictive goes through eigendecompositions of precisions whose condition
number is below 1e4 here, so relative errors stay below ~1e-11: 1e-9 leaves room for BLAS
summation orders and thread counts, and is far below any error of the maths (≥ 1e-3 relative).
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import assert_close

from bayescli.errors import BayescliError
from bayescli.models.dense import DenseClassifier
from bayescli.models.specs import SmallSegNet
from bayescli.options import Link
from bayescli.posterior.dense_laplace import fit_dense_laplace, valid_rows
from bayescli.predictive.dense import dense_logit_gaussian, dense_predict, from_rows
from bayescli.predictive.links import apply_link

RTOL = 1e-9
K, C_IN, H, W, N = 3, 1, 6, 7, 3
D1 = 5  # C + 1
DELTA = 0.7


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)  # a seed whose feature channels are all alive after the ReLU
    net = SmallSegNet(C_IN, K, width=2).double()  # feature map C = 4, head 4 → 3
    with torch.no_grad():
        net.classifier.weight.mul_(3.0)  # confident, unequal probabilities: Λ_i far from uniform
    net.eval()
    x = torch.rand(N, C_IN, H, W, dtype=torch.float64)
    mask = torch.randint(0, K, (N, H, W))
    mask[0, :2] = 255  # ignored band
    mask[2, :, -3:] = 255
    clf = DenseClassifier(net)
    clf.check_split(x)
    with torch.no_grad():
        assert bool((clf.features(x).abs().amax((0, 2, 3)) > 0).all()), "a dead channel weakens every check"
    return clf, x, mask


def carry(clf: DenseClassifier, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return clf.dense_features(x)


def brute_jacobian(clf: DenseClassifier, x: torch.Tensor) -> torch.Tensor:
    """``J [N, H, W, K, K(C+1)]``: d network output / d (head weight, bias), pixel by pixel."""
    net, head = clf.net, clf.net.classifier
    weight0, bias0 = head.weight.detach().clone(), head.bias.detach().clone()

    def out(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(
            net, {"classifier.weight": weight, "classifier.bias": bias}, (clf.normalise(x),)
        )

    jw, jb = torch.autograd.functional.jacobian(out, (weight0, bias0))
    jw = jw.reshape(N, K, H, W, K, -1)  # [..., K', C]
    jac = torch.cat([jw, jb.reshape(N, K, H, W, K, 1)], -1)  # [N, K, H, W, K', C+1]
    return jac.permute(0, 2, 3, 1, 4, 5).reshape(N, H, W, K, -1)


def brute_ggn(
    clf, x, mask, ignore_index=255
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense GGN ``[P, P]`` over valid pixels, KFLR ``G [K, K]``, ``A [C+1, C+1]`` and ``J`` per pixel."""
    jac = brute_jacobian(clf, x).reshape(-1, K, K * D1)
    with torch.no_grad():
        probs = clf(x).permute(0, 2, 3, 1).reshape(-1, K).softmax(-1)
    valid = mask.reshape(-1) != ignore_index
    lam = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    ggn = torch.einsum("ikp,ikl,ilq->pq", jac[valid], lam[valid], jac[valid])
    # J_i = I_K ⊗ ψ_iᵀ: ψ_i is the first row's first block
    psi = jac[:, 0, :D1]
    G = lam[valid].sum(0)
    A = psi[valid].T @ psi[valid] / int(valid.sum())
    return ggn, G, A, jac


def test_jacobian_is_kronecker_of_the_carried_features(setup):
    """The head commutes with the upsampling: J_i = I_K ⊗ ψ_iᵀ with ψ_i = T(φ̃) at pixel i."""
    clf, x, _ = setup
    jac = brute_jacobian(clf, x).reshape(-1, K, K, D1)
    psi = jac[:, 0, 0]
    expected = torch.eye(K, dtype=torch.float64)[None, :, :, None] * psi[:, None, None, :]
    assert_close(jac, expected, atol=1e-12, what="Jacobian structure")
    carried = carry(clf, x).permute(0, 2, 3, 1).reshape(-1, D1)
    assert_close(carried, psi, atol=1e-12, rtol=RTOL, what="carried features = Jacobian rows")


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_curvature_over_valid_pixels_equals_brute_force(setup, structure):
    clf, x, mask = setup
    ggn, G, A, _ = brute_ggn(clf, x, mask)
    post = fit_dense_laplace(clf, [(x, mask)], structure=structure, prior_precision=DELTA)
    assert post.n_data == int((mask != 255).sum()) == post.meta["dense"]["pixels"]
    g = post.gaussian
    if structure == "full":
        assert_close(g.H, ggn, atol=1e-12 * float(ggn.abs().max()), rtol=RTOL, what="full GGN")
    elif structure == "diag":
        assert_close(g.h.reshape(-1), ggn.diagonal(), rtol=RTOL, what="diag GGN")
    else:
        assert_close(g.G, G, atol=1e-12, rtol=RTOL, what="kron G")
        assert_close(g.A, A, atol=1e-12, rtol=RTOL, what="kron A")
    # the ignored pixels matter: counting them changes the curvature by far more than the tolerance
    everything, _, _, _ = brute_ggn(clf, x, torch.zeros_like(mask))
    assert (everything - ggn).abs().max() > 1e-2 * ggn.abs().max()


def test_log_likelihood_sums_valid_pixels(setup):
    clf, x, mask = setup
    post = fit_dense_laplace(clf, [(x, mask)], structure="diag", prior_precision=DELTA)
    with torch.no_grad():
        logits = clf(x)
    nll = torch.nn.functional.cross_entropy(logits, mask, ignore_index=255, reduction="sum")
    assert_close(post.log_likelihood, -nll, rtol=RTOL, what="log-likelihood over valid pixels")


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_per_pixel_logit_covariance_equals_brute_force(setup, structure):
    clf, x, mask = setup
    ggn, G, A, jac = brute_ggn(clf, x, mask)
    p = ggn.shape[0]
    eye = torch.eye(p, dtype=torch.float64)
    precision = {
        "full": ggn + DELTA * eye,
        "diag": torch.diag(ggn.diagonal() + DELTA),
        "kron": torch.kron(G, A) + DELTA * eye,
    }[structure]
    cov_w = torch.linalg.inv(precision)
    expected = torch.einsum("ikp,pq,ilq->ikl", jac, cov_w, jac)  # every pixel, ignored ones too
    post = fit_dense_laplace(clf, [(x, mask)], structure=structure, prior_precision=DELTA)
    lg = dense_logit_gaussian(post, carry(clf, x))
    scale = float(expected.diagonal(dim1=1, dim2=2).max())
    assert_close(
        lg.var, expected.diagonal(dim1=1, dim2=2), rtol=RTOL, what=f"{structure} per-pixel variances"
    )
    assert_close(lg.covariance(), expected, atol=RTOL * scale, what=f"{structure} per-pixel covariances")
    with torch.no_grad():
        logits = clf(x)
    assert_close(from_rows(lg.mean, N, H, W), logits, atol=1e-12, rtol=RTOL, what="per-pixel means")


def test_streamed_fit_equals_one_batch(setup):
    """Images one at a time, rows chunked by 7: the same sums as one pass (float64 rounding)."""
    clf, x, mask = setup
    whole = fit_dense_laplace(clf, [(x, mask)], structure="kron", prior_precision=DELTA, batch_size=4096)
    parts = [(x[i : i + 1], mask[i : i + 1]) for i in range(N)]
    streamed = fit_dense_laplace(clf, parts, structure="kron", prior_precision=DELTA, batch_size=7)
    assert_close(streamed.gaussian.G, whole.gaussian.G, atol=1e-12, rtol=RTOL, what="streamed G")
    assert_close(streamed.gaussian.A, whole.gaussian.A, atol=1e-12, rtol=RTOL, what="streamed A")
    assert_close(streamed.log_likelihood, whole.log_likelihood, rtol=RTOL, what="streamed log-likelihood")


def test_marglik_prior_needs_and_uses_masks(setup):
    clf, x, mask = setup
    post = fit_dense_laplace(clf, [(x, mask)], structure="kron")
    assert post.prior_record["method"] == "marglik" and post.prior_precision > 0
    with pytest.raises(BayescliError, match="labelled"):
        fit_dense_laplace(clf, [(x, None)], structure="kron")


def test_upsampled_variance_is_the_quadratic_form_not_the_interpolated_variance(setup):
    """Bilinear upsampling: Var f_i = wᵢᵀ Cov(f_low) wᵢ over the contributing low-resolution positions
    (the exact identity), which is at most — and here strictly below — Σ_j w_ij Var f_j (the naive
    interpolation of per-position variances), by Jensen for convex weights."""
    clf, x, mask = setup
    post = fit_dense_laplace(clf, [(x, mask)], structure="full", prior_precision=DELTA)
    exact = from_rows(dense_logit_gaussian(post, carry(clf, x)).var, N, H, W)  # [N, K, H, W]
    with torch.no_grad():
        phi = clf.features(x)  # [N, C, h, w]
    phi_aug = torch.cat([phi, torch.ones_like(phi[:, :1])], 1)
    h, w = phi.shape[-2:]
    low = phi_aug.permute(0, 2, 3, 1).reshape(N, h * w, -1)  # [N, hw, C+1]
    # interpolation weights of each output pixel over the low-res positions: upsample unit impulses
    impulses = torch.eye(h * w, dtype=torch.float64).reshape(h * w, 1, h, w)
    weights = torch.nn.functional.interpolate(impulses, size=(H, W), mode="bilinear", align_corners=False)
    weights = weights.reshape(h * w, H * W).T  # [HW, hw]
    cov_w = post.gaussian.covariance()  # [P, P] over row-major W̃
    d1 = low.shape[-1]
    quad = torch.empty(N, K, H * W, dtype=torch.float64)
    naive = torch.empty_like(quad)
    for k in range(K):
        block = cov_w[k * d1 : (k + 1) * d1, k * d1 : (k + 1) * d1]
        cov_low = low @ block @ low.transpose(1, 2)  # [N, hw, hw] = Cov(f_jk, f_j'k)
        quad[:, k] = torch.einsum("ij,nje,ie->ni", weights, cov_low, weights)
        naive[:, k] = cov_low.diagonal(dim1=1, dim2=2) @ weights.T
    quad, naive = quad.reshape(N, K, H, W), naive.reshape(N, K, H, W)
    assert_close(exact, quad, rtol=RTOL, what="exact = wᵀ Cov w")
    assert bool((exact <= naive * (1 + RTOL)).all())
    assert float((naive - exact).max()) > 1e-3 * float(exact.max())


def test_probit_per_pixel_and_chunking(setup):
    clf, x, mask = setup
    post = fit_dense_laplace(clf, [(x, mask)], structure="kron", prior_precision=DELTA)
    carried = carry(clf, x)
    pred = dense_predict(post, carried, link="probit", pixel_chunk=5)
    lg = dense_logit_gaussian(post, carried)
    mu, var = from_rows(lg.mean, N, H, W), from_rows(lg.var, N, H, W)
    expected = (mu / torch.sqrt(1 + math.pi * var / 8)).softmax(1)
    assert_close(pred.probs, expected, atol=1e-12, what="per-pixel probit")
    assert_close(pred.logit_var, var, rtol=RTOL, what="logit variances")
    bridge = dense_predict(post, carried, link=Link.BRIDGE, pixel_chunk=5)
    rows = apply_link(lg, Link.BRIDGE)
    assert_close(bridge.probs, from_rows(rows.probs, N, H, W), atol=1e-12, what="bridge per pixel")
    mc = dense_predict(post, carried, link="mc", samples=50, pixel_chunk=50)
    assert mc.probs.shape == (N, K, H, W) and mc.expected_entropy.shape == (N, H, W)
    assert_close(mc.probs.sum(1), torch.ones(N, H, W), atol=1e-12, what="MC sums to one")


def test_masks_must_fit(setup):
    clf, x, mask = setup
    bad = mask.clone()
    bad[1, 0, 0] = K
    with pytest.raises(BayescliError, match=f"mask holds class {K}"):
        fit_dense_laplace(clf, [(x, bad)], structure="diag", prior_precision=1.0)
    with pytest.raises(BayescliError, match="do not match the model's output"):
        valid_rows(carry(clf, x), mask[:, :-1])


def test_dense_posterior_file_round_trip(setup, tmp_path):
    """Saved and loaded like any Laplace posterior: the dense record and the predictive survive."""
    from bayescli.posterior.base import load_posterior

    clf, x, mask = setup
    post = fit_dense_laplace(clf, [(x, mask)], structure="kron")
    post.save(tmp_path / "dense.safetensors")
    back = load_posterior(tmp_path / "dense.safetensors")
    assert back.meta["dense"] == post.meta["dense"] and back.head_bias is False
    assert back.prior_precision == post.prior_precision and back.n_data == post.n_data
    carried = carry(clf, x)
    before, after = dense_predict(post, carried), dense_predict(back, carried)
    assert_close(after.probs, before.probs, atol=1e-12, what="predictive after a round trip")


def test_kron_predictive_projected_at_the_head_resolution_is_the_same(setup):
    """T(φ̃)ᵀ[W̃ᵀ | Q_A] = T(φ̃ᵀ[W̃ᵀ | Q_A]): the projected kron predictive equals the carried one."""
    from bayescli.predictive.dense import projection

    clf, x, mask = setup
    post = fit_dense_laplace(clf, [(x, mask)], structure="kron", prior_precision=DELTA)
    proj = projection(post)
    assert proj.shape == (D1, K + D1)
    with torch.no_grad():
        projected = clf.dense_features(x, proj)
    assert projected.shape == (N, K + D1, H, W)
    plain = dense_logit_gaussian(post, carry(clf, x))
    fast = dense_logit_gaussian(post, projected, projected=True)
    assert_close(fast.mean, plain.mean, atol=1e-12, rtol=RTOL, what="projected means")
    assert_close(fast.covariance(), plain.covariance(), atol=1e-12, rtol=RTOL, what="projected covariances")
    a = dense_predict(post, projected, "probit", pixel_chunk=7, projected=True)
    b = dense_predict(post, carry(clf, x), "probit")
    assert_close(a.probs, b.probs, atol=1e-12, what="projected probit")
    diag = fit_dense_laplace(clf, [(x, mask)], structure="diag", prior_precision=DELTA)
    assert projection(diag) is None
    with pytest.raises(BayescliError, match="kron posteriors only"):
        dense_predict(diag, projected, projected=True)
    with pytest.raises(BayescliError, match=r"must be \[5, M\]"):
        clf.dense_features(x, proj[1:])


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_validation_nll_curve_and_choice(setup, structure):
    """The one-pass curve equals refitting at each δ and averaging −log p(y) over the valid pixels."""
    from bayescli.evaluation.dense import dense_nll_curve, select_dense_prior

    clf, x, mask = setup
    post = fit_dense_laplace(clf, [(x[:2], mask[:2])], structure=structure, prior_precision=DELTA)
    val = [(x[i : i + 1], mask[i : i + 1]) for i in range(N)]
    deltas = [0.01, 0.3, 10.0]
    curve = dense_nll_curve(post, clf, val, deltas)
    assert post.prior_precision == DELTA  # left as it was
    valid = mask != 255
    for delta, got in curve:
        ref = fit_dense_laplace(clf, [(x[:2], mask[:2])], structure=structure, prior_precision=delta)
        logp = dense_predict(ref, carry(clf, x), "probit").log_probs
        nll = -logp.gather(1, torch.where(valid, mask, 0)[:, None]).squeeze(1)[valid].mean()
        assert_close(got, nll, rtol=RTOL, what=f"validation NLL at δ={delta}")
    assert max(v for _, v in curve) - min(v for _, v in curve) > 1e-3  # δ matters here
    chosen = select_dense_prior(post, clf, val, deltas)
    assert chosen == min(curve, key=lambda r: r[1])[0] == post.prior_precision
    assert post.prior_record["method"] == "val-nll" and post.prior_record["curve"] == curve


def test_a_classification_posterior_is_refused_on_carried_features(setup):
    from bayescli.posterior.laplace import LaplacePosterior

    clf, x, _ = setup
    head = torch.nn.Linear(D1 - 1, K).double()
    post = LaplacePosterior.fit_last_layer(torch.randn(20, D1 - 1, dtype=torch.float64), None, head)
    with pytest.raises(BayescliError, match="separate bias"):
        dense_predict(post, carry(clf, x))
