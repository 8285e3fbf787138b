"""In-distribution evaluation of a dense (segmentation) posterior, streamed over images.

One backbone pass per batch gives the carried features (:meth:`DenseClassifier.dense_features`); the
per-pixel GLM predictive through each requested link (``none`` is MAP: the softmax of the network's
own logits) feeds one :class:`~bayescli.metrics.segmentation.SegmentationMetrics` per link. Memory:
one batch of carried features and its predictions; the metrics keep sums only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from bayescli import devices
from bayescli.data.segmentation import IGNORE_INDEX
from bayescli.metrics.segmentation import SegmentationMetrics
from bayescli.models.dense import DenseClassifier
from bayescli.options import Link
from bayescli.posterior.base import Posterior
from bayescli.posterior.dense_laplace import dense_feature_batches
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
