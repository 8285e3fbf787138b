"""OOD detectors against direct NumPy / scikit-learn implementations, and their orientation.

Tolerances: everything runs in float64 on well-conditioned random features (covariance
condition numbers below 1e2), so the fast and the direct implementations agree to ~1e-12
relative; the 1e-6 the issue asks for leaves a margin of ≥ 1e4.
"""

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from tolerance import assert_close

from bayescli.errors import BayescliError
from bayescli.evaluation import detectors as det
from bayescli.metrics.classification import ood_metrics

RTOL = 1e-6  # see the module docstring: observed agreement ~1e-12


def _features(n=400, d=12, k=4, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 3, (k, d))
    y = rng.integers(0, k, n)
    phi = centres[y] + rng.normal(0, 1, (n, d)) @ rng.normal(0, 0.5, (d, d))
    return phi, y, rng


def _head(d=12, k=4, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 0.5, (k, d)), rng.normal(0, 0.5, k)


def test_maxlogit_and_energy_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (50, 7))
    t = torch.from_numpy(logits)
    assert_close(det.max_logit(t), logits.max(1), rtol=RTOL, what="max logit")
    assert_close(det.energy(t), logsumexp(logits, axis=1), rtol=RTOL, what="energy, T = 1")
    assert_close(det.energy(t, 2.5), 2.5 * logsumexp(logits / 2.5, axis=1), rtol=RTOL, what="energy, T = 2.5")


def test_energy_and_maxlogit_auroc_against_sklearn():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(3)
    z_in, z_out = rng.normal(0, 3, (300, 10)), rng.normal(0, 1.5, (200, 10))
    label = np.r_[np.ones(300), np.zeros(200)]
    for name, ours, ref in (
        ("energy", det.energy, lambda z: logsumexp(z, axis=1)),
        ("max_logit", det.max_logit, lambda z: z.max(1)),
    ):
        auroc = ood_metrics(ours(torch.from_numpy(z_in)), ours(torch.from_numpy(z_out)))["auroc"]
        expected = roc_auc_score(label, np.r_[ref(z_in), ref(z_out)])
        assert_close(auroc, expected, atol=1e-12, what=f"{name} AUROC vs roc_auc_score")  # same ranks


def _mahalanobis_oracle(fit, y, test, ridge, k):
    """Explicit inverse of the ridged within-class covariance, distances class by class."""
    means = np.stack([fit[y == c].mean(0) for c in range(k)])
    centred = fit - means[y]
    cov = centred.T @ centred / len(fit)
    cov += ridge * np.trace(cov) / cov.shape[0] * np.eye(cov.shape[0])
    prec = np.linalg.inv(cov)
    d2 = np.stack([np.einsum("nd,de,ne->n", test - m, prec, test - m) for m in means], 1)
    return d2


def test_mahalanobis_and_relative_against_numpy(monkeypatch):
    phi, y, rng = _features()
    test = rng.normal(0, 3, (60, phi.shape[1]))
    monkeypatch.setattr(det, "CHUNK_ELEMENTS", 7 * phi.shape[1])  # several chunks of 7 rows
    for ridge in (0.0, 1e-3):
        maha = det.Mahalanobis.fit(torch.from_numpy(phi), torch.from_numpy(y), 4, ridge)
        d2 = _mahalanobis_oracle(phi, y, test, ridge, 4)
        assert_close(maha.score(torch.from_numpy(test)), -d2.min(1), rtol=RTOL, what=f"mahalanobis r={ridge}")
        rel = det.RelativeMahalanobis.fit(torch.from_numpy(phi), torch.from_numpy(y), 4, ridge)
        d0 = _mahalanobis_oracle(phi, np.zeros(len(phi), int), test, ridge, 1)[:, 0]
        assert_close(
            rel.score(torch.from_numpy(test)),
            d0 - d2.min(1),
            rtol=RTOL,
            what=f"relative mahalanobis r={ridge}",
        )


