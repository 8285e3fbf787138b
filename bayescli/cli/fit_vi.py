"""``bayescli fit-vi``: fit a variational posterior (MNVI, FSVI, Dirichlet fVI) post hoc.

Each method lives in ``bayescli.posterior.vi.<module>`` and exposes a ``Config`` dataclass, a
post-hoc ``fit_<module>`` and a from-scratch ``train_<module>`` (used by ``bayescli train
--method``). Method options map one-to-one onto the config's fields (``--kl-weight`` →
``kl_weight``); an option that the chosen method has no field for is a usage error.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from bayescli.cli import common as c
from bayescli.options import Subset, VIMethod

# method → (module under bayescli.posterior.vi, config class); adding a method is one entry.
VI_METHODS: dict[VIMethod, tuple[str, str]] = {
    VIMethod.MNVI: ("mnvi", "MNVIConfig"),
    VIMethod.FSVI: ("fsvi", "FSVIConfig"),
    VIMethod.DIRICHLET_FVI: ("dirichlet_fvi", "DirichletFVIConfig"),
    VIMethod.GLM_VI: ("glm_vi", "GLMVIConfig"),
    VIMethod.GGP_VI: ("ggp_vi", "GGPVIConfig"),
    VIMethod.BBB: ("bbb", "BBBConfig"),
}


@dataclasses.dataclass
class VIEntry:
    config: type
    fit: Callable[..., Any]
    train: Callable[..., Any]


def vi_method(method: VIMethod) -> VIEntry:
    """The config class and the fit/train functions of ``method``."""
    module_name, config = VI_METHODS[method]
    module = importlib.import_module(f"bayescli.posterior.vi.{module_name}")
    fit, train = (getattr(module, f"{verb}_{module_name}") for verb in ("fit", "train"))
    return VIEntry(getattr(module, config), fit, train)


def vi_config(method: VIMethod, options: dict[str, Any]) -> Any:
    """``method``'s config with the given (non-``None``) options; unknown ones are usage errors."""
    cls = vi_method(method).config
    fields = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in options.items() if v is not None}
    for name in given:
        if name not in fields:
            raise typer.BadParameter(
                f"does not apply to --method {method.value} (its options: "
                f"{', '.join('--' + f.replace('_', '-') for f in sorted(fields))})",
                param_hint="--" + name.replace("_", "-"),
            )
    return cls(**{k: v.value if hasattr(v, "value") else v for k, v in given.items()})


Opt = typer.Option
VariantOpt = Annotated[str | None, Opt(help="MNVI: noise-only (ρ only) or mean-and-noise.")]
FamilyOpt = Annotated[str | None, Opt(help="Dirichlet fVI: ensemble, mfvi, map or dropout.")]
MembersOpt = Annotated[int | None, Opt(min=1, help="Dirichlet fVI: function samples / heads M.")]
KlWeightOpt = Annotated[float | None, Opt(min=0.0, help="MNVI: KL weight κ/N.")]
PriorVarOpt = Annotated[float | None, Opt(min=0.0, help="MNVI: prior variance σ².")]
PriorScaleOpt = Annotated[float | None, Opt(min=0.0, help="FSVI: c in σ_p² = c / mean‖φ̃‖².")]
TauOpt = Annotated[float | None, Opt(min=0.0, help="Dirichlet fVI: KL temperature τ.")]
BetaOpt = Annotated[float | None, Opt(min=0.0, help="Dirichlet fVI: prior concentration β.")]
Rho0Opt = Annotated[float | None, Opt(help="MNVI: initial noise parameter ρ₀ (a = softplus(ρ₀)).")]
SamplesOpt = Annotated[int | None, Opt(min=1, help="Monte-Carlo samples in the expected log-likelihood.")]
ContextOpt = Annotated[str | None, Opt(help="FSVI: monochrome, augment or a data spec.")]
ContextPointsOpt = Annotated[int | None, Opt(min=1, help="FSVI: context points per step.")]
IndexDataOpt = Annotated[str | None, Opt(help="Dirichlet fVI: extra index-set data spec.")]
DropoutOpt = Annotated[float | None, Opt(min=0.0, max=1.0, help="Dirichlet fVI: dropout rate on φ.")]
EpochsOpt = Annotated[int | None, Opt(min=1, help="Training epochs (default: the method's).")]
LrOpt = Annotated[float | None, Opt(min=0.0, help="Learning rate (default: the method's).")]
TrainBatchSizeOpt = Annotated[int | None, Opt(min=1, help="Minibatch size of the VI objective.")]
CovarianceOpt = Annotated[str | None, Opt(help="GLM VI: diag or full posterior covariance.")]
PriorPrecisionOpt = Annotated[
    float | None, Opt(min=0.0, help="GLM/GGP VI, BBB: prior precision δ (default: Laplace marglik / 1).")
]
InducingPointsOpt = Annotated[int | None, Opt(min=1, help="GGP VI: inducing points M (fitting inputs).")]


