"""``bayescli fit-vi``: fit a variational posterior (MNVI, FSVI, Dirichlet fVI, GLM/GGP VI, BBB) post hoc.

A thin layer over :func:`bayescli.fitting.pipeline.fit_from_specs`: ``--method`` is any registry
entry of kind ``vi`` (:mod:`bayescli.fitting.registry`), and ``--set NAME=VALUE`` fills any field of
its settings dataclass. Both are read from the registry when the command is built, so a method
added there is a choice here, and ``--help`` lists each method's settings with type and default.

The per-method options of earlier releases (``--kl-weight``, ``--tau``, …) remain for one release
as hidden, deprecated aliases of ``--set``: each use prints a warning naming its ``--set``
spelling. An option or setting the chosen method has no field for is a usage error.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from bayescli.cli import common as c
from bayescli.cli.fit_options import Criterion, SelectBy, ValData, ValSplit, show_fit
from bayescli.options import Subset

SETTINGS_HELP = (
    "--set NAME=VALUE takes any setting of the method (repeatable). A default of None is chosen "
    "for this fit: bayescli.settings(METHOD)'s docstring says how."
)


class FitViCommand(TyperCommand):
    """``fit-vi`` as the registry describes it when the command is built (each run): ``--method``'s
    help names the entries of kind ``vi`` (the command checks the choice), and ``--help`` ends with
    each one's settings, as panels like the options' (plain sections without rich)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from bayescli.fitting.registry import methods

        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.name == "method":
                param.help = f"Variational method: {', '.join(methods('vi'))} (settings below)."

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        super().format_help(ctx, formatter)
        panels = settings_panels()
        if not (getattr(typer.core, "HAS_RICH", False) and self.rich_markup_mode is not None):
            for title, rows in panels:  # click's plain help, as the options above
                with formatter.section(title):
                    formatter.write_dl([(name, f"{kind}  [default: {value}]") for name, kind, value in rows])
            formatter.write_paragraph()
            formatter.write_text(SETTINGS_HELP)
            return
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text
        from typer import rich_utils

        console = rich_utils._get_rich_console()
        widths = [max(len(row[i]) for _, rows in panels for row in rows) for i in range(2)]
        for title, rows in panels:
            table = Table(show_header=False, expand=True, box=None, pad_edge=False, padding=(0, 1))
            table.add_column(min_width=widths[0], style=rich_utils.STYLE_OPTION, no_wrap=True)
            table.add_column(min_width=widths[1], style=rich_utils.STYLE_TYPES)
            table.add_column(style=rich_utils.STYLE_OPTION_DEFAULT, ratio=1)
            for name, kind, default in rows:
                table.add_row(Text(name), Text(kind), Text(f"[default: {default}]"))
            console.print(
                Panel(
                    table,
                    border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER,
                    title=title,
                    title_align=rich_utils.ALIGN_OPTIONS_PANEL,
                )
            )
        console.print(Text(SETTINGS_HELP))


def settings_panels() -> list[tuple[str, list[tuple[str, str, str]]]]:
    """One ``(title, [(setting, type, default)])`` per VI method of the registry."""
    from bayescli.fitting.registry import methods, setting_rows

    return [
        (
            f"Settings of --method {name} (--set NAME=VALUE)",
            [(setting, kind, _shown(default)) for setting, kind, default in setting_rows(name)],
        )
        for name in methods("vi")
    ]


def _shown(value: Any) -> str:
    if isinstance(value, Enum):
        value = value.value
    return repr(value) if value == "" else str(value)


def vi_settings(method: str, options: dict[str, Any], items: list[str]) -> Any:
    """``method``'s settings from the given (non-``None``) options and ``--set NAME=VALUE`` items
    (which take precedence); an option the method has no field for is a usage error naming its
    settings."""
    from bayescli.cli.train import parse_settings
    from bayescli.fitting.registry import create_settings, parse_setting, setting_fields

    fields = setting_fields(method)
    given = {k: v for k, v in options.items() if v is not None}
    for name in given:
        if name not in fields:
            flag = DEPRECATED_FIELD.get(name, name)
            raise typer.BadParameter(
                f"does not apply to --method {method} (its settings: {', '.join(sorted(fields))}; "
                "give them as --set NAME=VALUE)",
                param_hint="--" + flag.replace("_", "-"),
            )
    values = {k: v.value if hasattr(v, "value") else v for k, v in given.items()}
    for name, text in parse_settings(items).items():
        values[name] = parse_setting(method, name, text)
    return create_settings(method, **values)