def test_knn_against_sklearn(monkeypatch):
    from sklearn.neighbors import NearestNeighbors

    phi, _, rng = _features(n=500)
    test = rng.normal(0, 3, (70, phi.shape[1]))
    monkeypatch.setattr(det, "CHUNK_ELEMENTS", 11 * 500)  # query chunks of 11 rows
    norm = lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)  # noqa: E731
    for k in (1, 10):
        knn = det.KNN.fit(torch.from_numpy(phi), k)
        dist, _ = NearestNeighbors(n_neighbors=k).fit(norm(phi)).kneighbors(norm(test))
        assert_close(knn.score(torch.from_numpy(test)), -dist[:, k - 1], rtol=RTOL, what=f"knn k={k}")
    # a seeded bank of 100: the same as sklearn on those rows
    knn = det.KNN.fit(torch.from_numpy(phi), 5, bank_size=100, seed=4)
    rows = torch.randperm(500, generator=torch.Generator().manual_seed(4))[:100].sort().values.numpy()
    dist, _ = NearestNeighbors(n_neighbors=5).fit(norm(phi[rows])).kneighbors(norm(test))
    assert_close(knn.score(torch.from_numpy(test)), -dist[:, 4], rtol=RTOL, what="knn on a 100-row bank")
    with pytest.raises(BayescliError, match="exceeds"):
        det.KNN.fit(torch.from_numpy(phi[:3]), 5)


def test_vim_against_numpy():
    """Transcription of the authors' ViM code (origin −pinv(W)b, covariance about it, null space
    of the D − dim smallest eigenvalues, alpha = mean max logit / mean residual)."""
    phi, _, rng = _features(d=12)
    w, b = _head(12, 4)
    test = rng.normal(0, 3, (40, 12))
    u = -np.linalg.pinv(w) @ b
    x = phi - u
    eig, vecs = np.linalg.eigh(x.T @ x / len(x))
    ns = vecs[:, np.argsort(eig)[: 12 - 6]]
    alpha = (phi @ w.T + b).max(1).mean() / np.linalg.norm(x @ ns, axis=1).mean()
    expected = logsumexp(test @ w.T + b, axis=1) - alpha * np.linalg.norm((test - u) @ ns, axis=1)
    vim = det.ViM.fit(torch.from_numpy(phi), torch.from_numpy(w), torch.from_numpy(b))
    assert vim.dim == 6  # D // 2 below 768 features
    assert_close(vim.alpha, alpha, rtol=RTOL, what="vim alpha")
    assert_close(vim.score(torch.from_numpy(test)), expected, rtol=RTOL, what="vim score")
    assert det.vim_dim(2048) == 1000 and det.vim_dim(768) == 512


def test_react_and_percentile_against_numpy():
    phi, _, rng = _features()
    phi = np.maximum(phi, 0)  # post-ReLU activations
    w, b = _head()
    test = np.maximum(rng.normal(0, 4, (30, 12)), 0)
    for q in (90.0, 37.5, 100.0):
        assert_close(
            det.percentile(torch.from_numpy(phi), q),
            np.percentile(phi, q),
            rtol=1e-12,
            atol=1e-15,
            what=f"p{q}",
        )
    react = det.ReAct.fit(torch.from_numpy(phi), torch.from_numpy(w), torch.from_numpy(b), 90.0)
    clipped = np.minimum(test, np.percentile(phi, 90))
    expected = logsumexp(clipped @ w.T + b, axis=1)
    assert_close(react.score(torch.from_numpy(test)), expected, rtol=RTOL, what="react energy")


def test_odin_against_hand_gradient():
    """A linear classifier f(x) = W x + b has ∇ₓ log softmax_ŷ(f/T) = Wᵀ(e_ŷ − p)/T."""
    rng = np.random.default_rng(5)
    w, b = rng.normal(0, 1, (3, 6)), rng.normal(0, 1, 3)
    x = rng.normal(0, 1, (25, 6))
    lin = torch.nn.Linear(6, 3).double()
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        lin.bias.copy_(torch.from_numpy(b))
    t, eps = 10.0, 0.05
    z = (x @ w.T + b) / t
    p = np.exp(z - logsumexp(z, axis=1, keepdims=True))
    grad = (np.eye(3)[p.argmax(1)] - p) @ w / t
    xt = x + eps * np.sign(grad)
    zt = (xt @ w.T + b) / t
    expected = np.exp(zt - logsumexp(zt, axis=1, keepdims=True)).max(1)
    ours = det.odin(lin, torch.from_numpy(x), t, eps, batch_size=7)
    assert_close(ours, expected, rtol=RTOL, what="odin score")
    assert lin.weight.grad is None  # the weights are left alone


