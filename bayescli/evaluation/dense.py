"""In-distribution evaluation of a dense (segmentation) posterior, and δ chosen on held-out pixels,
streamed over images.

One backbone pass per batch gives the carried features (:meth:`DenseClassifier.dense_features`); the
per-pixel GLM predictive through each requested link (``none`` is MAP: the softmax of the network's
own logits) feeds one :class:`~bayescli.metrics.segmentation.SegmentationMetrics` per link. Memory:
one batch of carried features and its predictions; the metrics keep sums only.
:func:`select_dense_prior` scores a grid of prior precisions on that one pass too (the predictive of
each δ from the same carried features) by the mean NLL over the valid pixels.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from bayescli import devices
from bayescli.data.segmentation import IGNORE_INDEX, SegmentationData
from bayescli.errors import BayescliError
from bayescli.metrics.segmentation import SegmentationMetrics
from bayescli.models.dense import DenseClassifier
from bayescli.options import Link
from bayescli.posterior.base import Posterior
from bayescli.posterior.dense_laplace import dense_feature_batches
from bayescli.posterior.laplace import LaplacePosterior
from bayescli.posterior.prior import LOG10_RANGE
from bayescli.predictive.dense import dense_predict, projection


def evaluate_dense(
    posterior: Posterior,
    classifier: DenseClassifier,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    links: Sequence[Link | str] = (Link.NONE, Link.PROBIT),
    ignore_index: int | None = IGNORE_INDEX,
    samples: int = 100,
    seed: int = 0,
) -> dict:
    """Per-pixel metrics (:meth:`SegmentationMetrics.compute`) for each link, keyed by the link's name,
    over pixel-space ``(x [B, ...], mask [B, H, W])`` batches; ``seconds`` is the wall time. The MC
    link draws ``samples`` per pixel from one generator seeded ``seed`` for the whole stream."""
    start = time.perf_counter()
    links = [Link(link) for link in links]
    metrics = {link: SegmentationMetrics(classifier.num_classes, ignore_index) for link in links}
    gen = None
    project = projection(posterior)  # kron: carry [W̃ψ | Q_Aᵀψ], projected at the head's resolution
    for carried, mask in dense_feature_batches(classifier, batches, project=project):
        if gen is None:
            gen = devices.generator(carried.device, seed)
        for link in links:
            pred = dense_predict(
                posterior, carried, link, samples=samples, generator=gen, projected=project is not None
            )
            metrics[link].update(mask, log_probs=pred.log_probs, probs=pred.probs)
    report = {link.value: m.compute() for link, m in metrics.items()}
    report["seconds"] = time.perf_counter() - start
    return report


def dense_nll_curve(
    posterior: LaplacePosterior,
    classifier: DenseClassifier,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    deltas: Sequence[float],
    link: Link | str = Link.PROBIT,
    ignore_index: int | None = IGNORE_INDEX,
) -> list[list[float]]:
    """``[[δ, mean NLL over the valid pixels], ...]`` of the GLM predictive through ``link`` (not
    ``mc``: a curve of sampled NLLs would rank noise), one pass over pixel-space ``(x, mask)``
    batches. ``posterior`` keeps its own δ. Each batch re-derives the posterior's δ-dependent factors
    once per grid value: free for diag and kron, an eigenbasis rescaling of ``[P, P]`` for full."""
    link = Link(link)
    if link is Link.MC:
        raise BayescliError("choose δ with a deterministic link (probit, bridge, sodpp), not mc")
    keep = posterior.prior_precision
    project = projection(posterior)
    totals = count = None  # on the features' device, read once at the end
    try:
        for carried, mask in dense_feature_batches(classifier, batches, project=project):
            y = mask.to(carried.device)
            valid = torch.ones_like(y, dtype=torch.bool) if ignore_index is None else y != ignore_index
            safe = torch.where(valid, y, 0)[:, None]  # [B, 1, H, W]: a class index where ignored
            count = valid.sum() if count is None else count + valid.sum()
            parts = []
            for delta in deltas:
                posterior.gaussian.with_delta(float(delta))
                pred = dense_predict(posterior, carried, link, projected=project is not None)
                nll = -pred.log_probs.gather(1, safe).squeeze(1)
                parts.append(torch.where(valid, nll, 0.0).sum())
            part = torch.stack(parts).double()
            totals = part if totals is None else totals + part
    finally:
        posterior.gaussian.with_delta(keep)
    if count is None or int(count) == 0:
        raise BayescliError("no validation pixel: the validation stream was empty or all ignore_index")
    return [[float(d), t / int(count)] for d, t in zip(deltas, totals.tolist(), strict=True)]


def select_dense_prior(
    posterior: LaplacePosterior,
    classifier: DenseClassifier,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    deltas: Sequence[float] | None = None,
    link: Link | str = Link.PROBIT,
    ignore_index: int | None = IGNORE_INDEX,
) -> float:
    """Set δ to the grid value with the lowest validation NLL per pixel (:func:`dense_nll_curve`;
    default grid: 25 log-spaced values over :data:`~bayescli.posterior.prior.LOG10_RANGE`) and record
    the curve as the prior's ``val-nll`` choice; returns δ."""
    grid = deltas if deltas is not None else torch.logspace(*LOG10_RANGE, 25, dtype=torch.float64).tolist()
    curve = dense_nll_curve(posterior, classifier, batches, grid, link, ignore_index)
    best = min(curve, key=lambda row: row[1])[0]
    posterior.set_prior_precision(best, "val-nll", curve)
    return best


@torch.no_grad()
def map_pixel_accuracy(
    dense: DenseClassifier, data: SegmentationData, device: torch.device | str, batch_size: int = 16
) -> float:
    """Arg-max accuracy of the network's logits over ``data``'s valid pixels."""
    right = total = 0
    for x, mask in data.batches(batch_size):
        pred = dense(x.to(device)).argmax(1).cpu()
        valid = (
            torch.ones_like(mask, dtype=torch.bool)
            if data.ignore_index is None
            else mask != data.ignore_index
        )
        right += int((pred == mask)[valid].sum())
        total += int(valid.sum())
    return right / total