Opt = typer.Option
# The per-method options of earlier releases: hidden aliases of --set (removed in the next release).
VariantOpt = Annotated[str | None, Opt(hidden=True, help="MNVI: noise-only (ρ only) or mean-and-noise.")]
FamilyOpt = Annotated[str | None, Opt(hidden=True, help="Dirichlet fVI: ensemble, mfvi, map or dropout.")]
MembersOpt = Annotated[int | None, Opt(min=1, hidden=True, help="Dirichlet fVI: function samples / heads M.")]
KlWeightOpt = Annotated[
    float | None, Opt(parser=c.number("--kl-weight", 0.0), hidden=True, help="MNVI: KL weight κ/N.")
]
PriorVarOpt = Annotated[
    float | None, Opt(parser=c.number("--prior-var", 0.0), hidden=True, help="MNVI: prior variance σ².")
]
PriorScaleOpt = Annotated[
    float | None,
    Opt(parser=c.number("--prior-scale", 0.0), hidden=True, help="FSVI: c in σ_p² = c / mean‖φ̃‖²."),
]
TauOpt = Annotated[
    float | None, Opt(parser=c.number("--tau", 0.0), hidden=True, help="Dirichlet fVI: KL temperature τ.")
]
BetaOpt = Annotated[
    float | None,
    Opt(parser=c.number("--beta", 0.0), hidden=True, help="Dirichlet fVI: prior concentration β."),
]
Rho0Opt = Annotated[
    float | None,
    Opt(parser=c.number("--rho0"), hidden=True, help="MNVI: initial noise parameter ρ₀ (a = softplus(ρ₀))."),
]
SamplesOpt = Annotated[
    int | None, Opt(min=1, hidden=True, help="Monte-Carlo samples in the expected log-likelihood.")
]
ContextOpt = Annotated[str | None, Opt(hidden=True, help="FSVI: monochrome, augment or a data spec.")]
ContextPointsOpt = Annotated[int | None, Opt(min=1, hidden=True, help="FSVI: context points per step.")]
IndexDataOpt = Annotated[str | None, Opt(hidden=True, help="Dirichlet fVI: extra index-set data spec.")]
DropoutOpt = Annotated[
    float | None,
    Opt(parser=c.number("--dropout", 0.0, 1.0), hidden=True, help="Dirichlet fVI: dropout rate on φ."),
]
EpochsOpt = Annotated[int | None, Opt(min=1, hidden=True, help="Training epochs (default: the method's).")]
LrOpt = Annotated[
    float | None,
    Opt(parser=c.number("--lr", 0.0), hidden=True, help="Learning rate (default: the method's)."),
]
TrainBatchSizeOpt = Annotated[int | None, Opt(min=1, hidden=True, help="Minibatch size of the VI objective.")]
CovarianceOpt = Annotated[str | None, Opt(hidden=True, help="GLM VI: diag or full posterior covariance.")]
PriorPrecisionOpt = Annotated[
    float | None,
    Opt(parser=c.number("--prior-precision", 0.0), hidden=True, help="GLM/GGP VI, BBB: prior precision δ."),
]
InducingPointsOpt = Annotated[
    int | None, Opt(min=1, hidden=True, help="GGP VI: inducing points M (fitting inputs).")
]
# deprecated option (its parameter name) → the setting it fills, where the names differ
DEPRECATED_SETTING = {"train_batch_size": "batch_size"}
DEPRECATED_FIELD = {v: k for k, v in DEPRECATED_SETTING.items()}


def deprecated_settings(ctx: typer.Context) -> dict[str, Any]:
    """The settings the deprecated (hidden) per-method options give, each use warned about once,
    naming its ``--set`` spelling."""
    out = {}
    for param in ctx.command.params:
        if not getattr(param, "hidden", False) or ctx.params.get(param.name) is None:
            continue
        setting, value = DEPRECATED_SETTING.get(param.name, param.name), ctx.params[param.name]
        c.warn(f"{param.opts[0]} is deprecated and goes in the next release; use --set {setting}={value}")
        out[setting] = value
    return out


def fit_vi_cmd(
    ctx: typer.Context,
    data: Annotated[str, typer.Option(help="Fitting data spec, e.g. digits:train (required).")],
    model: Annotated[
        str, typer.Option(help="timm:NAME, torchvision:NAME, builtin:NAME, hf:FOLDER or py:module:factory.")
    ],
    out: Annotated[Path, typer.Option(help="Posterior file to write (.safetensors).")],
    method: Annotated[str, typer.Option(help="Variational method (the registry's of kind vi).")],
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
        typer.Option(
            "--set",
            help="Any setting of the method NAME=VALUE (repeatable), e.g. --set kl_weight=2e-7; "
            "each method's settings are listed below.",
        ),
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
    from bayescli.fitting.registry import methods, setting_fields

    c.setup(quiet, as_json, seed)
    if method not in methods("vi"):
        raise typer.BadParameter(f"choose one of {', '.join(methods('vi'))}", param_hint="--method")
    if out.suffix != ".safetensors":
        raise typer.BadParameter("posterior files are .safetensors", param_hint="--out")
    fields = setting_fields(method)
    shared = {"subset": subset.value, "select": select, "select_by": select_by, "seed": seed}
    # the command's own options fill the settings that have them; one given explicitly must apply
    options = {k: v for k, v in shared.items() if k in fields or _given(ctx, k)}
    options |= deprecated_settings(ctx)
    settings = vi_settings(method, options, setting or [])
    models, data_opts = c.option_groups(ctx.params)
    dev = c.resolve_device(device)
    with c.low_accuracy_seen() as seen:
        run = fit_from_specs(
            method,
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
        "method": method,
        "subset": subset.value,
        **post.summary(),
        "fit_seconds": post.meta.get("fit_seconds"),
        "preprocess": run.model.preprocess.source,
        **c.model_facts(run.model),
    }
    show_fit(run, seen, summary, f"{method} posterior", quiet, as_json)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given (not left at its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"
