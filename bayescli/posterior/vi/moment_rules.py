"""Moment rules of single operations on independent Gaussian units (VI-SPEC C1, [002] §3.3).

Each rule maps the per-unit ``mean``/``var`` of its inputs to those of its output; a ``var`` of
``None`` marks an exactly deterministic tensor. The rules and their derivations are listed in
:mod:`bayescli.posterior.vi.moments`, which applies them along a traced forward pass; they are
usable on their own (tests check each against an independent oracle).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import jvp

from bayescli.errors import BayescliError

# Against 0/0 in μ/σ when v = 0 only: far below any variance that matters (the ReLU rule in
# :mod:`bayescli.posterior.vi.moments` needs no larger floor).
_TINY_VAR = 1e-30
# |μ/σ| beyond 38 leaves Φ exactly 0 or 1 in float64; clamping keeps r² finite in float32.
_R_MAX = 38.0
_LOG_INV_SQRT_2PI = -0.5 * math.log(2.0 * math.pi)
_SQRT_HALF = math.sqrt(0.5)


@dataclass
class Moments:
    """Per-unit ``mean`` and ``var`` of a random tensor (``var=None``: exactly deterministic)."""

    mean: torch.Tensor
    var: torch.Tensor | None = None

    def variance(self) -> torch.Tensor:
        """The variance as a tensor (zeros when deterministic)."""
        return torch.zeros_like(self.mean) if self.var is None else self.var


# ---------------------------------------------------------------------------------------------
# the rules (functions of moments; usable on their own)
# ---------------------------------------------------------------------------------------------


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def relu_moments(mean: torch.Tensor, var: torch.Tensor | None) -> Moments:
    """Exact mean and variance of ``ReLU(Z)``, ``Z ~ N(mean, var)`` elementwise [002:(11)].

    ``V = σ² g(r)``, ``r = μ/σ``, ``g = Φ(r²(1−Φ) + 1) + φ(r(1−2Φ) − φ)`` (derived in
    :mod:`bayescli.posterior.vi.moments`). ``1 − Φ`` loses relative precision for r ≫ 0, but it
    only enters ``g`` times r² next to ``Φ ≈ 1``, so the absolute error of ``g`` stays ≤ r²·eps.
    Without autograd the temporaries are reused in place: on CPU, fresh large buffers (page
    faults) cost more than the arithmetic.
    """
    if var is None:
        return Moments(torch.relu(mean), None)
    vc = var.clamp_min(_TINY_VAR)
    sd = vc.sqrt()
    r = torch.div(mean, sd).clamp_(-_R_MAX, _R_MAX)
    cdf = torch.mul(r, -_SQRT_HALF).erfc_().mul_(0.5)  # Φ(r); erfc is 15× faster than ndtr
    pdf = torch.square(r).mul_(-0.5).add_(_LOG_INV_SQRT_2PI).exp_()
    if _needs_grad(mean, var):
        e = torch.addcmul(mean * cdf, sd, pdf)
        ccdf = 1 - cdf
        g = torch.addcmul(cdf, cdf, r.square() * ccdf)
        g = torch.addcmul(g, pdf, torch.addcmul(-pdf, r, ccdf - cdf))
        return Moments(e, vc * g.clamp_min(0))
    e = torch.mul(mean, cdf).addcmul_(sd, pdf)
    ccdf = sd.fill_(1).sub_(cdf)  # σ is no longer needed
    g = torch.mul(r, ccdf).mul_(r).add_(1).mul_(cdf)  # Φ(r²(1−Φ) + 1)
    g.add_(ccdf.sub_(cdf).mul_(r).sub_(pdf).mul_(pdf))  # + φ(r(1−2Φ) − φ)
    return Moments(e, vc.mul_(g.clamp_min_(0)))


def taylor_moments(
    fn: Callable[[torch.Tensor], torch.Tensor], mean: torch.Tensor, var: torch.Tensor | None
) -> Moments:
    """First-order moments of an elementwise ``fn`` [002:(12)]: ``E = f(μ)``, ``V = f'(μ)² v``."""
    if var is None:
        return Moments(fn(mean), None)
    # A clone, so that an in-place activation cannot overwrite a mean used elsewhere.
    out, slope = jvp(fn, (mean.clone(),), (torch.ones_like(mean),))
    return Moments(out, slope.square() * var)


def _channel_view(vec: torch.Tensor, ref: torch.Tensor, channel_last: bool) -> torch.Tensor:
    """``vec [C]`` shaped to broadcast over the channel axis of ``ref``."""
    if channel_last or ref.dim() == 1:
        return vec
    return vec.view(-1, *([1] * (ref.dim() - 2)))


def affine_moments(
    op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    x: Moments,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    noise: torch.Tensor | None,
    channel_last: bool,
    weight_sq: torch.Tensor | None = None,
) -> Moments:
    """Moments of ``op(x, W, b)`` for a linear ``op`` (``F.linear`` or a convolution).

    With ``noise = a [in units]``: ``W_ij ~ N(m_ij, a_j m_ij²)`` independently [002:(5)], so
    ``v' = op((1+a)v + a x², M∘M)``; without: fixed weights, ``v' = op(v, M∘M)``.
    """
    mean = op(x.mean, weight, bias)
    w2 = weight.square() if weight_sq is None else weight_sq
    if noise is None:
        return Moments(mean, None if x.var is None else op(x.var, w2, None))
    a = _channel_view(noise, x.mean, channel_last)
    if _needs_grad(x.mean, x.var, a):
        u = a * x.mean.square()
        if x.var is not None:
            u = torch.addcmul(u, 1 + a, x.var)
    else:  # one buffer instead of three (see relu_moments)
        u = torch.square(x.mean).mul_(a)
        if x.var is not None:
            u.addcmul_(1 + a, x.var)
    return Moments(mean, op(u, w2, None))


