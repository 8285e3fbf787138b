"""The option group and summary shared by the fitting commands (fit-laplace, fit-vi, select)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from bayescli.cli import common as c
from bayescli.options import Criterion

if TYPE_CHECKING:
    from bayescli.fitting.pipeline import FitRun

__all__ = ["Criterion", "SelectBy", "ValData", "ValSplit", "show_fit"]

ValData = Annotated[
    str | None,
    typer.Option(
        help="Held-out labelled data spec, disjoint from --data, on which each method's key "
        "hyperparameter is chosen (default: the validation split a bayescli train checkpoint records).",
        rich_help_panel="Validation",
    ),
]
ValSplit = Annotated[
    float | None,
    typer.Option(
        parser=c.number("--val-split", 0.0, 1.0),
        help="Hold out this seeded fraction of --data for validation (only for data the net never saw: "
        "a net has memorised its training rows).",
        rich_help_panel="Validation",
    ),
]
SelectBy = Annotated[
    Criterion,
    typer.Option(help="Validation criterion the hyperparameters minimise.", rich_help_panel="Validation"),
]


def show_fit(run: FitRun, seen: list, summary: dict, title: str, quiet: bool, as_json: bool) -> None:
    """Print a fit's summary table (or JSON) with its validation facts, and its warnings: low MAP
    accuracy on the fitting data, the selection's own warning, nothing validated."""
    from bayescli.fitting.pipeline import NOT_VALIDATED

    post = run.posterior
    summary = {**summary, **run.facts()}
    warnings = [str(w) for w in seen]
    records = {**post.meta, **post.selection_metadata()}  # what the file says
    blocks = [records.get("selection") or {}, *(v for k, v in records.items() if k != "selection")]
    for block in blocks:
        if isinstance(block, dict) and block.get("warning") and block["warning"] not in warnings:
            warnings.append(block["warning"])
    if run.val is None and (post.selection is None or post.selection.how != "fixed"):
        warnings.append(NOT_VALIDATED)
    for message in warnings:
        c.warn(message)
    summary["warnings"] = warnings
    c.show(
        quiet,
        as_json,
        c.table(title, ["", "value"], [[k, v] for k, v in summary.items() if k != "warnings"]),
        payload=summary,
    )
