"""Progress for long commands, on stderr so ``--json`` stdout stays machine-readable.

Two levels: :func:`track` wraps a loop (batches, epochs, sets) and :func:`stage` marks the start
of one stage of a long command (a backbone pass, one method's fit, one suite). The CLI opens a
:func:`session` around the library call that runs the stages; inside it, with stderr a terminal,
one transient rich display shows the current stage and the loops under it; otherwise each stage
is one plain line on stderr (``select: [  12.3 s] fit laplace (2/5)``), so logs of CI jobs and
piped runs say where a command is without control sequences. Outside a session (library use)
stages print nothing and loops draw a bar only on a terminal.

Whether anything is shown is a process-wide setting the CLI controls (``--quiet``/``--json``
switch it off), so the maths modules need not know about terminals.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")

_enabled = True
stderr_console = Console(stderr=True)


@dataclass
class _Session:
    name: str
    start: float
    live: Progress | None  # the terminal display; None: plain lines
    stage_task: TaskID | None = None


_session: _Session | None = None


def set_enabled(enabled: bool) -> None:
    """Switch progress bars and stage lines on or off for this process."""
    global _enabled
    _enabled = enabled


def _columns() -> tuple:
    return (
        SpinnerColumn(),
        TextColumn("[bold blue]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )


@contextmanager
def session(name: str) -> Iterator[None]:
    """Report the :func:`stage` s run inside the block as command ``name`` (if enabled): a
    transient rich display on a terminal, else one line per stage on stderr."""
    global _session
    if not _enabled or _session is not None:
        yield
        return
    live = (
        Progress(*_columns(), console=stderr_console, transient=True) if stderr_console.is_terminal else None
    )
    _session = _Session(name, time.perf_counter(), live)
    try:
        if live is None:
            yield
        else:
            with live:
                yield
    finally:
        _session = None


def stage(description: str) -> None:
    """Mark the start of a stage (the previous one, if any, has ended) of the current
    :func:`session`; nothing outside one."""
    s = _session
    if s is None:
        return
    if s.live is None:
        elapsed = time.perf_counter() - s.start
        print(f"{s.name}: [{elapsed:7.1f} s] {description}", file=sys.stderr, flush=True)
    elif s.stage_task is None:
        s.stage_task = s.live.add_task(description, total=None)
    else:
        s.live.update(s.stage_task, description=description)


def track(items: Iterable[T], total: int | None = None, description: str = "") -> Iterator[T]:
    """Iterate over ``items`` with a transient rich progress bar on stderr (if enabled and a
    terminal); inside a :func:`session` the bar joins its display."""
    if not (_enabled and stderr_console.is_terminal):
        yield from items
        return
    live = _session.live if _session is not None else None
    if live is not None:
        task = live.add_task(description, total=total)
        try:
            for item in items:
                yield item
                live.advance(task)
        finally:
            live.remove_task(task)
        return
    with Progress(*_columns(), console=stderr_console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)
