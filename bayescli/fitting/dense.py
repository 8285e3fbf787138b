"""Segmentation models through the fitting commands: ``seg:`` data in, a dense posterior file out.

``fit-laplace`` on segmentation data (:func:`fit_dense_from_specs`) loads the checkpoint as any
classifier, views it as a :class:`~bayescli.models.dense.DenseClassifier` (a 1×1-conv head whose
logits reach the output through upsampling/cropping only, checked on the first images), fits the
last-layer Laplace on the valid pixels (:func:`~bayescli.posterior.dense_laplace.fit_dense_laplace`)
and chooses δ as the classification fit does: a number as given; held-out data (``val_data``, a
carved ``val_split`` or the validation split a ``bayescli train`` checkpoint records) → validation
NLL per valid pixel over the δ grid (:func:`~bayescli.evaluation.dense.select_dense_prior`);
otherwise the marginal likelihood. What does not carry over to pixels is refused with one line
(:func:`check_dense_settings`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bayescli.data.registry import DataSpec, is_segmentation, load_segmentation
from bayescli.data.segmentation import IGNORE_INDEX, SegmentationData, check_mask
from bayescli.errors import BayescliError, require
from bayescli.evaluation.dense import map_pixel_accuracy, select_dense_prior
from bayescli.fitting.laplace import LaplaceSettings, PriorRule
from bayescli.models.dense import DenseClassifier, as_dense
from bayescli.models.features import parse_precision
from bayescli.models.specs import LoadedModel
from bayescli.options import Criterion, Link, Predictive, Subset
from bayescli.posterior.dense_laplace import fit_dense_laplace
from bayescli.posterior.laplace import LaplacePosterior


def check_dense_settings(settings: LaplaceSettings) -> None:
    """Refuse, in one line each, the Laplace settings that have no per-pixel form yet."""
    require(
        settings.subset is Subset.LAST_LAYER,
        "segmentation data: only --subset last-layer applies (the dense head's Laplace; an all-layer "
        "posterior over a segmentation net is not supported)",
    )
    require(settings.refine_steps == 0, "segmentation data: --refine-mode does not apply (MAP mode only)")
    require(
        settings.predictive is Predictive.GLM,
        "segmentation data: δ is chosen with the GLM predictive per pixel; use --predictive glm",
    )
    require(
        settings.select_by is Criterion.NLL,
        "segmentation data: δ is chosen by validation NLL per pixel; use --select-by nll",
    )
    require(
        settings.link is not Link.MC and settings.link is not Link.NONE,
        f"segmentation data: choose δ with a deterministic link (probit, bridge), not {settings.link.value}",
    )


def dense_view(loaded: LoadedModel, data: SegmentationData, device: torch.device | str) -> DenseClassifier:
    """``loaded`` as a dense classifier on ``device``, checked on ``data``'s first images: a
    segmentation model (per-pixel logits through a 1×1-conv head) whose classes cover the masks."""
    problem = loaded.input_problem(data.input_shape, data.spec)
    require(problem is None, problem or "")
    x, _ = next(data.batches(2))
    dense = as_dense(loaded.classifier.to(device), x.to(device), str(loaded.spec))
    if data.mask is not None:
        check_mask(data.mask, dense.num_classes, data.ignore_index, data.spec)
    return dense


@dataclass
class DenseFitRun:
    """What :func:`fit_dense_from_specs` did (the fields :class:`~bayescli.fitting.pipeline.FitRun`
    summaries read)."""

    posterior: LaplacePosterior
    model: LoadedModel
    data: SegmentationData
    val: SegmentationData | None
    seconds: float

    def facts(self) -> dict:
        prior = self.posterior.prior_record
        return {
            "precision": self.posterior.meta.get("precision"),
            "validation": None if self.val is None else self.val.spec,
            "chosen prior_precision": prior.get("value"),
            "chosen by": {"val-nll": "validation nll", "marglik": "marginal likelihood"}.get(
                prior.get("method"), "given"
            ),
        }


def _validation(
    loaded: LoadedModel,
    fit: SegmentationData,
    spec: str,
    val: str | None,
    val_split: float | None,
    ignore_index: int | None,
    seed: int,
) -> tuple[SegmentationData, SegmentationData | None]:
    require(val is None or val_split is None, "give validation data or a val_split, not both")
    if val_split is not None:
        require(0 < val_split < 1, f"val_split must be in (0, 1), got {val_split}")
        n_val = int(round(val_split * len(fit)))
        require(0 < n_val < len(fit), f"val_split {val_split} of {len(fit)} images leaves an empty set")
        perm = torch.randperm(len(fit), generator=torch.Generator().manual_seed(seed))
        info = {**fit.info, "val_split": val_split, "val_split_seed": seed}
        fit_part, val_part = fit.subset(perm[n_val:].sort().values), fit.subset(perm[:n_val].sort().values)
        fit_part.info, val_part.info = {**info, "role": "fitting"}, {**info, "role": "validation"}
        return fit_part, val_part
    if val is None:
        recorded = (loaded.metadata.get("val_data") or {}).get("spec")
        val = recorded if recorded and recorded != spec and is_segmentation(recorded) else None
    if val is None:
        return fit, None
    require(is_segmentation(val), f"{val} is not segmentation data; pass --val-data seg:FILE.npz")
    data = load_segmentation(val, ignore_index)
    require(data.mask is not None, f"{val} has no masks; validation data must be labelled")
    return fit, data


def fit_dense_from_specs(
    loaded: LoadedModel,
    data: str,
    settings: LaplaceSettings,
    *,
    ignore_index: int | None = IGNORE_INDEX,
    val: str | None = None,
    val_split: float | None = None,
    limit: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    batch_size: int = 16,
    out: Path | None = None,
) -> DenseFitRun:
    """Fit the last-layer Laplace of segmentation model ``loaded`` on ``seg:`` ``data`` (module
    docs); records the model's provenance and writes ``out``. ``batch_size`` counts images."""
    check_dense_settings(settings)
    start = time.perf_counter()
    fit = load_segmentation(data, ignore_index, limit, seed)
    require(fit.mask is not None, f"{data} has no masks; fitting needs labelled pixels")
    fit, val_data = _validation(loaded, fit, str(DataSpec.parse(data)), val, val_split, ignore_index, seed)
    dense = dense_view(loaded, fit, device)
    if val_data is not None:
        check_mask(val_data.mask, dense.num_classes, ignore_index, val_data.spec)
    rule = settings.prior_precision
    if rule is PriorRule.VALIDATION:
        require(val_data is not None, "--prior-precision val-nll needs validation data (--val-data seg:FILE)")
    fixed = isinstance(rule, float | int) and not isinstance(rule, bool)
    marglik = rule is PriorRule.MARGLIK or (rule is None and val_data is None)
    post = fit_dense_laplace(
        dense,
        fit.batches(batch_size),
        settings.hessian,
        settings.curvature,
        settings.backend,
        prior_precision=float(rule) if fixed else ("auto" if marglik else 1.0),
        seed=settings.seed,
        ignore_index=ignore_index,
    )
    if not fixed and not marglik:
        select_dense_prior(
            post, dense, val_data.batches(batch_size), link=settings.link, ignore_index=ignore_index
        )
    post.meta |= {
        **loaded.describe(),
        **dense.describe(),
        "task": "segmentation",
        "precision": parse_precision(loaded.precision).value,
        "class_names": loaded.class_names,
        "data": fit.info,
        "validation_data": None if val_data is None else val_data.info,
        "validated": val_data is not None and not fixed,
    }
    post.meta["fit_seconds"] = time.perf_counter() - start
    if out is not None:
        post.save(out)
    return DenseFitRun(post, loaded, fit, val_data, time.perf_counter() - start)


