"""Last-layer Laplace on the dense head of a segmentation network: pixels as rows.

At output pixel ``i`` of image ``n`` the logits are ``f = W̃ ψ`` with ``ψ = T(φ̃)[n, :, i]`` the carried
features (:mod:`bayescli.models.dense`; ``W̃ [K, C+1]``, bias column last). The per-pixel Jacobian
w.r.t. ``W̃`` is ``I_K ⊗ ψᵀ`` — that of a classification head fed ``ψ`` — and the segmentation loss
is the sum of the per-pixel cross-entropies over the pixels whose mask is not ``ignore_index``.
So every closed form of :mod:`bayescli.posterior.curvature` holds with *valid pixels as rows*:

* diag:  ``h[k, d] = Σ_i Λ_i[k,k] ψ_i[d]²``;
* kron:  ``G = Σ_i Λ_i``, ``A = (1/n) Σ_i ψ_i ψ_iᵀ`` (n valid pixels; the expectation approximation);
* full:  ``Σ_i Λ_i ⊗ ψ_i ψ_iᵀ``;

with ``Λ_i = diag(p_i) − p_i p_iᵀ``, ``p_i = softmax(W̃ ψ_i)``, summed batch by batch by the
classification accumulator (never all pixels of a set in memory: one batch of carried features, one
chunk of rows). The fitted posterior is a :class:`~bayescli.posterior.laplace.LaplacePosterior` whose
head is bias-free over ``ψ`` (the bias is ``W̃``'s last column, its input the carried constant
channel: ``head_bias`` is ``False``, ``meta["dense"]`` says so), and whose ``n_data`` counts valid pixels;
its ``logit_gaussian(rows)`` is the per-pixel GLM predictive (:mod:`bayescli.predictive.dense`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from bayescli.data.segmentation import IGNORE_INDEX, check_mask, valid_pixels
from bayescli.errors import BayescliError, require
from bayescli.models.dense import DenseClassifier
from bayescli.options import Backend, CurvatureType, HessianStructure
from bayescli.posterior.laplace import LaplacePosterior


def pixel_rows(carried: torch.Tensor) -> torch.Tensor:
    """``[N, D, H, W]`` → ``[N·H·W, D]``, rows in ``(n, h, w)`` order (a copy only if not channels-last)."""
    return carried.permute(0, 2, 3, 1).reshape(-1, carried.shape[1])


def valid_rows(
    carried: torch.Tensor, mask: torch.Tensor | None, ignore_index: int | None = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows ``[M, D]`` of carried features ``[N, D, H, W]`` at pixels that count, and their labels
    ``[M]`` (``mask [N, H, W]``; ``None``: every pixel counts, unlabelled)."""
    rows = pixel_rows(carried)
    if mask is None:
        return rows, None
    require(
        tuple(mask.shape) == (carried.shape[0], *carried.shape[2:]),
        f"the masks {list(mask.shape)} do not match the model's output "
        f"{[carried.shape[0], *carried.shape[2:]]} [N, H, W]; resize the masks or the model's output "
        "to one resolution",
    )
    labels = mask.reshape(-1)
    # the indices are found where the mask lives (the host, for data read from disk) and copied to
    # the features' device: a boolean index on the device would wait for it once per batch
    keep = valid_pixels(labels, ignore_index).nonzero().squeeze(1)
    return rows.index_select(0, keep.to(rows.device)), labels[keep].to(rows.device)


def _carried_head(weight_aug: torch.Tensor) -> nn.Linear:
    """A bias-free ``nn.Linear`` whose weight is ``W̃ [K, D]``: the head over carried features."""
    k, d = weight_aug.shape
    head = nn.Linear(d, k, bias=False, device="meta")
    head.weight = nn.Parameter(weight_aug.detach(), requires_grad=False)
    return head


def fit_dense_last_layer_stream(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
    weight_aug: torch.Tensor,
    structure: HessianStructure | str = HessianStructure.KRON,
    curvature: CurvatureType | str = CurvatureType.GGN,
    backend: Backend | str = Backend.AUTO,
    batch_size: int = 1024,
    seed: int = 0,
    ignore_index: int | None = IGNORE_INDEX,
) -> LaplacePosterior:
    """Fit on a stream of ``(carried [B, D, H, W], mask [B, H, W] or None)`` batches: the curvature and
    log-likelihood of the head ``W̃ [K, D]`` summed over the valid pixels (module docs). ``batch_size``
    is the accumulator's chunk of rows (pixels). δ is left at 1; see :func:`fit_dense_laplace`."""

    def rows() -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        for carried, mask in batches:
            if mask is not None:
                check_mask(mask, weight_aug.shape[0], ignore_index, "fitting data")
            phi, labels = valid_rows(carried, mask, ignore_index)
            if len(phi):
                yield phi, labels

    post = LaplacePosterior.fit_last_layer_stream(
        rows(), _carried_head(weight_aug), structure, curvature, backend, batch_size, seed
    )
    post.meta["dense"] = {"ignore_index": ignore_index, "pixels": post.n_data, "carried_bias_channel": True}
    return post


def dense_feature_batches(
    classifier: DenseClassifier,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    project: torch.Tensor | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(x [B, ...], mask)`` pixel-space batches → ``(T(φ̃) [B, D, H, W], mask)`` on ``device``
    (default: the classifier's) in ``dtype`` (default: the classifier's); with ``project [D, M]``,
    ``T(φ̃ᵀ project) [B, M, H, W]``. The split is checked on the first batch's first two images."""
    param = next(classifier.parameters())
    device, dtype = device or param.device, dtype or param.dtype
    checked = False
    for x, mask in batches:
        x = x.to(device=device, dtype=dtype)
        if not checked:
            classifier.check_split(x[:2])
            checked = True
        with torch.no_grad():
            carried = classifier.dense_features(x, project)
        yield carried, mask  # outside the block: grad mode is global, a suspended `with` would leak it


def fit_dense_laplace(
    classifier: DenseClassifier,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
    structure: HessianStructure | str = HessianStructure.KRON,
    curvature: CurvatureType | str = CurvatureType.GGN,
    backend: Backend | str = Backend.AUTO,
    prior_precision: float | str = "auto",
    batch_size: int = 1024,
    seed: int = 0,
    ignore_index: int | None = IGNORE_INDEX,
) -> LaplacePosterior:
    """Last-layer Laplace of a segmentation net on pixel-space ``(x [B, ...], mask [B, H, W])`` batches
    (consumed once), with δ a number or ``"auto"`` (the Laplace marginal likelihood over the valid
    pixels; needs masks). ``meta["dense"]`` records the head, ``ignore_index`` and the pixel count."""
    start = time.perf_counter()
    post = fit_dense_last_layer_stream(
        dense_feature_batches(classifier, batches),
        classifier.weight_aug(),
        structure,
        curvature,
        backend,
        batch_size,
        seed,
        ignore_index,
    )
    if prior_precision == "auto":
        post.optimise_prior_marglik()
    else:
        try:
            delta = float(prior_precision)
        except ValueError:
            raise BayescliError(
                f"prior_precision must be a number or 'auto', got {prior_precision!r}"
            ) from None
        post.set_prior_precision(delta)
    post.meta["dense"].update({"head": classifier.head_name, "head_bias": classifier.head_bias})
    post.meta["fit_seconds"] = time.perf_counter() - start
    return post
