"""Per-pixel GLM predictive of a dense (segmentation) last-layer posterior.

For carried features ``ψ = T(φ̃) [N, D, H, W]`` (:mod:`bayescli.models.dense`) the logits at pixel ``i``
are ``W̃ ψ_i``, so the pixel's logit Gaussian is the classification one for the row ``ψ_i``:
``N(W̃ ψ_i, (I ⊗ ψ_iᵀ) Σ_W (I ⊗ ψ_i))`` — computed by the posterior's structure
(:meth:`~bayescli.posterior.gaussian.WeightGaussian.push_last_layer`), pixels viewed as rows
``[N·H·W, K]`` and links applied row-wise (:func:`~bayescli.predictive.links.apply_link`).

Upsampling and the predictive. When ``T`` upsamples (``ψ_i = Σ_j w_ij φ̃_j`` over low-resolution
positions ``j``), the mean commutes: ``W̃ ψ_i = Σ_j w_ij (W̃ φ̃_j)``, the upsampled low-resolution
logit means. The covariance does *not* upsample: ``Cov f_i = Σ_{j,j'} w_ij w_ij' Cov(f_j, f_j')`` needs
the cross-covariances between the contributing positions, which interpolating the per-position
covariances ``Cov(f_j, f_j)`` ignores (it overstates the variance whenever neighbouring positions are
not perfectly correlated). The exact form is the one used here: carry ``φ̃`` to full resolution first,
then take the variance of ``W̃ ψ_i`` under the posterior — exact because the head is linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bayescli import devices
from bayescli.errors import BayescliError
from bayescli.options import DEFAULT_CORRECTION, BridgeCorrection, Link
from bayescli.posterior.base import Posterior
from bayescli.posterior.gaussian import KronGaussian, LogitGaussian
from bayescli.predictive.links import apply_link

# Pixels pushed through the posterior and the link at once: bounds the [pixels, K] (and, for the MC
# link, [pixels, K, M]-chunked) buffers whatever the image size.
PIXEL_CHUNK = 1 << 16


def to_rows(maps: torch.Tensor) -> torch.Tensor:
    """``[N, K, H, W]`` → ``[N·H·W, K]``, rows in ``(n, h, w)`` order."""
    return maps.permute(0, 2, 3, 1).reshape(-1, maps.shape[1])


def from_rows(rows: torch.Tensor, n: int, h: int, w: int) -> torch.Tensor:
    """``[N·H·W, K]`` in ``(n, h, w)`` order → ``[N, K, H, W]``."""
    return rows.reshape(n, h, w, -1).permute(0, 3, 1, 2)


def projection(posterior: Posterior) -> torch.Tensor | None:
    """``[W̃ᵀ | Q_A]`` ``[D, K + D]`` of a last-layer kron posterior, ``None`` for other posteriors.

    A kron pushforward needs only ``W̃ ψ`` and ``u = Q_Aᵀ ψ`` of each pixel's carried features ``ψ``
    (:class:`~bayescli.posterior.gaussian.KronGaussian`); both are linear in ``ψ``, so they can be
    carried through ``T`` instead of ``ψ`` (:meth:`DenseClassifier.dense_features` with ``project``),
    computed at the head's resolution: ``T(φ̃)ᵀ M = T(φ̃ᵀ M)``. What is left at full resolution is
    ``spectrum = u² · (1 / (g aᵀ + δ))ᵀ``, ``H·W·D·K`` multiplications against ``H·W·D·(2K + D)``.
    """
    gaussian = getattr(posterior, "gaussian", None)
    if posterior.needs_inputs or not isinstance(gaussian, KronGaussian):
        return None
    return torch.cat([gaussian.mean.T, gaussian.Q_A], 1)


def _projected_kron(posterior: Posterior, rows: torch.Tensor) -> LogitGaussian:
    """The logit Gaussians of projected rows ``[M, K + D]`` = ``[W̃ψ | Q_Aᵀψ]`` (see :func:`projection`)."""
    gaussian = getattr(posterior, "gaussian", None)
    if not isinstance(gaussian, KronGaussian):
        raise BayescliError(f"projected carried features serve kron posteriors only, not {posterior.label}")
    rows = rows.to(gaussian.mean.dtype)
    k = gaussian.mean.shape[0]
    spectrum = rows[:, k:].square() @ gaussian.inv_eig.T  # [M, K]
    var = spectrum @ gaussian.Q_G.square().T
    return LogitGaussian(rows[:, :k], var, basis=gaussian.Q_G, spectrum=spectrum)


def _require_last_layer(posterior: Posterior) -> None:
    if posterior.needs_inputs:
        raise BayescliError(
            f"{posterior.label} covers the whole network; dense predictives need a last-layer posterior"
        )
    if getattr(posterior, "head_bias", False):
        # carried features hold the bias channel already: a head that appends its own would count it twice
        raise BayescliError(
            f"{posterior.label} was fitted on penultimate features with a separate bias, not on a "
            "segmentation net's carried features; fit it with fit_dense_laplace"
        )


def dense_logit_gaussian(
    posterior: Posterior, carried: torch.Tensor, projected: bool = False
) -> LogitGaussian:
    """The per-pixel logit Gaussians of carried features ``carried [N, D, H, W]``, as rows
    ``[N·H·W, K]`` in ``(n, h, w)`` order (:func:`from_rows` maps its tensors back to images).
    ``projected``: ``carried`` is ``T(φ̃ᵀ projection(posterior)) [N, K + D, H, W]`` of a kron posterior."""
    _require_last_layer(posterior)
    if projected:
        return _projected_kron(posterior, to_rows(carried))
    return posterior.logit_gaussian(to_rows(carried))


@dataclass
class DensePrediction:
    """Per-pixel ``probs [N, K, H, W]``, their float64 ``log_probs``, the logit Gaussians' means and
    variances (the covariances' diagonals) ``[N, K, H, W]``, and for the MC link the samples'
    spread ``std [N, K, H, W]`` and mean entropy ``expected_entropy [N, H, W]``."""

    probs: torch.Tensor
    log_probs: torch.Tensor
    logit_mean: torch.Tensor
    logit_var: torch.Tensor
    link: str
    std: torch.Tensor | None = None
    expected_entropy: torch.Tensor | None = None


def dense_predict(
    posterior: Posterior,
    carried: torch.Tensor,
    link: Link | str = Link.PROBIT,
    samples: int = 1000,
    generator: torch.Generator | None = None,
    correction: BridgeCorrection | str = DEFAULT_CORRECTION,
    pixel_chunk: int = PIXEL_CHUNK,
    projected: bool = False,
) -> DensePrediction:
    """GLM predictive at every pixel of ``carried [N, D, H, W]`` through ``link`` (any softmax link of
    :func:`~bayescli.predictive.links.apply_link`), ``pixel_chunk`` pixels at a time. The MC link draws
    from one ``generator`` across chunks (seeded 0 on the features' device by default). ``projected``:
    as for :func:`dense_logit_gaussian`."""
    link = Link(link)
    _require_last_layer(posterior)
    n, _, h, w = carried.shape
    rows = to_rows(carried)
    gen = generator if generator is not None else devices.generator(carried.device, 0)
    parts = []
    for start in range(0, len(rows), pixel_chunk):
        chunk = rows[start : start + pixel_chunk]
        lg = _projected_kron(posterior, chunk) if projected else posterior.logit_gaussian(chunk)
        out = apply_link(lg, link, samples, gen, correction)
        parts.append((out.probs, out.log_probs, lg.mean, lg.var, out.std, out.expected_entropy))
    cols = list(zip(*parts, strict=True))

    def image(i: int) -> torch.Tensor | None:
        if cols[i][0] is None:
            return None
        return from_rows(torch.cat(cols[i]), n, h, w)

    entropy = None if cols[5][0] is None else torch.cat(cols[5]).reshape(n, h, w)
    return DensePrediction(image(0), image(1), image(2), image(3), link.value, image(4), entropy)