def test_every_detector_ranks_obvious_ood_lower():
    """In-distribution: dense positive class clusters, a head whose centred rows point at them
    (logits far from equal). OOD: small activations near zero, where every logit is ~0 and no
    cluster is near — every detector must rank them lower. ViM looks at the residual off the
    principal subspace instead: its OOD inputs are in-distribution ones moved far along a
    direction orthogonal to every cluster centre (same logits, large residual)."""
    gen = torch.Generator().manual_seed(0)
    d, k = 16, 4
    centres = 2 + 2 * torch.rand(k, d, generator=gen, dtype=torch.float64)
    y = torch.randint(0, k, (400,), generator=gen)

    def draw(n, around):
        return (around + 0.2 * torch.randn(n, d, generator=gen, dtype=torch.float64)).relu()

    phi = draw(400, centres[y])
    w, b = 3 * (centres - centres.mean(0)), torch.zeros(k, dtype=torch.float64)
    test_in, test_out = draw(50, centres[y[:50]]), draw(50, torch.zeros(d, dtype=torch.float64))
    dets = {
        "mahalanobis": det.Mahalanobis.fit(phi, y, k, 1e-6),
        "rel_mahalanobis": det.RelativeMahalanobis.fit(phi, y, k, 1e-6),
        "knn": det.KNN.fit(phi, 5),
        "react": det.ReAct.fit(phi, w, b),
    }
    for name, d_ in dets.items():
        auroc = ood_metrics(d_.score(test_in), d_.score(test_out))["auroc"]
        assert auroc > 0.99, f"{name}: AUROC {auroc}"
    off = torch.linalg.svd(centres).Vh[k:]  # [d - k, d], orthogonal to every centre and row of W
    vim = det.ViM.fit(phi, w, b)
    moved = test_in + 10 * torch.randn(50, d - k, generator=gen, dtype=torch.float64) @ off
    assert ood_metrics(vim.score(test_in), vim.score(moved))["auroc"] > 0.99, "vim"
    for name, fn in (("energy", det.energy), ("max_logit", det.max_logit)):
        auroc = ood_metrics(fn(test_in @ w.T + b), fn(test_out @ w.T + b))["auroc"]
        assert auroc > 0.99, f"{name}: AUROC {auroc}"
    lin = torch.nn.Linear(d, k).double()
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    auroc = ood_metrics(det.odin(lin, test_in, 1000.0, 0.0014), det.odin(lin, test_out, 1000.0, 0.0014))[
        "auroc"
    ]
    assert auroc > 0.99, f"odin: AUROC {auroc}"


def test_covariances_are_formed_in_float64():
    """Float32 features whose covariance has a few huge and many tiny directions: products in
    float32 give eigenvalues of −4 against a ridge of 3e-6 (the fit used to abort), in float64 the
    fit succeeds and matches the float64 fit of the same features; constant features still fail
    with a clear error."""
    gen = torch.Generator().manual_seed(0)
    n, d, k = 2000, 64, 5
    scales = torch.full((d,), 1e-2, dtype=torch.float64)
    scales[:2] = 1e4
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    phi = ((torch.randn(n, d, generator=gen, dtype=torch.float64) * scales) @ q.T + 50).float()
    labels = torch.randint(0, k, (n,), generator=gen)
    for cls in (det.Mahalanobis, det.RelativeMahalanobis):
        single, double = cls.fit(phi, labels, k), cls.fit(phi.double(), labels, k)
        assert_close(single.score(phi[:50]), double.score(phi[:50].double()), rtol=1e-4, atol=1e-6)
    same = torch.ones(40, d)
    for cls in (det.Mahalanobis, det.RelativeMahalanobis):
        with pytest.raises(BayescliError, match="singular"):
            cls.fit(same, torch.arange(40) % k, k)