def batchnorm_moments(
    x: Moments,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    use_batch_stats: bool,
    momentum: float,
    eps: float,
) -> Moments:
    """BatchNorm as an affine map of each channel [002:(13)] (running or batch statistics)."""
    mean = F.batch_norm(x.mean, running_mean, running_var, weight, bias, use_batch_stats, momentum, eps)
    if x.var is None:
        return Moments(mean, None)
    if use_batch_stats:
        dims = [0, *range(2, x.mean.dim())]
        denom = x.mean.var(dims, unbiased=False)
    else:
        denom = running_var
    scale2 = 1.0 / (denom + eps)
    if weight is not None:
        scale2 = weight.square() * scale2
    return Moments(mean, x.var * _channel_view(scale2, x.var, False))


def maxpool_moments(pool: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], x: Moments) -> Moments:
    """Max-pooling [002:3.3.3]: mean and variance of the window's unit with the largest mean.

    ``pool`` returns ``(output, indices)`` (``return_indices=True``), indices into the flattened
    spatial input of each ``(n, c)``.
    """
    out, idx = pool(x.mean)
    if x.var is None:
        return Moments(out, None)
    var = x.var.flatten(2).gather(2, idx.flatten(2)).view_as(out)
    return Moments(out, var)


def avgpool_moments(pool: Callable[..., torch.Tensor], x: Moments) -> Moments:
    """Average pooling with weights ``w = 1/d(window)``: ``v' = Σ_window w² v``.

    ``pool(t, divisor_override=None)`` is the layer's ``avg_pool``; ``divisor_override=1`` turns
    it into a window sum, so ``w = pool(1) / sum(1)`` covers padding, ``count_include_pad`` and
    ``ceil_mode`` alike.
    """
    mean = pool(x.mean)
    if x.var is None:
        return Moments(mean, None)
    ones = x.var.new_ones((1, 1, *x.var.shape[2:]))
    w = pool(ones) / pool(ones, divisor_override=1)
    return Moments(mean, pool(x.var, divisor_override=1) * w.square())


def _adaptive_counts(size: int, out: int) -> list[int]:
    """Window lengths of adaptive pooling ``size → out`` (PyTorch's start/end rule)."""
    return [math.ceil((i + 1) * size / out) - (i * size) // out for i in range(out)]


def adaptive_avgpool_moments(x: Moments, output_size: Any) -> Moments:
    """``adaptive_avg_pool{1,2}d``: ``v' = (mean of v over the window) / window size``."""
    spatial = x.mean.shape[2:]
    sizes = list(output_size) if isinstance(output_size, list | tuple) else [output_size] * len(spatial)
    sizes = [s if o is None else int(o) for s, o in zip(spatial, sizes, strict=True)]
    pool = F.adaptive_avg_pool2d if len(spatial) == 2 else F.adaptive_avg_pool1d
    mean = pool(x.mean, sizes)
    if x.var is None:
        return Moments(mean, None)
    counts = torch.ones((), dtype=x.var.dtype, device=x.var.device)
    for axis, (s, o) in enumerate(zip(spatial, sizes, strict=True)):
        c = torch.tensor(_adaptive_counts(s, o), dtype=x.var.dtype, device=x.var.device)
        counts = counts.unsqueeze(-1) * c if axis else c
    return Moments(mean, pool(x.var, sizes) / counts)


def sum_moments(a: Any, b: Any, sign: float) -> Any:
    if isinstance(a, Moments) and isinstance(b, Moments):
        mean = a.mean + sign * b.mean
        if a.var is None or b.var is None:
            return Moments(mean, a.var if b.var is None else b.var)
        return Moments(mean, a.var + b.var)
    if isinstance(a, Moments):
        return Moments(a.mean + sign * b, a.var)
    return Moments(a + sign * b.mean, b.var)


def product_moments(a: Any, b: Any) -> Any:
    if isinstance(a, Moments) and isinstance(b, Moments):
        # Independent product: V[XY] = v_x v_y + v_x μ_y² + v_y μ_x².
        va, vb = a.variance(), b.variance()
        return Moments(a.mean * b.mean, va * vb + va * b.mean.square() + vb * a.mean.square())
    m, c = (a, b) if isinstance(a, Moments) else (b, a)
    return Moments(m.mean * c, None if m.var is None else m.var * (c * c))


def quotient_moments(a: Any, b: Any) -> Any:
    if isinstance(b, Moments):
        raise BayescliError("MNVI moment propagation cannot divide by a random tensor; use subset last-layer")
    return Moments(a.mean / b, None if a.var is None else a.var / (b * b))


def reduce_moments(method: str, x: Moments, args: tuple, kwargs: dict) -> Moments:
    """``mean``/``sum`` over dims: sums of independent units add variances."""
    mean = getattr(x.mean, method)(*args, **kwargs)
    if x.var is None:
        return Moments(mean, None)
    var = x.var.sum(*args, **kwargs)
    if method == "mean":
        n = x.mean.numel() // max(mean.numel(), 1)
        var = var / (n * n)
    return Moments(var=var, mean=mean)
