"""What a prediction file holds per input: JSON rows (prediction, top-5, entropy, label) and the
Dirichlet quantities of a bridge or fitted Dirichlet output; for multi-label posteriors, rows of
per-label probabilities (the labels predicted present, each label's probability) and the per-label
quantities of the sigmoid links (mutual information, Beta parameters)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from bayescli.metrics.classification import entropy
from bayescli.metrics.multilabel import THRESHOLD, binary_entropy, multilabel_summary
from bayescli.predictive import dirichlet
from bayescli.predictive.sigmoid_links import SigmoidLinkOutput


def dirichlet_fields(alpha: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-input quantities of Dirichlets ``alpha [N, K]``: the parameters, mean and variance
    ``[N, K]``, precision, entropy of the mean, expected entropy and mutual information ``[N]``."""
    return {
        "alpha": alpha,
        "dirichlet_mean": dirichlet.mean(alpha),
        "dirichlet_variance": dirichlet.variance(alpha),
        "alpha0": dirichlet.precision(alpha),
        "entropy_of_mean": dirichlet.entropy_of_mean(alpha),
        "expected_entropy": dirichlet.expected_entropy(alpha),
        "mutual_information": dirichlet.mutual_information(alpha),
    }


def prediction_rows(
    probs: torch.Tensor,
    labels: torch.Tensor | None,
    names: list[str],
    extra: dict[str, torch.Tensor],
    chunk: int = 4096,
) -> Iterator[dict]:
    """One JSON row per input of ``probs [N, K]`` (prediction, top-5, max probability, entropy,
    ``labels [N]`` when known, and each ``extra`` tensor's row ``[N, …]``), converted chunk by chunk
    so that streaming a large set never holds all rows as Python objects."""
    for start in range(0, len(probs), chunk):
        sl = slice(start, start + chunk)
        top_p, top_i = probs[sl].topk(min(5, probs.shape[1]), dim=1)
        cols = {
            "top_i": top_i.tolist(),
            "top_p": top_p.tolist(),
            "entropy": entropy(probs[sl]).tolist(),
            "label": labels[sl].tolist() if labels is not None else None,
            **{key: value[sl].tolist() for key, value in extra.items()},
        }
        for j in range(len(cols["top_i"])):
            ti, tp = cols["top_i"][j], cols["top_p"][j]
            row = {
                "index": start + j,
                "predicted": ti[0],
                "predicted_name": names[ti[0]],
                "top5": [list(pair) for pair in zip(ti, tp, strict=True)],
                "max_prob": tp[0],
                "entropy": cols["entropy"][j],
            }
            if labels is not None:
                row["label"] = cols["label"][j]
            for key in extra:
                row[key] = cols[key][j]
            yield row


def per_label_fields(out: SigmoidLinkOutput) -> dict[str, torch.Tensor]:
    """Per-label quantities ``[N, K]`` of a multi-label link output, those it has: the mutual
    information between each label and the weights and expected binary entropy (``mc``, ``beta``)
    and the moment-matched ``Beta(beta_alpha, beta_beta)`` (``beta``)."""
    fields = {
        "mutual_information": out.mutual_information,
        "expected_entropy": out.expected_entropy,
        "beta_alpha": out.alpha,
        "beta_beta": out.beta,
    }
    return {key: value for key, value in fields.items() if value is not None}


def multilabel_scores(
    probs: torch.Tensor, labels: torch.Tensor | None, log_odds: torch.Tensor | None = None
) -> dict[str, float]:
    """Scalar metrics of per-label ``probs [N, K]``: with ``labels [N, K]`` those of
    :func:`~bayescli.metrics.multilabel.multilabel_summary` (means over labels; its per-label lists
    left out; the NLL from ``log_odds [N, K]`` when given), without them the mean binary entropy
    of the cells only."""
    if labels is None:
        return {"mean_entropy": binary_entropy(probs).mean().item()}
    summary = multilabel_summary(probs, labels, log_odds=log_odds)
    return {k: v for k, v in summary.items() if k != "per_label"}


def multilabel_rows(
    probs: torch.Tensor,
    labels: torch.Tensor | None,
    names: list[str],
    extra: dict[str, torch.Tensor],
    chunk: int = 4096,
) -> Iterator[dict]:
    """One JSON row per input of per-label ``probs [N, K]``: the names of the labels predicted
    present (``p ≥ 0.5``), every label's probability, ``labels [N, K]`` when known and each
    ``extra`` tensor's row ``[N, K]``; converted chunk by chunk like :func:`prediction_rows`."""
    for start in range(0, len(probs), chunk):
        sl = slice(start, start + chunk)
        rows = probs[sl].tolist()
        cols = {key: value[sl].tolist() for key, value in extra.items()}
        if labels is not None:
            cols["label"] = labels[sl].tolist()
        for j, p in enumerate(rows):
            present = [name for name, pk in zip(names, p, strict=True) if pk >= THRESHOLD]
            yield {"index": start + j, "predicted": present, "probs": p} | {
                key: value[j] for key, value in cols.items()
            }
