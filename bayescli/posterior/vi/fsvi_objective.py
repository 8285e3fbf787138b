"""The FSVI objective: the closed-form function-space KL and the expected log-likelihood.

Shared by post-hoc (last-layer) and from-scratch FSVI (VI-SPEC part B). With a linear head the
logits are linear in the head's weights, so per class ``k`` and for context features
``Φ̃_C = [Φ_C, 1]`` ``[C, D+1]``:

    q: N(Φ̃_C m̃_k, Φ̃_C diag(s̃_k) Φ̃_Cᵀ + jI),   p: N(μ_p,k, σ_p² Φ̃_p Φ̃_pᵀ + jI),

independent across classes (mean field); the KL is a sum of ``K`` C-dimensional Gaussian KLs in
closed form, in float64 (:func:`function_kl`).

Jitter: ``j = 1e-6 · mean diag(K_p)`` is added to *both* kernels. Sharing it makes directions
that neither kernel reaches (collinear monochrome features, ``C > D+1``) contribute
``ρ − 1 − ln ρ ≈ 0`` instead of a spurious term (VI-SPEC B6.6).

Cost per step (``K`` classes, ``D`` features): one ``C × C`` Cholesky of ``K_p``; traces for all
classes through ``G_d = φ̃_dᵀ K_p⁻¹ φ̃_d`` (``K·D``); Mahalanobis terms through ``L_p⁻¹ Φ̃_C M̃ᵀ``
(``C·D·K``); the ``K`` log-determinants from one GEMM of the variances with the ``C(C+1)/2``
pairwise feature products (``K·D·C²/2``) and a batched Cholesky ``[K, C, C]``, with a
hand-written backward (``∂ log|K_q,k| / ∂K_q,k = K_q,k⁻¹``). With a class subset the
log-determinants of those classes are scaled by ``K / |subset|`` (unbiased for the KL and its
gradient; traces and Mahalanobis terms stay exact).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from bayescli.devices import generator
from bayescli.errors import BayescliError
from bayescli.posterior.selection import Scored
from bayescli.posterior.vi.softmax_expectations import log_mean_softmax

JITTER = 1e-6  # relative to mean diag(K_p) (FSVI-code uses an absolute 1e-6; VI-SPEC B6.6)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run batched small LAPACK calls on one thread (CPU).

    Measured with torch 2.14 on 2 busy cores: a batched ``solve_triangular`` / ``inv`` /
    ``cholesky_inverse`` of 256 matrices 64 × 64 takes ≈ 3–6 s with 2 threads and 0.01 s with 1
    (nested threading stalls); switching the count costs nothing measurable.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


NOT_PD = "the variational kernel on the context points is not positive definite; lower lr or head_var_init"
SINGULAR = "the prior kernel on the context points is singular; use another context"


class FactorisationChecks:
    """The Cholesky failures of :func:`function_kl`'s kernels on ``device``.

    On the CPU each is checked as it happens. On a GPU a check is a host read, so the failure
    flags stay on the device and :meth:`check` reads them once (a training loop calls it once
    per epoch): a failed step's NaNs cannot reach a result that is returned.
    """

    def __init__(self, device: torch.device) -> None:
        self.defer = torch.device(device).type != "cpu"
        self.flags: dict[str, list[torch.Tensor]] = {}

    def add(self, message: str, info: torch.Tensor) -> None:
        """Record the ``info`` of a ``cholesky_ex`` (nonzero: failed), raising ``message`` now or later."""
        if not self.defer:
            if bool((info != 0).any()):
                raise BayescliError(message)
            return
        self.flags.setdefault(message, []).append((info != 0).any())

    def check(self) -> None:
        """Raise the first recorded failure (one host read for all of them); forget them."""
        if not self.flags:
            return
        failed = torch.stack([torch.stack(f).any() for f in self.flags.values()]).tolist()
        messages = list(self.flags)
        self.flags.clear()
        for message, bad in zip(messages, failed, strict=True):
            if bad:
                raise BayescliError(message)


class _GramLogDet(torch.autograd.Function):
    """``log|Φ̃ diag(s_k) Φ̃ᵀ + jI|`` for every row ``s_k`` of ``s [K, D']`` → ``[K]``.

    The Gram matrices come from one GEMM with the pairwise products ``pairs [T, D']``
    (``pairs[t] = φ̃_a ⊙ φ̃_b`` over the ``T = C(C+1)/2`` pairs ``a ≤ b``); the backward uses
    ``∂ log|K| / ∂K = K⁻¹`` from the saved Cholesky factors, which is cheaper than
    differentiating through the factorisation.
    """

    @staticmethod
    def forward(ctx, s, pairs, jitter, rows, cols, size, checks):  # noqa: ANN001, ANN205 (autograd API)
        gram = s.new_zeros(s.shape[0], size, size)
        tri = s @ pairs.T  # [K, T]
        gram[:, rows, cols] = tri
        gram[:, cols, rows] = tri
        gram.diagonal(dim1=1, dim2=2).add_(jitter)
        with _one_thread():
            chol, info = torch.linalg.cholesky_ex(gram)
        checks.add(NOT_PD, info)
        ctx.save_for_backward(s, pairs, chol, rows, cols)
        return 2 * chol.diagonal(dim1=1, dim2=2).log().sum(1)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        s, pairs, chol, rows, cols = ctx.saved_tensors
        eye = torch.eye(chol.shape[1], dtype=chol.dtype, device=chol.device).expand_as(chol)
        with _one_thread():
            half = torch.linalg.solve_triangular(chol, eye, upper=False)
        inv = half.transpose(1, 2) @ half  # K⁻¹ = L⁻ᵀL⁻¹  [K, C, C]
        # d log|K| / d tri[a,b] = K⁻¹_ab + K⁻¹_ba = 2 K⁻¹_ab off the diagonal, K⁻¹_aa on it.
        weight = inv[:, rows, cols] * torch.where(rows == cols, 1.0, 2.0).to(inv.dtype)
        weight = weight * grad[:, None]
        grad_s = weight @ pairs if ctx.needs_input_grad[0] else None
        grad_pairs = weight.T @ s if ctx.needs_input_grad[1] else None
        return grad_s, grad_pairs, None, None, None, None, None


def function_kl(
    feat_q: torch.Tensor,
    mean_q: torch.Tensor,
    var_q: torch.Tensor,
    prior_var: float,
    feat_p: torch.Tensor | None = None,
    mean_p: torch.Tensor | None = None,
    jitter: float = JITTER,
    classes: torch.Tensor | None = None,
    checks: FactorisationChecks | None = None,
) -> torch.Tensor:
    """``Σ_k KL(N(mean_q[:,k], Φ̃_q diag(var_q[k]) Φ̃_qᵀ + jI) ‖ N(mean_p[:,k], σ_p² Φ̃_p Φ̃_pᵀ + jI))``.

    ``feat_q [C, D']`` are q's context features (with a column of ones when the head has a bias,
    its variance the last column of ``var_q [K, D']``), ``mean_q [C, K]`` q's mean logits,
    ``feat_p [C, D']`` the prior's features (default ``feat_q``), ``mean_p [C, K]`` its mean
    logits (default 0), ``prior_var`` ``σ_p²``. ``j = jitter · mean diag(σ_p² Φ̃_p Φ̃_pᵀ)`` in both
    kernels. ``classes`` (indices) restricts the log-determinants of q to those classes, scaled
    by ``K / len(classes)``. The ``C × C`` algebra runs in ``feat_q``'s dtype (pass float64);
    ``mean_q``/``var_q`` may be float32 parameters. ``checks`` collects the kernels' Cholesky
    failures (default: checked at once, :class:`FactorisationChecks`). Returns a scalar.
    """
    if checks is None:
        checks = FactorisationChecks(torch.device("cpu"))
    c, k = mean_q.shape
    if feat_p is None and mean_p is None and c > feat_q.shape[1]:
        # More points than feature columns: both Gaussians live on range(Φ̃) (rank ≤ D'). With
        # Φ̃ = QR the KL on that subspace is the KL of the coordinates Qᵀf — exact and smaller.
        basis, feat_q = torch.linalg.qr(feat_q)
        mean_q = basis.T @ mean_q.to(basis.dtype)
        c = feat_q.shape[0]
    fp = feat_q if feat_p is None else feat_p
    kp = prior_var * (fp @ fp.T)
    jit = (jitter * kp.diagonal().mean()).detach().clamp_min(torch.finfo(kp.dtype).tiny)
    eye = torch.eye(c, dtype=kp.dtype, device=kp.device)
    chol, info = torch.linalg.cholesky_ex(kp + jit * eye)
    checks.add(SINGULAR, info)
    solve = torch.linalg.solve_triangular
    g = solve(chol, feat_q, upper=False).square().sum(0)  # G_d = φ̃_dᵀ K_p⁻¹ φ̃_d  [D']
    # Contractions with the [K, D'] variances run in their dtype (a sum of positive terms).
    trace = (var_q @ g.to(var_q.dtype)).sum().to(kp.dtype)
    trace = trace + k * jit * solve(chol, eye, upper=False).square().sum()
    delta = mean_q.to(kp.dtype) if mean_p is None else mean_q.to(kp.dtype) - mean_p.to(kp.dtype)
    maha = solve(chol, delta, upper=False).square().sum()
    logdet_p = 2 * chol.diagonal().log().sum()
    rows, cols = torch.triu_indices(c, c, device=feat_q.device)
    pairs = feat_q[rows] * feat_q[cols]  # [C(C+1)/2, D']
    var_rows = (var_q if classes is None else var_q[classes]).to(kp.dtype)
    logdet_q = _GramLogDet.apply(var_rows, pairs, jit, rows, cols, c, checks).sum() * (k / var_rows.shape[0])
    return 0.5 * (trace + maha - k * c + k * logdet_p - logdet_q)


def expected_nll(
    mean: torch.Tensor, var: torch.Tensor, labels: torch.Tensor, samples: int, generator: torch.Generator
) -> torch.Tensor:
    """``(1/B) Σ_b E_{z ~ N(mean_b, diag var_b)}[−log softmax(z)_{y_b}]`` by ``samples`` draws.

    ``mean``/``var`` ``[B, K]``: the logit moments of a mean-field linear head (local
    reparameterisation: the logits' own distribution, sampled instead of the weights).
    """
    eps = torch.randn((samples, *mean.shape), generator=generator, dtype=mean.dtype, device=mean.device)
    logits = mean + var.sqrt() * eps
    return F.cross_entropy(logits.reshape(-1, mean.shape[1]), labels.repeat(samples))


def head_moments(phi: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, bias: bool) -> tuple:
    """Logit mean and variance ``([N, K], [N, K])`` of a mean-field head (rows of ``mean``/``var``)."""
    if not bias:
        return phi @ mean.T, phi.square() @ var.T
    return torch.addmm(mean[:, -1], phi, mean[:, :-1].T), torch.addmm(var[:, -1], phi.square(), var[:, :-1].T)


def mc_predictive(mean: torch.Tensor, var: torch.Tensor, samples: int, seed: int) -> Scored:
    """``E[softmax(z)]`` ``[N, K]`` with its log-probabilities (:func:`log_mean_softmax`),
    ``z ~ N(mean, diag var)`` (``[N, K]`` each), by ``samples`` seeded draws per input — the
    predictive that FSVI's validation scores rate."""
    gen = generator(mean.device, seed)
    out = []
    # Chunks of 1024 inputs bound the [samples, chunk, K] draws in memory.
    for start in range(0, len(mean), 1024):
        sl = slice(start, start + 1024)
        eps = torch.randn((samples, *mean[sl].shape), generator=gen, dtype=mean.dtype, device=mean.device)
        draws = mean[sl] + var[sl].sqrt() * eps
        out.append(Scored(draws.softmax(-1).mean(0), log_mean_softmax(draws)))
    return Scored.cat(out)


def epoch_parts(loss: torch.Tensor, nll: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
    """``[objective, NLL, KL]`` of a step as float64 ``[3]`` on their device: the training loops
    sum these per epoch instead of reading three scalars back per batch."""
    return torch.stack([loss.detach().double(), nll.detach().double(), kl.detach().double()])


def curve_row(epoch: int, sums: torch.Tensor, began: float) -> dict:
    """One training-curve row from an epoch's summed :func:`epoch_parts` (one host read)."""
    objective, nll, kl = sums.tolist()
    return {
        "epoch": epoch + 1,
        "objective": objective,
        "nll": nll,
        "kl": kl,
        "seconds": time.perf_counter() - began,
    }
