"""The commands the docs show, run as written: the guides' command blocks are sections of the shell
scripts in ``docs/snippets/`` (included with pymdownx.snippets), and their console output is what
this script recorded when it ran them.

A snippet script is a list of commands, one per line (``\\`` continues a line), run one after the
other in one working directory, each by its own ``bash -c`` (no shell state carries over: every
command stands as a user would paste it). A command ending in ``# exit N`` must exit with N (an
error the guide shows); every other command must exit 0. ``# --8<-- [start:NAME]`` /
``# --8<-- [end:NAME]`` mark the sections a guide includes; commands outside sections are set-up
the guide does not show.

    python scripts/docs_snippets.py            # run every script, write docs/snippets/output/*.txt
    python scripts/docs_snippets.py quickstart # only docs/snippets/quickstart.sh

Output files hold ``$ COMMAND`` and what it printed (stdout and stderr) for each command of a
section; ``docs/snippets/output/machine.txt`` says where they ran. ``tests/test_docs.py`` runs the
same scripts (with ``fast=True``: fewer training epochs) and checks that the recorded commands are
still the scripts' commands.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = ROOT / "docs" / "snippets"
OUTPUT = SNIPPETS / "output"
_MARK = re.compile(r"^#\s*--8<--\s*\[(start|end):([\w-]+)\]\s*$")
_EXIT = re.compile(r"#\s*exit\s+(\d+)\s*$")
# The fast variant the tests run: training and VI fits run fewer epochs and `select` compares
# three methods, not the default seven (the recorded outputs are of the commands as shown).
FAST_ARGS = {
    "bayescli train": ["--epochs", "3"],
    "bayescli fit-vi": ["--set", "epochs=2"],
    "bayescli select": ["--methods", "laplace-kron,mnvi,temperature"],
}
# Scripts whose shown commands train the checkpoint themselves; the others' set-up line trains one
# only when none is there, and they share the first one trained (the tests give them theirs).
TRAINS = {"tour"}
# Files a script makes that the docs show (figures), copied out of its working directory.
KEEP = {"quickstart": {"figures/reliability.png": "docs/assets/reliability.png"}}
# Rich tables are as wide as the terminal; the recorded output is as wide as the docs' code blocks.
COLUMNS = "100"


@dataclass(frozen=True)
class Command:
    text: str  # as the script writes it, continuation lines included
    section: str | None
    expect: int  # the exit code the guide shows

    @property
    def line(self) -> str:
        """The command on one line (continuations joined)."""
        return re.sub(r"\\\n\s*", "", self.text)


def parse(script: Path) -> list[Command]:
    """The commands of ``script`` in order, with the section each is in."""
    commands: list[Command] = []
    section: str | None = None
    pending: list[str] = []
    for raw in script.read_text().splitlines():
        if pending:
            pending.append(raw)
            if not raw.rstrip().endswith("\\"):
                text = "\n".join(pending)
                commands.append(Command(text, section, _expect(text)))
                pending = []
            continue
        mark = _MARK.match(raw.strip())
        if mark:
            kind, name = mark.groups()
            if kind == "start":
                if section is not None:
                    raise ValueError(f"{script.name}: section {name} starts inside {section}")
                section = name
            else:
                if section != name:
                    raise ValueError(f"{script.name}: end of {name} outside it")
                section = None
            continue
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending = [raw]
        else:
            commands.append(Command(raw, section, _expect(raw)))
    if pending or section is not None:
        raise ValueError(f"{script.name}: unterminated command or section")
    return commands


def _expect(text: str) -> int:
    found = _EXIT.search(text.splitlines()[-1])
    return int(found.group(1)) if found else 0


def scripts() -> list[Path]:
    return sorted(SNIPPETS.glob("*.sh"))


def environment(bin_dir: Path) -> dict[str, str]:
    """The environment the commands run in: ``bayescli`` (and ``python``) from ``bin_dir`` first on
    PATH, tables ``COLUMNS`` wide, no colour; ``$SNIPPETS`` and ``$ROOT`` name the snippet folder
    and the repository (for set-up lines that copy a file the guide shows)."""
    env = dict(os.environ)
    env.update(SNIPPETS=str(SNIPPETS), ROOT=str(ROOT))
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.update(COLUMNS=COLUMNS, NO_COLOR="1", TERM="dumb", PYTHONUNBUFFERED="1")
    return env


@dataclass(frozen=True)
class Ran:
    command: Command
    code: int
    output: str
    seconds: float


def run(script: Path, workdir: Path, bin_dir: Path, fast: bool = False) -> list[Ran]:
    """Run every command of ``script`` in ``workdir``; raises ``AssertionError`` naming the command
    whose exit code is not the one the script expects."""
    env = environment(bin_dir)
    ran = []
    for cmd in parse(script):
        line = cmd.line
        if fast:
            for prefix, extra in FAST_ARGS.items():
                if prefix in line:
                    line = line.replace(prefix, " ".join([prefix, *extra]), 1)
        start = time.perf_counter()
        proc = subprocess.run(
            ["bash", "-c", line], cwd=workdir, env=env, capture_output=True, text=True, check=False
        )
        seconds = time.perf_counter() - start
        output = proc.stdout + proc.stderr
        if proc.returncode != cmd.expect:
            raise AssertionError(
                f"{script.name}: `{line}` exited {proc.returncode} (the guide shows {cmd.expect})\n{output}"
            )
        ran.append(Ran(cmd, proc.returncode, output, seconds))
    return ran


def recorded(text: str) -> list[str]:
    """The commands an output file records (its ``$ `` lines, continuations joined)."""
    commands, current = [], None
    for line in text.splitlines():
        if line.startswith("$ "):
            current = [line[2:]]
            commands.append(current)
        elif current is not None and current[-1].rstrip().endswith("\\"):
            current.append(line)
        else:
            current = None
    return [re.sub(r"\\\n\s*", "", "\n".join(c)) for c in commands]


def output_name(script: Path, section: str) -> Path:
    return OUTPUT / f"{script.stem}.{section}.txt"


def machine() -> str:
    import torch  # noqa: PLC0415 - only where the outputs are written

    from bayescli import __version__

    cpu = platform.processor() or platform.machine()
    return (
        f"{os.cpu_count()}-core CPU ({cpu}), {platform.system()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, bayescli {__version__}, {torch.get_num_threads()} torch threads; "
        f"load average {os.getloadavg()[1]:.1f} over the last 5 minutes of the run (timings are of a "
        "shared machine)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("only", nargs="*", help="script stems to run (default: all)")
    args = ap.parse_args()
    bin_dir = Path(sys.executable).parent
    OUTPUT.mkdir(parents=True, exist_ok=True)
    shared = Path(tempfile.mkdtemp())  # the first model.safetensors a script trains serves the rest
    for script in scripts():
        if args.only and script.stem not in args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            if (shared / "model.safetensors").exists() and script.stem not in TRAINS:
                shutil.copyfile(shared / "model.safetensors", Path(tmp, "model.safetensors"))
            start = time.perf_counter()
            ran = run(script, Path(tmp), bin_dir)
            if Path(tmp, "model.safetensors").exists() and not (shared / "model.safetensors").exists():
                shutil.copyfile(Path(tmp, "model.safetensors"), shared / "model.safetensors")
            print(f"{script.name}: {len(ran)} commands, {time.perf_counter() - start:.0f} s", file=sys.stderr)
            for made, kept in KEEP.get(script.stem, {}).items():
                shutil.copyfile(Path(tmp, made), ROOT / kept)
        sections: dict[str, list[str]] = {}
        for r in ran:
            if r.command.section is not None:
                body = r.output.rstrip("\n")
                sections.setdefault(r.command.section, []).append(
                    f"$ {r.command.text}" + (f"\n{body}" if body else "")
                )
        for name, blocks in sections.items():
            output_name(script, name).write_text("\n".join(blocks) + "\n")
    (OUTPUT / "machine.txt").write_text(machine() + "\n")
    shutil.rmtree(shared)


if __name__ == "__main__":
    main()
