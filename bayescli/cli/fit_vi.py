"""``bayescli fit-vi``: fit a variational posterior (MNVI, FSVI, Dirichlet fVI, GLM/GGP VI, BBB) post hoc.

A thin layer over :func:`bayescli.fitting.pipeline.fit_from_specs`: each method is a registry entry
(:mod:`bayescli.fitting.registry`) whose settings dataclass the options fill. Method options map one-to-one
onto the settings' fields (``--kl-weight`` → ``kl_weight``); ``--set NAME=VALUE`` reaches any
field. An option that the chosen method has no field for is a usage error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from bayescli.cli import common as c
from bayescli.cli.fit_options import Criterion, SelectBy, ValData, ValSplit, show_fit
from bayescli.options import Subset, VIMethod


def vi_settings(method: VIMethod, options: dict[str, Any], items: list[str]) -> Any:
    """``method``'s settings from the given (non-``None``) options and ``--set NAME=VALUE`` items;
    an option the method has no field for is a usage error naming its options."""
    from bayescli.cli.train import parse_settings
    from bayescli.fitting.registry import create_settings, parse_setting, setting_fields

    fields = setting_fields(method.value)
    given = {k: v for k, v in options.items() if v is not None}
    for name in given:
        if name not in fields:
            raise typer.BadParameter(
                f"does not apply to --method {method.value} (its options: "
                f"{', '.join('--' + f.replace('_', '-') for f in sorted(fields))}; or --set NAME=VALUE)",
                param_hint="--" + name.replace("_", "-"),
            )
    values = {k: v.value if hasattr(v, "value") else v for k, v in given.items()}
    for name, text in parse_settings(items).items():
        values[name] = parse_setting(method.value, name, text)
    return create_settings(method.value, **values)


Opt = typer.Option
VariantOpt = Annotated[str | None, Opt(help="MNVI: noise-only (ρ only) or mean-and-noise.")]
FamilyOpt = Annotated[str | None, Opt(help="Dirichlet fVI: ensemble, mfvi, map or dropout.")]
MembersOpt = Annotated[int | None, Opt(min=1, help="Dirichlet fVI: function samples / heads M.")]
KlWeightOpt = Annotated[float | None, Opt(parser=c.number("--kl-weight", 0.0), help="MNVI: KL weight κ/N.")]
PriorVarOpt = Annotated[
    float | None, Opt(parser=c.number("--prior-var", 0.0), help="MNVI: prior variance σ².")
]
PriorScaleOpt = Annotated[
    float | None, Opt(parser=c.number("--prior-scale", 0.0), help="FSVI: c in σ_p² = c / mean‖φ̃‖².")
]
TauOpt = Annotated[float | None, Opt(parser=c.number("--tau", 0.0), help="Dirichlet fVI: KL temperature τ.")]
BetaOpt = Annotated[
    float | None, Opt(parser=c.number("--beta", 0.0), help="Dirichlet fVI: prior concentration β.")
]
Rho0Opt = Annotated[
    float | None, Opt(parser=c.number("--rho0"), help="MNVI: initial noise parameter ρ₀ (a = softplus(ρ₀)).")
]
SamplesOpt = Annotated[int | None, Opt(min=1, help="Monte-Carlo samples in the expected log-likelihood.")]
ContextOpt = Annotated[str | None, Opt(help="FSVI: monochrome, augment or a data spec.")]
ContextPointsOpt = Annotated[int | None, Opt(min=1, help="FSVI: context points per step.")]
IndexDataOpt = Annotated[str | None, Opt(help="Dirichlet fVI: extra index-set data spec.")]
DropoutOpt = Annotated[
    float | None, Opt(parser=c.number("--dropout", 0.0, 1.0), help="Dirichlet fVI: dropout rate on φ.")
]
EpochsOpt = Annotated[int | None, Opt(min=1, help="Training epochs (default: the method's).")]
LrOpt = Annotated[
    float | None, Opt(parser=c.number("--lr", 0.0), help="Learning rate (default: the method's).")
]
TrainBatchSizeOpt = Annotated[int | None, Opt(min=1, help="Minibatch size of the VI objective.")]
CovarianceOpt = Annotated[str | None, Opt(help="GLM VI: diag or full posterior covariance.")]
PriorPrecisionOpt = Annotated[
    float | None,
    Opt(
        parser=c.number("--prior-precision", 0.0),
        help="GLM/GGP VI, BBB: prior precision δ (default: chosen on held-out data when there is any, else "
        "the Laplace marginal likelihood; BBB from scratch: 1).",
    ),
]
InducingPointsOpt = Annotated[int | None, Opt(min=1, help="GGP VI: inducing points M (fitting inputs).")]


def fit_vi_cmd(
    ctx: typer.Context,
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
    val_data: ValData = None,
    val_split: ValSplit = None,
    select_by: SelectBy = Criterion.NLL,
    subset: Annotated[Subset, typer.Option(help="Which weights get a posterior.")] = Subset.LAST_LAYER,
    select: Annotated[
        bool | None,
        typer.Option(
            "--select/--no-select",
            help="Choose the method's key hyperparameters on held-out data. Default: whenever held-out "
            "data exists and the hyperparameter is not given; --select without --val-data uses the "
            "validation split of --data.",
            rich_help_panel="Validation",
        ),
    ] = None,
    setting: Annotated[
        list[str] | None,
        typer.Option("--set", help="Any setting of the method NAME=VALUE (repeatable), e.g. --set tau=0.1."),
    ] = None,
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
    likelihood: c.Likelihood = None,
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
    precision: c.PrecisionOpt = None,
    device: c.Device = "auto",
    seed: c.Seed = 0,
    quiet: c.Quiet = False,
    as_json: c.Json = False,
) -> None:
    """Fit a variational posterior to a trained classifier (MNVI, FSVI, Dirichlet fVI, GLM/GGP VI, BBB).

    Example: bayescli fit-vi --method mnvi --model builtin:small-cnn --checkpoint model.safetensors
    --data digits:train --val-data digits:val --out mnvi.safetensors
    """
    from bayescli.fitting.pipeline import fit_from_specs

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
        "subset": subset.value,
        "select": select,
        "select_by": select_by,
        "seed": seed,
    }
    settings = vi_settings(method, options, setting or [])
    models, data_opts = c.option_groups(ctx.params)
    dev = c.resolve_device(device)
    with c.low_accuracy_seen() as seen:
        run = fit_from_specs(
            method.value,
            models,
            data,
            settings=settings,
            data_options=data_opts,
            val=val_data,
            val_split=val_split,
            select_required=bool(select),
            device=dev,
            batch_size=batch_size,
            out=out,
        )
    post = run.posterior
    summary = {
        "posterior": str(out),
        "method": method.value,
        "subset": subset.value,
        **post.summary(),
        "fit_seconds": post.meta.get("fit_seconds"),
        "preprocess": run.model.preprocess.source,
        **c.model_facts(run.model),
    }
    show_fit(run, seen, summary, f"{method.value} posterior", quiet, as_json)
