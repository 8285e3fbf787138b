"""Tractable function-space VI (FSVI, seed 001; ../shared/VI-SPEC.md part B).

``q(θ) = N(μ, diag σ²)`` over the head ``W̃ = [W, b] ∈ R^{K×(D+1)}`` (post hoc, ``last-layer``)
or over every parameter (from scratch, ``all``), trained on

    ℓ = (1/B) Σ_b E_q[−log softmax(f(x_b))_{y_b}] + KL(q_f(X_C) ‖ p_f(X_C)) / N

with the KL between the distributions over logits at ``C`` context points ``X_C`` (τ = 1,
FSVI-code scaling). With a linear head the logits are linear in the head's weights, so per
class ``k`` and for features ``Φ̃_C = [Φ_C, 1]`` ``[C, D+1]``:

    q: N(Φ̃_C m̃_k, Φ̃_C diag(s̃_k) Φ̃_Cᵀ + jI),   p: N(μ_p,k, σ_p² Φ̃_p Φ̃_pᵀ + jI),

independent across classes (mean field), and the KL is a sum of ``K`` C-dimensional Gaussian
KLs, computed in closed form in float64 (:func:`function_kl`). Post hoc ``Φ̃_p = Φ̃_C`` (frozen
features) and ``μ_p = 0`` (prior ``W̃ ~ N(0, σ_p² I)``): nothing is linearised. From scratch the
features are those of one sampled feature network (R = 1, [001:(14)]) and the prior is the
same network linearised about a fixed random initialisation ``θ0`` (VI-SPEC B6.1): ``Φ̃_p``
and ``μ_p`` are ``θ0``'s features and logits.

Prior scale: ``σ_p² = c / mean_x ‖φ̃(x)‖²`` over the training inputs, so the prior logit
variance at a typical input is ``c`` whatever the feature norms (VI-SPEC B6.7); ``c`` is
``prior_scale`` (default 1 post hoc, 300 from scratch) or, with ``select``, the grid value of lowest
validation NLL.

Jitter: ``j = 1e-6 · mean diag(K_p)`` is added to *both* kernels. Sharing it makes directions
that neither kernel reaches (collinear monochrome features, ``C > D+1``) contribute
``ρ − 1 − ln ρ ≈ 0`` instead of a spurious term (VI-SPEC B6.6).

Cost per step (post hoc, ``K`` classes, ``D`` features): one ``C × C`` Cholesky of ``K_p``;
traces for all classes through ``G_d = φ̃_dᵀ K_p⁻¹ φ̃_d`` (``K·D``); Mahalanobis terms through
``L_p⁻¹ Φ̃_C M̃ᵀ`` (``C·D·K``); the ``K`` log-determinants from one GEMM of the variances with the
``C(C+1)/2`` pairwise feature products (``K·D·C²/2``) and a batched Cholesky ``[K, C, C]``, with
a hand-written backward (``∂ log|K_q,k| / ∂K_q,k = K_q,k⁻¹``). With ``kl_classes < K`` the
log-determinants of a random subset of ``kl_classes`` classes are scaled by ``K / kl_classes``
each step (unbiased for the KL and its gradient; traces and Mahalanobis terms stay exact).

Predictives: last layer — the exact logit Gaussian ``N(M̃ φ̃, diag(s̃_k·φ̃²))`` (``exact``); all
layers — the GLM Gaussian ``N(f(x; μ), J diag(σ²) Jᵀ)`` (an approximation of the paper's BNN
predictive, which :meth:`FSVIPosterior.sample_logits` draws).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from bayescli.data import ArrayData, load_data
from bayescli.errors import BayescliError, require
from bayescli.features import extract_features
from bayescli.models import Classifier, LoadedModel, ModelSpec, build_network, builtin_names, last_linear_name
from bayescli.options import Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.curvature import network_jacobian
from bayescli.posterior.gaussian import LogitGaussian, augment
from bayescli.posterior.laplace import head_parameters
from bayescli.preprocess import Preprocess
from bayescli.progress import track
from bayescli.train import channel_stats, checkpoint_metadata

JITTER = 1e-6  # relative to mean diag(K_p) (FSVI-code uses an absolute 1e-6; VI-SPEC B6.6)
# What 0 means for these FSVIConfig fields, per mode.
# prior_scale: from scratch the context includes training points whose logits must reach ±10, so
#   the prior needs std ≳ 10 there: small-cnn on MNIST test[:5000], 10 epochs, c = 30 / 100 / 300 /
#   1000 gave accuracy .978 / .983 / .986 / .982 and ECE .127 / .074 / .054 / .052 on
#   test[5000:8000] (c = 10, 5 epochs: .954 / .221).
# batch_size, lr: post hoc the features are cached and the KL costs the same per step whatever the
#   batch, so large batches (the 2048 → 1000 benchmark: 0.48 s CPU per step at 512 vs 0.37 at 128);
#   MNIST post hoc, 10 epochs: B = 512 with lr 1e-2 matched B = 128 with lr 3e-3 (AUROC .832 / .838,
#   NLL .069 / .070). From scratch: the library trainer's lr, a CNN-sized batch.
# head_var_init: post hoc 0 = Laplace variances; from scratch the spec's 1e-3·σ_p² (Laplace
#   variances at θ0 are ≈ σ_p²: features at θ0 are tiny; measured: training collapses at c = 1000).
MODE_DEFAULTS = {
    Subset.LAST_LAYER: {"prior_scale": 1.0, "batch_size": 512, "lr": 1e-2},
    Subset.ALL: {"prior_scale": 300.0, "batch_size": 128, "lr": 3e-3, "head_var_init": 1e-3},
}
PRIOR_SCALE_GRID = {Subset.LAST_LAYER: (0.5, 1.0, 4.0), Subset.ALL: (100.0, 300.0, 1000.0)}
VAL_SAMPLES = 100  # MC draws of the logit Gaussian for the validation NLL of select
PRIOR_NORM_ROWS = 2048  # training inputs that set mean ‖φ̃‖² from scratch
AUG_MAX_ROTATION = 180.0  # degrees; augment context: any rotation ...
AUG_MAX_SHIFT = 0.25  # ... a shift of up to a quarter of the side, and a horizontal flip (p = ½)
JACOBIAN_ELEMENTS = 2**25  # Jacobian entries per chunk of the GLM predictive (128 MiB float32)


@dataclass
class FSVIConfig:
    """FSVI hyperparameters (VI-SPEC B3/B4; field names are the CLI's option names).

    * ``prior_scale``: ``c`` in ``σ_p² = c / mean‖φ̃‖²`` — the prior logit variance at a typical
      training input (post hoc: pretrained features; from scratch: the random-init features);
      ``0`` = the mode's default, 1 post hoc and 300 from scratch (``MODE_DEFAULTS``).
    * ``context``: context distribution ``p_Xc`` — ``monochrome`` (seed App. D.8: each channel
      filled with one pixel value drawn from that channel's pooled training pixels; flat inputs:
      uniform within the training range per dimension), ``augment`` (training images randomly
      flipped, shifted and rotated) or any data spec (e.g. ``kmnist:train``), read from
      ``context_root`` with the model's preprocessing.
    * ``context_points``: ``C`` context draws per step (FSVI-code: 32).
    * ``batch_context_points``: points of the current batch added to the context set (from
      scratch only, VI-SPEC B1: ``C_b = 32``); post hoc the context is ``p_Xc`` alone.
    * ``context_pool``: inputs drawn once from ``p_Xc`` whose features serve as the post-hoc
      context pool; also the rows kept of a data-spec context.
    * ``context_root``: data root for a data-spec ``context``.
    * ``samples``: MC draws of the logits for the expected log-likelihood (local
      reparameterisation of the head, exact in distribution for a linear head).
    * ``head_var_init``: initial head variances — ``0``: post hoc the diagonal-GGN Laplace
      variances ``1/(Σ_n p(1−p)φ̃² + 1/σ_p²)`` at the MAP head (VI-SPEC B4's alternative; on
      MNIST it converges within 10 epochs where the spec's ``1e-3·σ_p²`` has barely moved), from
      scratch ``1e-3·σ_p²``; a positive value: that fraction of ``σ_p²``.
    * ``feature_logvar_init``: initial log-variance of feature parameters (FSVI-code: −20).
    * ``kl_classes``: classes whose log-determinant enters the KL per step (a random subset,
      scaled to be unbiased); ``0`` or ``≥ K`` = all classes (default 64: exact up to K = 64).
    * ``subset``: ``last-layer`` (post hoc) or ``all`` (from scratch, :func:`train_fsvi`).
    * ``epochs``; ``lr`` (Adam, cosine decay to 0 post hoc / one-cycle from scratch as in
      :func:`bayescli.train.train_classifier`; ``0``: 1e-2 post hoc, 3e-3 from scratch);
      ``batch_size`` (``0``: 512 post hoc, 128 from scratch); ``seed``.
    * ``select``: choose ``prior_scale`` from ``PRIOR_SCALE_GRID`` on validation NLL (post hoc the
      MC predictive of the exact head Gaussian; from scratch that of the head marginal).
    """

    prior_scale: float = 0.0
    context: str = "monochrome"
    context_points: int = 32
    batch_context_points: int = 32
    context_pool: int = 2048
    context_root: str = "data"
    samples: int = 8
    head_var_init: float = 0.0
    feature_logvar_init: float = -20.0
    kl_classes: int = 64
    subset: str = "last-layer"
    epochs: int = 10
    lr: float = 0.0
    batch_size: int = 0
    seed: int = 0
    select: bool = False

    def check(self) -> None:
        """Raise :class:`BayescliError` for values no fit can use."""
        require(self.prior_scale >= 0, f"--prior-scale must be ≥ 0 (0 = default), got {self.prior_scale}")
        require(self.context_points >= 1, f"--context-points must be ≥ 1, got {self.context_points}")
        require(self.batch_context_points >= 0, "--batch-context-points must be ≥ 0")
        require(self.context_pool >= 1, f"--context-pool must be ≥ 1, got {self.context_pool}")
        require(self.samples >= 1, f"--samples must be ≥ 1, got {self.samples}")
        require(self.head_var_init >= 0, f"--head-var-init must be ≥ 0, got {self.head_var_init}")
        require(self.kl_classes >= 0, f"--kl-classes must be ≥ 0, got {self.kl_classes}")
        require(self.epochs >= 1, f"--epochs must be ≥ 1, got {self.epochs}")
        require(self.lr >= 0, f"--lr must be ≥ 0 (0 = default), got {self.lr}")
        require(self.batch_size >= 0, f"--batch-size must be ≥ 0 (0 = default), got {self.batch_size}")
        require(
            self.subset in (s.value for s in Subset),
            f"--subset must be last-layer or all, got '{self.subset}'",
        )

    def resolve(self, subset: Subset) -> FSVIConfig:
        """A checked copy with every ``0`` meaning "default" replaced by ``subset``'s default."""
        self.check()
        defaults = {k: v for k, v in MODE_DEFAULTS[subset].items() if not getattr(self, k)}
        return replace(self, **defaults)


# ---------------------------------------------------------------------------------------------
# the function-space KL
# ---------------------------------------------------------------------------------------------


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


class _GramLogDet(torch.autograd.Function):
    """``log|Φ̃ diag(s_k) Φ̃ᵀ + jI|`` for every row ``s_k`` of ``s [K, D']`` → ``[K]``.

    The Gram matrices come from one GEMM with the pairwise products ``pairs [T, D']``
    (``pairs[t] = φ̃_a ⊙ φ̃_b`` over the ``T = C(C+1)/2`` pairs ``a ≤ b``); the backward uses
    ``∂ log|K| / ∂K = K⁻¹`` from the saved Cholesky factors, which is cheaper than
    differentiating through the factorisation.
    """

    @staticmethod
    def forward(ctx, s, pairs, jitter, rows, cols, size):  # noqa: ANN001, ANN205 (autograd API)
        gram = s.new_zeros(s.shape[0], size, size)
        tri = s @ pairs.T  # [K, T]
        gram[:, rows, cols] = tri
        gram[:, cols, rows] = tri
        gram.diagonal(dim1=1, dim2=2).add_(jitter)
        with _one_thread():
            chol, info = torch.linalg.cholesky_ex(gram)
        if bool((info != 0).any()):
            raise BayescliError(
                "the variational kernel on the context points is not positive definite; "
                "lower --lr or --head-var-init"
            )
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
        return grad_s, grad_pairs, None, None, None, None


def function_kl(
    feat_q: torch.Tensor,
    mean_q: torch.Tensor,
    var_q: torch.Tensor,
    prior_var: float,
    feat_p: torch.Tensor | None = None,
    mean_p: torch.Tensor | None = None,
    jitter: float = JITTER,
    classes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Σ_k KL(N(mean_q[:,k], Φ̃_q diag(var_q[k]) Φ̃_qᵀ + jI) ‖ N(mean_p[:,k], σ_p² Φ̃_p Φ̃_pᵀ + jI))``.

    ``feat_q [C, D']`` are q's context features (with a column of ones when the head has a bias,
    its variance the last column of ``var_q [K, D']``), ``mean_q [C, K]`` q's mean logits,
    ``feat_p [C, D']`` the prior's features (default ``feat_q``), ``mean_p [C, K]`` its mean
    logits (default 0), ``prior_var`` ``σ_p²``. ``j = jitter · mean diag(σ_p² Φ̃_p Φ̃_pᵀ)`` in both
    kernels. ``classes`` (indices) restricts the log-determinants of q to those classes, scaled
    by ``K / len(classes)``. The ``C × C`` algebra runs in ``feat_q``'s dtype (pass float64);
    ``mean_q``/``var_q`` may be float32 parameters. Returns a scalar.
    """
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
    if int(info) != 0:
        raise BayescliError("the prior kernel on the context points is singular; use another --context")
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
    logdet_q = _GramLogDet.apply(var_rows, pairs, jit, rows, cols, c).sum() * (k / var_rows.shape[0])
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


def _head_moments(phi: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, bias: bool) -> tuple:
    """Logit mean and variance ``([N, K], [N, K])`` of a mean-field head (rows of ``mean``/``var``)."""
    if not bias:
        return phi @ mean.T, phi.square() @ var.T
    return torch.addmm(mean[:, -1], phi, mean[:, :-1].T), torch.addmm(var[:, -1], phi.square(), var[:, :-1].T)


def _mc_nll(mean: torch.Tensor, var: torch.Tensor, labels: torch.Tensor, samples: int, seed: int) -> float:
    """NLL of ``E[softmax(z)]``, ``z ~ N(mean, diag var)``, by ``samples`` seeded draws."""
    gen = torch.Generator(device=mean.device).manual_seed(seed)
    total = 0.0
    for start in range(0, len(mean), 1024):
        sl = slice(start, start + 1024)
        eps = torch.randn((samples, *mean[sl].shape), generator=gen, dtype=mean.dtype, device=mean.device)
        probs = (mean[sl] + var[sl].sqrt() * eps).softmax(-1).mean(0)
        total -= probs.gather(1, labels[sl, None]).clamp_min(1e-12).log().sum().item()
    return total / len(mean)


# ---------------------------------------------------------------------------------------------
# context distributions
# ---------------------------------------------------------------------------------------------


def monochrome(data: ArrayData, num: int, generator: torch.Generator) -> torch.Tensor:
    """``num`` monochrome images ``[num, C, H, W]`` in pixel space (seed App. D.8).

    Channel ``c`` of each image is filled with one value drawn from the pooled pixel values of
    channel ``c`` over all of ``data`` (a uniform (image, pixel) pair: every image has the same
    number of pixels). Flat inputs ``[D]``: uniform in ``[min, max]`` of the data per dimension.
    """
    if len(data.input_shape) != 3:
        x = data.inputs(slice(None)).flatten(1)
        return _uniform_box(x.min(0).values, x.max(0).values, num, data.input_shape, generator)
    c, h, w = data.input_shape
    image = torch.randint(len(data), (num, c), generator=generator)
    pixel = torch.randint(h * w, (num, c), generator=generator)
    values = data.x.reshape(len(data), c, h * w)[image, torch.arange(c), pixel]
    values = values.float() / 255.0 if data.x.dtype == torch.uint8 else values.float()
    return values[:, :, None, None].expand(num, c, h, w).contiguous()


def _uniform_box(
    lo: torch.Tensor, hi: torch.Tensor, num: int, shape: tuple[int, ...], generator: torch.Generator
) -> torch.Tensor:
    """``num`` draws ``[num, *shape]`` uniform in the box ``[lo, hi]`` (flat ``[D]`` bounds)."""
    return (lo + torch.rand(num, len(lo), generator=generator) * (hi - lo)).reshape(num, *shape)


def augment_images(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random horizontal flip (p = ½), rotation (±``AUG_MAX_ROTATION``°) and shift (up to
    ``AUG_MAX_SHIFT`` of the side) of images ``[N, C, H, W]``, bilinear with zero fill."""
    if x.dim() != 4:
        raise BayescliError(f"--context augment needs image inputs [C, H, W], got {list(x.shape[1:])}")
    n = len(x)
    flip = torch.rand(n, generator=generator) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    angle = (2 * torch.rand(n, generator=generator) - 1) * math.radians(AUG_MAX_ROTATION)
    shift = (2 * torch.rand(n, 2, generator=generator) - 1) * 2 * AUG_MAX_SHIFT  # grid spans [−1, 1]
    cos, sin = angle.cos(), angle.sin()
    theta = torch.stack(
        [torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1
    )
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


class ContextSampler:
    """Draws context inputs in pixel space ``[n, *input_shape]`` from ``p_Xc`` (see FSVIConfig)."""

    def __init__(
        self, cfg: FSVIConfig, train: ArrayData, preprocess: Preprocess | None, generator: torch.Generator
    ) -> None:
        self.kind, self.train = cfg.context, train
        self.pool: ArrayData | None = None
        self.box: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.context == "monochrome" and len(train.input_shape) != 3:
            x = train.inputs(slice(None)).flatten(1)  # flat inputs: the training range, found once
            self.box = x.min(0).values, x.max(0).values
        elif cfg.context == "augment":
            require(len(train.input_shape) == 3, "--context augment needs image inputs [C, H, W]")
        elif cfg.context != "monochrome":
            pool = load_data(cfg.context, cfg.context_root, limit=cfg.context_pool, seed=cfg.seed,
                             preprocess=preprocess)  # fmt: skip
            if pool.input_shape != train.input_shape:
                raise BayescliError(
                    f"context {cfg.context} has inputs of shape {list(pool.input_shape)} but the training "
                    f"data {list(train.input_shape)}; use a context set of the same shape"
                )
            self.pool = pool
        self.generator = generator

    def __call__(self, num: int) -> torch.Tensor:
        gen = self.generator
        if self.box is not None:
            return _uniform_box(*self.box, num, self.train.input_shape, gen)
        if self.kind == "monochrome":
            return monochrome(self.train, num, gen)
        source = self.pool if self.pool is not None else self.train
        x = source.inputs(torch.randint(len(source), (num,), generator=gen))
        return augment_images(x, gen) if self.kind == "augment" else x


# ---------------------------------------------------------------------------------------------
# the posterior
# ---------------------------------------------------------------------------------------------


@dataclass
class FSVIPosterior(Posterior):
    """Mean-field Gaussian ``N(mean, diag var)`` trained by FSVI.

    ``last-layer``: ``mean``/``var`` ``[K, D(+1)]`` over ``W̃ = [W, b]`` (bias column last when
    ``head_bias``). ``all``: flat ``[P]`` over the network's parameters in ``named_parameters``
    order, ``parameters`` listing ``[name, shape]``. ``prior_var`` is the head prior ``σ_p²``,
    ``prior_scale`` its ``c``.
    """

    mean: torch.Tensor
    var: torch.Tensor
    subset: Subset
    head_bias: bool
    prior_var: float
    prior_scale: float
    hyperparameters: dict = field(default_factory=dict)
    parameters: list | None = None
    meta: dict = field(default_factory=dict)

    method: ClassVar[str] = "fsvi"

    @property
    def predictive(self) -> str:
        return "exact-last-layer" if self.subset is Subset.LAST_LAYER else "glm"

    # -- predictives --------------------------------------------------------------------------

    def logit_gaussian(self, phi: torch.Tensor) -> LogitGaussian:
        """Exact logits ``N(M̃ φ̃, diag(s̃ φ̃²))`` ``[N, K]`` for features ``phi [N, D]``."""
        if self.subset is not Subset.LAST_LAYER:
            raise BayescliError("this FSVI posterior covers all layers; predict from inputs")
        d = self.mean.shape[1] - int(self.head_bias)
        if phi.dim() != 2 or phi.shape[1] != d:
            raise BayescliError(f"features of shape {list(phi.shape)} do not fit a head with {d} inputs")
        mean, var = _head_moments(phi.to(self.mean.dtype), self.mean, self.var, self.head_bias)
        return LogitGaussian(mean, var, exact=True)

    def _check_network(self, classifier: Classifier) -> None:
        shapes = [[n, list(p.shape)] for n, p in classifier.net.named_parameters()]
        if self.parameters is not None and shapes != self.parameters:
            raise BayescliError(
                "the network's parameters differ from the posterior's; load the checkpoint written with it"
            )

    def logit_gaussian_inputs(self, classifier: Classifier, x: torch.Tensor) -> LogitGaussian:
        """GLM logits ``N(f(x; μ), J diag(σ²) Jᵀ)`` for pixel-space ``x [N, ...]`` (``all`` only).

        ``classifier`` must carry the posterior means as its weights (the checkpoint that
        :func:`train_fsvi` wrote); its Jacobians are taken in chunks of inputs.
        """
        if self.subset is Subset.LAST_LAYER:
            raise BayescliError("this FSVI posterior covers the last layer; predict from features")
        self._check_network(classifier)
        net, var = classifier.net, self.var
        xn = classifier.normalise(x)
        chunk = max(1, JACOBIAN_ELEMENTS // (classifier.num_classes * var.numel()))
        means, covs = [], []
        for start in range(0, len(xn), chunk):
            f, jac = network_jacobian(net, xn[start : start + chunk])
            means.append(f)
            covs.append(torch.einsum("nkp,p,nlp->nkl", jac, var.to(jac.dtype), jac))
        cov = torch.cat(covs)
        return LogitGaussian(torch.cat(means), cov.diagonal(dim1=1, dim2=2).clone(), cov, exact=False)

    def sample_logits(
        self,
        num: int,
        classifier: Classifier,
        x: torch.Tensor | None,
        phi: torch.Tensor | None,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """BNN predictive [001:(18)]: logits ``[M, N, K]`` of the network at ``M`` draws from ``q``
        (weights drawn in chunks of at most ``JACOBIAN_ELEMENTS`` numbers)."""
        std, chunk = self.var.sqrt(), max(1, JACOBIAN_ELEMENTS // self.mean.numel())

        def draws() -> Iterator[torch.Tensor]:
            for m in range(0, num, chunk):
                shape = (min(chunk, num - m), *self.mean.shape)
                yield self.mean + std * torch.randn(shape, generator=generator, dtype=self.mean.dtype)

        if self.subset is Subset.LAST_LAYER:
            phi_aug = (augment(phi) if self.head_bias else phi).to(self.mean.dtype)
            return torch.cat([torch.einsum("nd,mkd->mnk", phi_aug, w) for w in draws()])
        from torch.func import functional_call

        self._check_network(classifier)
        xn = classifier.normalise(x)
        out = []
        for theta in (t for block in draws() for t in block):
            params, offset = {}, 0
            for name, shape in self.parameters:
                size = math.prod(shape)
                params[name] = theta[offset : offset + size].reshape(shape)
                offset += size
            with torch.no_grad():
                out.append(functional_call(classifier.net, params, (xn,)))
        return torch.stack(out)

    def head_marginal(self, classifier: Classifier) -> FSVIPosterior:
        """The head block of an ``all`` posterior as a ``last-layer`` one (features at the means).

        Exact for the network whose feature weights are fixed at their means; the feature
        variances (``exp(feature_logvar_init)`` ≈ 2e−9 and shrinking, VI-SPEC B6.2) are dropped.
        """
        if self.subset is Subset.LAST_LAYER:
            return self
        self._check_network(classifier)
        head = classifier.head_name
        blocks, offset = {}, 0
        for name, shape in self.parameters:
            size = math.prod(shape)
            blocks[name] = (offset, size, shape)
            offset += size

        def block(t: torch.Tensor, name: str) -> torch.Tensor:
            start, size, shape = blocks[name]
            return t[start : start + size].reshape(shape)

        parts = [f"{head}.weight"] + ([f"{head}.bias"] if self.head_bias else [])
        mean = torch.cat([block(self.mean, n).reshape(len(block(self.mean, parts[0])), -1) for n in parts], 1)
        var = torch.cat([block(self.var, n).reshape(len(block(self.var, parts[0])), -1) for n in parts], 1)
        meta = {**self.meta, "head_marginal_of": "all"}
        return FSVIPosterior(
            mean, var, Subset.LAST_LAYER, self.head_bias, self.prior_var, self.prior_scale,
            dict(self.hyperparameters), None, meta,
        )  # fmt: skip

    # -- files --------------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "var": self.var}

    def own_metadata(self) -> dict:
        own = {
            "head_bias": self.head_bias,
            "prior_var": self.prior_var,
            "prior_scale": self.prior_scale,
            "predictive": self.predictive,
            "exact": self.subset is Subset.LAST_LAYER,
            "hyperparameters": self.hyperparameters,
        }
        if self.parameters is not None:
            own["parameters"] = self.parameters
        return own

    @classmethod
    def from_file(cls, tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> FSVIPosterior:
        mean, var = tensors["mean"], tensors["var"]
        if mean.shape != var.shape:
            raise ValueError(f"mean {list(mean.shape)} and var {list(var.shape)} differ")
        return cls(
            mean,
            var,
            Subset(meta["subset"]),
            bool(meta["head_bias"]),
            float(meta["prior_var"]),
            float(meta["prior_scale"]),
            dict(meta.get("hyperparameters", {})),
            meta.get("parameters"),
            cls.provenance(meta, _OWN_KEYS),
        )


_OWN_KEYS = {"head_bias", "prior_var", "prior_scale", "predictive", "exact", "hyperparameters", "parameters"}


# ---------------------------------------------------------------------------------------------
# post hoc: the last layer on frozen features
# ---------------------------------------------------------------------------------------------


def _check_fit_data(phi: torch.Tensor, labels: torch.Tensor | None, k: int, what: str) -> None:
    if labels is None:
        raise BayescliError(f"FSVI needs labelled {what} data")
    if not torch.isfinite(phi).all():
        raise BayescliError(f"{what} features contain NaN or inf; check the inputs and the checkpoint")
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= k):
        raise BayescliError(f"{what} labels must lie in 0..{k - 1} for a {k}-class head")


def laplace_diag_variance(
    phi: torch.Tensor, mean: torch.Tensor, prior_var: float, bias: bool
) -> torch.Tensor:
    """``1 / (Σ_n p_nk(1 − p_nk) φ̃_nd² + 1/σ_p²)`` ``[K, D']`` for features ``phi [N, D]``: the
    diagonal-GGN Laplace variances of the head at ``mean`` (VI-SPEC B4's alternative init)."""
    h = torch.zeros_like(mean)
    for start in range(0, len(phi), 4096):
        rows = phi[start : start + 4096]
        p = (torch.addmm(mean[:, -1], rows, mean[:, :-1].T) if bias else rows @ mean.T).softmax(-1)
        sq = augment(rows.square()) if bias else rows.square()  # φ̃² (the bias column is 1)
        h += (p * (1 - p)).T @ sq
    return 1.0 / (h + 1.0 / prior_var)


def _fit_head(
    phi: torch.Tensor,
    labels: torch.Tensor,
    init: torch.Tensor,
    context: torch.Tensor,
    prior_var: float,
    bias: bool,
    cfg: FSVIConfig,
) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """Adam on ``(M̃, log s̃)`` from ``init`` and the initial variances; returns mean, var, curve."""
    n, k = len(phi), init.shape[0]
    began = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)  # batches, context draws, classes
    noise = torch.Generator(device=phi.device).manual_seed(cfg.seed)  # logit draws
    mean = init.to(phi.dtype).clone().requires_grad_(True)
    if cfg.head_var_init > 0:
        init_var = torch.full_like(mean, cfg.head_var_init * prior_var)
    else:
        init_var = laplace_diag_variance(phi, mean.detach(), prior_var, bias)
    logvar = init_var.log().requires_grad_(True)
    opt = torch.optim.Adam([mean, logvar], lr=cfg.lr, fused=True)
    steps = math.ceil(n / cfg.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * steps)
    ctx = (augment(context) if bias else context).double()
    c = min(cfg.context_points, len(ctx))
    subsample = 0 < cfg.kl_classes < k
    curve = []
    for epoch in track(range(cfg.epochs), cfg.epochs, "fitting FSVI head"):
        perm = torch.randperm(n, generator=gen)
        sums = {"objective": 0.0, "nll": 0.0, "kl": 0.0}
        for start in range(0, n, cfg.batch_size):
            idx = perm[start : start + cfg.batch_size]
            var = logvar.exp()
            # φ̃ of the batch, not column slices of the parameters: slices cost [K, D]-sized
            # copies forward and zero-filled scatters backward.
            phi_b = augment(phi[idx]) if bias else phi[idx]
            mu_b, v_b = phi_b @ mean.T, phi_b.square() @ var.T
            nll = expected_nll(mu_b, v_b, labels[idx], cfg.samples, noise)
            feats = ctx[torch.randperm(len(ctx), generator=gen)[:c]]
            classes = torch.randperm(k, generator=gen)[: cfg.kl_classes] if subsample else None
            kl = function_kl(feats, feats.to(mean.dtype) @ mean.T, var, prior_var, classes=classes)
            loss = nll + kl.to(nll.dtype) / n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            for key, value in (("objective", loss), ("nll", nll), ("kl", kl)):
                sums[key] += value.item() * len(idx) / n
        curve.append({"epoch": epoch + 1, **sums, "seconds": time.perf_counter() - began})
    return mean.detach(), logvar.detach().exp(), curve


def fit_last_layer(
    phi: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Linear,
    context_phi: torch.Tensor,
    cfg: FSVIConfig,
    val_phi: torch.Tensor | None = None,
    val_labels: torch.Tensor | None = None,
) -> FSVIPosterior:
    """Post-hoc FSVI on frozen features: ``phi [N, D]`` with ``labels [N]``, a context pool
    ``context_phi [M, D]``, the MAP ``head`` as the initial mean; validation features for
    ``cfg.select``. Runs on ``phi``'s device and dtype."""
    cfg = cfg.resolve(Subset.LAST_LAYER)
    start = time.perf_counter()
    k = head.out_features
    _check_fit_data(phi, labels, k, "fitting")
    if len(context_phi) == 0 or not torch.isfinite(context_phi).all():
        raise BayescliError("the context features are empty or not finite; check --context")
    bias = head.bias is not None
    init = head_parameters(head).to(phi.device)
    norm = float((augment(phi) if bias else phi).double().square().sum(1).mean())
    require(norm > 0, "the fitting features are all zero; check the checkpoint and --head")
    grid = PRIOR_SCALE_GRID[Subset.LAST_LAYER]
    scales = grid if cfg.select else (cfg.prior_scale,)
    if cfg.select:
        if val_phi is None or val_labels is None:
            raise BayescliError("--select needs labelled validation data (--val-data)")
        _check_fit_data(val_phi, val_labels, k, "validation")
    best, selection = None, []
    for c in scales:
        mean, var, curve = _fit_head(phi, labels, init, context_phi.to(phi), c / norm, bias, cfg)
        score = None
        if cfg.select:
            mu, v = _head_moments(val_phi.to(mean), mean, var, bias)
            score = _mc_nll(mu, v, val_labels.to(mean.device), VAL_SAMPLES, cfg.seed)
            selection.append({"prior_scale": c, "val_nll": score})
        if best is None or (score is not None and score < best[0]):
            best = (score, c, mean, var, curve)
    _, c, mean, var, curve = best
    used = asdict(replace(cfg, prior_scale=c))
    post = FSVIPosterior(mean.cpu(), var.cpu(), Subset.LAST_LAYER, bias, c / norm, c, used)
    post.meta |= {
        "fit_seconds": time.perf_counter() - start,
        "n_data": len(phi),
        "feature_norm_sq": norm,
        "context_pool": len(context_phi),
        "training_curve": curve,
    }
    if cfg.select:
        post.meta["selection"] = {"grid": list(grid), "curve": selection, "criterion": "val_nll"}
    return post


def fit_fsvi(
    model: LoadedModel,
    train: ArrayData,
    val: ArrayData | None,
    cfg: FSVIConfig,
    device: torch.device,
    batch_size: int = 256,
) -> FSVIPosterior:
    """Post-hoc last-layer FSVI on a pretrained checkpoint (``cfg.subset == "last-layer"``).

    Extracts features of ``train``, ``val`` (for ``select``) and ``context_pool`` context
    inputs drawn once from ``cfg.context`` (all through the same backbone), then fits the head.
    """
    cfg.check()
    if Subset(cfg.subset) is not Subset.LAST_LAYER:
        raise BayescliError(
            "post-hoc FSVI fits the last layer; train all layers with `bayescli train --method fsvi`"
        )
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)
    feats = extract_features(model, train, batch_size, device)
    sampler = ContextSampler(cfg, train, model.preprocess, gen)
    pool = ArrayData(
        sampler(cfg.context_pool),
        None,
        train.class_names,
        {"spec": f"fsvi-context:{cfg.context}", "n": cfg.context_pool, "seed": cfg.seed},
    )
    ctx = extract_features(model, pool, batch_size, device)
    val_feats = extract_features(model, val, batch_size, device) if cfg.select and val is not None else None
    head = model.classifier.head
    post = fit_last_layer(
        feats.phi.to(device),
        feats.labels.to(device) if feats.labels is not None else None,
        head,
        ctx.phi.to(device),
        cfg,
        None if val_feats is None else val_feats.phi.to(device),
        None if val_feats is None else val_feats.labels.to(device),
    )
    post.meta["fit_seconds"] = time.perf_counter() - start
    post.meta["feature_seconds"] = feats.seconds + ctx.seconds
    return post


# ---------------------------------------------------------------------------------------------
# from scratch: all layers
# ---------------------------------------------------------------------------------------------


class _StopAtHead(Exception):
    """Raised by a hook once the head's input is known."""


def _features(clf: Classifier, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Head input ``φ(x; params)`` ``[N, D]`` for pixel-space ``x`` under substituted parameters."""
    from torch.func import functional_call

    captured: list[torch.Tensor] = []

    def grab(_module: nn.Module, args: tuple) -> None:
        captured.append(args[0])
        raise _StopAtHead

    handle = clf.head.register_forward_pre_hook(grab)
    try:
        functional_call(clf.net, params, (clf.normalise(x),))
    except _StopAtHead:
        pass
    finally:
        handle.remove()
    return captured[0]


class WholeNetQ:
    """``q = N(μ, diag exp(logvar))`` over every parameter of ``clf`` (``μ`` = its parameters), the
    prior net ``prior`` (``θ0``, the linearisation point of p) and the head prior ``σ_p²``."""

    def __init__(self, clf: Classifier, prior: Classifier, logvar: dict[str, torch.Tensor], prior_var: float):
        self.clf, self.prior, self.logvar, self.prior_var = clf, prior, logvar, prior_var
        self.params = dict(clf.net.named_parameters())
        self.bias = clf.head.bias is not None
        head = clf.head_name
        self.head_names = [f"{head}.weight"] + ([f"{head}.bias"] if self.bias else [])

    def head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Head mean and variance ``([K, D'], [K, D'])`` (bias column last)."""
        mean = [self.params[n].reshape(self.params[n].shape[0], -1) for n in self.head_names]
        var = [self.logvar[n].exp().reshape(self.params[n].shape[0], -1) for n in self.head_names]
        return torch.cat(mean, 1), torch.cat(var, 1)

    def features(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Features ``[N, D]`` of ``x`` under one draw of the feature parameters (R = 1)."""
        sampled = {
            name: p if name in self.head_names
            else p + (0.5 * self.logvar[name]).exp() * torch.randn(p.shape, generator=generator).to(p)
            for name, p in self.params.items()
        }  # fmt: skip
        return _features(self.clf, sampled, x)

    def kl(self, h_q: torch.Tensor, x_c: torch.Tensor) -> torch.Tensor:
        """Function-space KL at context inputs ``x_c`` whose sampled features are ``h_q [C, D]``:
        q's head Gaussian on ``h_q`` vs the prior net's features and logits (float64)."""
        with torch.no_grad():
            h_p = self.prior.features(x_c)
            m_p = self.prior.head(h_p)
        m_head, v_head = self.head()
        f_q = (augment(h_q) if self.bias else h_q).double()
        f_p = (augment(h_p) if self.bias else h_p).double()
        return function_kl(f_q, f_q @ m_head.double().T, v_head, self.prior_var, f_p, m_p)

    def terms(
        self,
        xb: torch.Tensor,
        yb: torch.Tensor,
        x_ctx: torch.Tensor,
        batch_context: int,
        samples: int,
        generator: torch.Generator,
        noise: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expected NLL of the batch and the KL on ``[xb[:batch_context]; x_ctx]``, both from one
        feature sample (a joint forward pass)."""
        nb, b = min(batch_context, len(xb)), len(xb)
        x_all = torch.cat([xb, x_ctx])
        h_all = self.features(x_all, generator)
        m_head, v_head = self.head()
        mu_b, v_b = _head_moments(h_all[:b], m_head, v_head, self.bias)
        nll = expected_nll(mu_b, v_b, yb, samples, noise)
        kl = self.kl(torch.cat([h_all[:nb], h_all[b:]]), torch.cat([x_all[:nb], x_all[b:]]))
        return nll, kl


def _train_all(
    spec: ModelSpec,
    train: ArrayData,
    cfg: FSVIConfig,
    prior_scale: float,
    device: torch.device,
) -> tuple[Classifier, torch.Tensor, float, list[dict]]:
    """One from-scratch FSVI run; returns the classifier (means), flat variances, σ_p², curve."""
    began = time.perf_counter()
    torch.manual_seed(cfg.seed)
    k, n = train.num_classes, len(train)
    net = build_network(spec, k, train.input_shape, {})
    mean, std = channel_stats(train)
    clf = Classifier(net, last_linear_name(net), mean, std).to(device)
    prior = copy.deepcopy(clf).eval().requires_grad_(False)  # θ0: the linearisation point of p
    bias = clf.head.bias is not None
    with torch.no_grad():
        h0 = prior.features(train.inputs(slice(0, PRIOR_NORM_ROWS)).to(device))
        prior_var = prior_scale / float((h0.double().square().sum(1) + int(bias)).mean())
    logvar = {
        name: torch.full_like(p, cfg.feature_logvar_init).requires_grad_(True)
        for name, p in clf.net.named_parameters()
    }
    q = WholeNetQ(clf, prior, logvar, prior_var)
    with torch.no_grad():
        head_logvar = math.log(cfg.head_var_init * prior_var)
        for name in q.head_names:
            logvar[name].fill_(head_logvar)
    opt = torch.optim.Adam([*q.params.values(), *logvar.values()], lr=cfg.lr)
    steps = math.ceil(n / cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=cfg.lr, total_steps=cfg.epochs * steps, pct_start=0.15
    )
    gen = torch.Generator().manual_seed(cfg.seed)  # batches, context draws, weight noise
    noise = torch.Generator(device=device).manual_seed(cfg.seed)  # logit draws
    sampler = ContextSampler(cfg, train, None, gen)
    curve = []
    for epoch in track(range(cfg.epochs), cfg.epochs, f"training {spec} (FSVI)"):
        clf.train()
        perm = torch.randperm(n, generator=gen)
        sums = {"objective": 0.0, "nll": 0.0, "kl": 0.0}
        for start in range(0, n, cfg.batch_size):
            idx = perm[start : start + cfg.batch_size]
            xb, yb = train.inputs(idx).to(device), train.y[idx].to(device)
            x_ctx = sampler(cfg.context_points).to(device)
            nll, kl = q.terms(xb, yb, x_ctx, cfg.batch_context_points, cfg.samples, gen, noise)
            loss = nll + kl.to(nll.dtype) / n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            for key, value in (("objective", loss), ("nll", nll), ("kl", kl)):
                sums[key] += value.item() * len(idx) / n
        curve.append({"epoch": epoch + 1, **sums, "seconds": time.perf_counter() - began})
    clf.eval()
    var = torch.cat([logvar[name].detach().exp().reshape(-1) for name in q.params])
    return clf, var, prior_var, curve


def train_fsvi(
    model_spec: str,
    train: ArrayData,
    val: ArrayData | None,
    cfg: FSVIConfig,
    device: torch.device,
) -> tuple[Classifier, dict, FSVIPosterior]:
    """FSVI from scratch on a builtin net: mean-field over all parameters, one feature sample per
    step, prior = the net linearised about a fixed random initialisation, context = batch points
    plus ``p_Xc`` draws. Returns the classifier (means as weights), checkpoint metadata in
    :func:`bayescli.train.train_classifier`'s format, and the ``all`` posterior."""
    cfg = replace(cfg, subset=Subset.ALL.value).resolve(Subset.ALL)  # always all layers
    spec = ModelSpec.parse(model_spec)
    if spec.kind != "builtin":
        raise BayescliError(f"FSVI trains builtin models only ({', '.join(builtin_names())}); got {spec}")
    if train.y is None:
        raise BayescliError(f"{train.spec} has no labels; training needs labelled data")
    device = torch.device(device)
    start = time.perf_counter()
    grid = PRIOR_SCALE_GRID[Subset.ALL]
    scales = grid if cfg.select else (cfg.prior_scale,)
    if cfg.select and (val is None or val.y is None):
        raise BayescliError("--select needs labelled validation data (--val-data)")
    best, selection = None, []
    for c in scales:
        clf, var, prior_var, curve = _train_all(spec, train, cfg, c, device)
        score = None
        if cfg.select:
            post = _all_posterior(clf, var, prior_var, c, cfg).head_marginal(clf)
            with torch.no_grad():
                phi = torch.cat([clf.features(xb.to(device)) for xb, _ in val.batches(512)])
            mu, v = _head_moments(phi, post.mean.to(phi), post.var.to(phi), post.head_bias)
            score = _mc_nll(mu, v, val.y.to(device), VAL_SAMPLES, cfg.seed)
            selection.append({"prior_scale": c, "val_nll": score})
        if best is None or (score is not None and score < best[0]):
            best = (score, c, clf, var, prior_var, curve)
    _, c, clf, var, prior_var, curve = best
    post = _all_posterior(clf, var, prior_var, c, cfg)
    post.meta |= {"fit_seconds": time.perf_counter() - start, "n_data": len(train), "training_curve": curve}
    if cfg.select:
        post.meta["selection"] = {"grid": list(grid), "curve": selection, "criterion": "val_nll"}
    clf = clf.cpu()
    post.mean, post.var = post.mean.cpu(), post.var.cpu()
    normalisation = (clf.mean.tolist(), clf.std.tolist())
    training = {"method": "fsvi", **post.hyperparameters}
    loss = [row["objective"] for row in curve]
    meta = checkpoint_metadata(spec, clf, train, val, torch.device("cpu"), normalisation, training, loss)
    return clf, meta, post


def _all_posterior(
    clf: Classifier, var: torch.Tensor, prior_var: float, prior_scale: float, cfg: FSVIConfig
) -> FSVIPosterior:
    mean = torch.cat([p.detach().reshape(-1) for p in clf.net.parameters()])
    shapes = [[n, list(p.shape)] for n, p in clf.net.named_parameters()]
    used = asdict(replace(cfg, prior_scale=prior_scale))
    return FSVIPosterior(
        mean, var, Subset.ALL, clf.head.bias is not None, prior_var, prior_scale, used, shapes
    )
