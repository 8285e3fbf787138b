"""Progress bars for long loops, on stderr so ``--json`` stdout stays machine-readable.

Bars are drawn only when stderr is a terminal: logs of CI jobs get no control sequences.

The library calls :func:`track`; whether anything is drawn is a process-wide setting the CLI
controls (``--quiet``), so the maths modules need not know about terminals.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")

_enabled = True
stderr_console = Console(stderr=True)


def set_enabled(enabled: bool) -> None:
    """Switch progress bars on or off for this process."""
    global _enabled
    _enabled = enabled


def track(items: Iterable[T], total: int | None = None, description: str = "") -> Iterator[T]:
    """Iterate over ``items`` with a transient rich progress bar on stderr (if enabled)."""
    if not (_enabled and stderr_console.is_terminal):
        yield from items
        return
    columns = (
        TextColumn("[bold blue]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=stderr_console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)