def inspect_dense(
    loaded: LoadedModel, data: SegmentationData | None, device: torch.device | str, seed: int = 0
) -> dict:
    """What ``bayescli inspect`` says about a segmentation model: that it is a dense (per-pixel)
    classifier, its head, ``K``, ``C`` and whether ``W̃ T(φ̃)`` reproduces its logits (checked on
    ``data``'s first two images, else on two seeded uniform images of the checkpoint's recorded
    input shape; ``not checked`` without either). With labelled ``data``, the MAP pixel accuracy
    over its valid pixels."""
    if data is not None:
        problem = loaded.input_problem(data.input_shape, data.spec)
        require(problem is None, problem or "")
        x = next(data.batches(2))[0]
    elif loaded.metadata.get("input_shape"):
        gen = torch.Generator().manual_seed(seed)
        x = torch.rand(2, *loaded.metadata["input_shape"], generator=gen)
    else:
        x = None
    facts: dict = {"task": "segmentation (dense per-pixel classifier)"}
    if x is None:
        dense = DenseClassifier.from_classifier(loaded.classifier)
        facts["dense"] = {**dense.describe(), "split_check": "not checked (pass --data seg:FILE.npz)"}
        return facts
    x = x.to(device)
    dense = as_dense(loaded.classifier.to(device), x, str(loaded.spec), check_split=False)
    try:
        split = {"split_check": "ok", "split_max_abs_diff": dense.check_split(x)}
    except BayescliError as exc:  # a fact to show, not a reason to stop describing the model
        split = {"split_check": f"failed: {exc}"}
    facts["dense"] = {**dense.describe(), **split}
    if data is not None and data.mask is not None:
        check_mask(data.mask, dense.num_classes, data.ignore_index, data.spec)
        facts |= {"data": data.spec, "images": len(data), "valid_pixels": data.valid_count()}
        if split["split_check"] == "ok":
            facts["map_pixel_accuracy"] = map_pixel_accuracy(dense, data, device)
    return facts