def fit_vi_cmd(
    data: Annotated[str, typer.Option(help="Fitting data spec, e.g. digits:train (required).")],
    model: Annotated[
        str, typer.Option(help="timm:NAME, torchvision:NAME, builtin:NAME, hf:FOLDER or py:module:factory.")
    ],
    out: Annotated[Path, typer.Option(help="Posterior file to write (.safetensors).")],
    method: Annotated[VIMethod, typer.Option(help="Variational family.")],
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            help=".safetensors (preferred) or a state-dict .pt/.pth/… "
            "Not needed for hf:FOLDER models (their weights file is used)."
        ),
    ] = None,
    val_data: Annotated[
        str | None, typer.Option(help="Validation spec for --select (default: the val split).")
    ] = None,
    subset: Annotated[Subset, typer.Option(help="Which weights get a posterior.")] = Subset.LAST_LAYER,
    select: Annotated[
        bool, typer.Option("--select", help="Pick the method's key hyperparameters on validation NLL.")
    ] = False,
    variant: VariantOpt = None,
    family: FamilyOpt = None,
    members: MembersOpt = None,
    kl_weight: KlWeightOpt = None,
    prior_var: PriorVarOpt = None,
    prior_scale: PriorScaleOpt = None,
    tau: TauOpt = None,
    beta: BetaOpt = None,
    rho0: Rho0Opt = None,
    samples: SamplesOpt = None,
    context: ContextOpt = None,
    context_points: ContextPointsOpt = None,
    index_data: IndexDataOpt = None,
    dropout: DropoutOpt = None,
    epochs: EpochsOpt = None,
    lr: LrOpt = None,
    train_batch_size: TrainBatchSizeOpt = None,
    covariance: CovarianceOpt = None,
    prior_precision: PriorPrecisionOpt = None,
    inducing_points: InducingPointsOpt = None,
    head: c.Head = None,
    model_args: c.ModelArg = None,
    output: c.Output = None,
    preprocess: c.PreprocessOpt = None,
    mean: c.Mean = None,
    std: c.Std = None,
    resize: c.Resize = None,
    crop: c.Crop = None,
    interpolation: c.InterpolationOpt = None,
    checkpoint_key: c.CheckpointKey = None,
    num_workers: c.NumWorkers = 0,
    skip_unreadable: c.SkipUnreadable = False,
    data_root: c.DataRoot = Path("data"),
    download: c.Download = False,
    limit: c.Limit = None,
    batch_size: c.BatchSize = 256,
    device: c.Device = "auto",
    seed: c.Seed = 0,
    quiet: c.Quiet = False,
    as_json: c.Json = False,
) -> None:
    """Fit a variational posterior to a trained classifier (MNVI, FSVI or Dirichlet fVI).

    Example: bayescli fit-vi --method mnvi --model builtin:small-cnn --checkpoint model.safetensors
    --data digits:train --select --out mnvi.safetensors
    """
    from bayescli.data import validation_spec
    from bayescli.features import logit_pass
    from bayescli.metrics import low_accuracy_warning

    c.setup(quiet, as_json, seed)
    if out.suffix != ".safetensors":
        raise typer.BadParameter("posterior files are .safetensors", param_hint="--out")
    options = {
        "variant": variant,
        "family": family,
        "members": members,
        "kl_weight": kl_weight,
        "prior_var": prior_var,
        "prior_scale": prior_scale,
        "tau": tau,
        "beta": beta,
        "rho0": rho0,
        "samples": samples,
        "context": context,
        "context_points": context_points,
        "index_data": index_data,
        "dropout": dropout,
        "epochs": epochs,
        "lr": lr,
        "batch_size": train_batch_size,
        "covariance": covariance,
        "prior_precision": prior_precision,
        "inducing_points": inducing_points,
    }
    fixed = {"subset": subset.value, "select": select, "seed": seed}
    # Extra data specs of a method (FSVI context, Dirichlet-fVI index set) live beside --data.
    roots = {"context_root": str(data_root), "index_root": str(data_root)}
    fields = {f.name for f in dataclasses.fields(vi_method(method).config)}
    fixed |= {k: v for k, v in roots.items() if k in fields}
    cfg = vi_config(method, {**options, **fixed})
    dev = c.resolve_device(device)
    pre = c.preprocess_from_options(preprocess, model, mean, std, resize, crop, interpolation)
    loaded, fit_data = c.load_model_and_data(
        model, checkpoint, head, checkpoint_key, pre, data, data_root, download, limit, seed,
        num_workers, skip_unreadable, model_args=model_args, output=output,
    )  # fmt: skip
    val = None
    if select:
        val = c.load(val_data or validation_spec(data), data_root, download, None, seed, loaded.preprocess)
        c.check_labels(val, loaded.classifier.num_classes)
    map_accuracy = None
    if subset is Subset.ALL:  # whole-network fits may never extract the fitting data's features
        map_accuracy = logit_pass(loaded, fit_data, batch_size, dev).accuracy
    with c.low_accuracy_seen() as seen:  # the library's warnings on the sets the fit extracted
        post = vi_method(method).fit(loaded, fit_data, val, cfg, dev, batch_size)
    if map_accuracy is None:
        map_accuracy = next((w.accuracy for w in seen if w.spec == fit_data.spec), None)
    if map_accuracy is not None:
        c.warn(low_accuracy_warning(map_accuracy, loaded.classifier.num_classes, f"the fitting data {data}"))
    c.record_provenance(post, loaded, fit_data)
    post.save(out)
    # selection and prior searches leave a "warning" in their metadata block (e.g. an edge of the grid)
    warnings = [v["warning"] for v in post.meta.values() if isinstance(v, dict) and v.get("warning")]
    for warning in warnings:
        c.warn(warning)
    summary = {
        "posterior": str(out),
        "method": method.value,
        "subset": subset.value,
        **post.summary(),
        "fit_seconds": post.meta.get("fit_seconds"),
        "preprocess": loaded.preprocess.source,
        **c.model_facts(loaded),
        "warnings": warnings,
    }
    c.show(
        quiet,
        as_json,
        c.table(f"{method.value} posterior", ["", "value"], [[k, v] for k, v in summary.items()]),
        payload=summary,
    )
