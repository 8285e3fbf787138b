"""The Typer application and the process entry point (error handling, exit codes)."""

from __future__ import annotations

import sys
import warnings
from typing import Annotated

import click
import typer

from bayescli._version import __version__
from bayescli.cli import common
from bayescli.cli.conformal import conformal_cmd
from bayescli.cli.demo import demo
from bayescli.cli.evaluate import evaluate_cmd, report_cmd
from bayescli.cli.fit import fit_laplace_cmd
from bayescli.cli.fit_vi import FitViCommand, fit_vi_cmd
from bayescli.cli.inspect import inspect_cmd
from bayescli.cli.predict import predict_cmd
from bayescli.cli.select import select_cmd
from bayescli.cli.topk import topk_cmd
from bayescli.cli.train import train
from bayescli.errors import AllRanksError, BayescliError, BayescliWarning

app = typer.Typer(
    name="bayescli",
    help="Post-hoc Bayesian uncertainty for pretrained classifiers: Laplace approximations, "
    "variational posteriors (MNVI, FSVI, Dirichlet fVI), GLM predictives, the Laplace bridge, "
    "uncertainty-aware top-k, conformal sets and their evaluation against post-hoc baselines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bayescli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    common.state["debug"] = debug


# Typer ≥ 0.20 vendors click; older releases raise click's own exceptions. Accept both.
_EXIT = (click.exceptions.Exit, typer.Exit)
_ABORT = (click.exceptions.Abort, typer.Abort)
_USAGE = (click.ClickException, getattr(typer, "TyperException", click.ClickException))

app.command("inspect")(inspect_cmd)
app.command()(train)
app.command("fit-laplace")(fit_laplace_cmd)
app.command("fit-vi", cls=FitViCommand)(fit_vi_cmd)
app.command("select")(select_cmd)
app.command("predict")(predict_cmd)
app.command("topk")(topk_cmd)
app.command("conformal")(conformal_cmd)
app.command("evaluate")(evaluate_cmd)
app.command("report")(report_cmd)
app.command()(demo)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI: exit 0 ok, 1 a ``--fail-if`` gate failed, 2 bad usage or input, 3 a bug."""
    try:
        _run(argv)
    finally:
        # Under torchrun, leave the process group before the interpreter tears down its threads
        # (left to the exit handlers, Gloo can abort the process after a successful run).
        if "torch.distributed" in sys.modules:
            from bayescli import parallel

            parallel.shutdown()


def _run(argv: list[str] | None) -> None:
    try:
        # the library's warnings (a preset resizing the images more than 2×, …) become one
        # `warning:` line each on stderr; the commands print their own low-accuracy line
        with warnings.catch_warnings():
            warnings.simplefilter("always", BayescliWarning)
            warnings.showwarning = common.library_warnings(warnings.showwarning)
            rv = app(args=argv, standalone_mode=False)
    except _EXIT as exc:
        sys.exit(exc.exit_code)
    except _USAGE as exc:
        exc.show()
        sys.exit(2)
    except (*_ABORT, KeyboardInterrupt):
        typer.echo("interrupted; no partial output was written", err=True)
        sys.exit(130)
    except BayescliError as exc:
        if common.state["debug"]:
            raise
        # Under torchrun every rank stops with the same AllRanksError message: print it once.
        shared = isinstance(exc, AllRanksError)
        if common.is_main_process() or not shared:
            typer.echo(f"error: {exc}", err=True)
        if shared:
            from bayescli import parallel

            parallel.settle_after_error()
        sys.exit(2)
    except Exception as exc:
        if common.state["debug"]:
            raise
        typer.echo(f"internal error: {type(exc).__name__}: {exc}; rerun with --debug and report it", err=True)
        sys.exit(3)
    sys.exit(rv if isinstance(rv, int) else 0)
