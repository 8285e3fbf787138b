"""Every seed claim the project reproduces, one row each, beside the paper's number (issue 25 part 3).

Runs the row modules — ``seeds_vi`` (seeds 000–002: Dirichlet fVI, FSVI, MNVI) and ``seeds_glm``
(seeds 003–004: GLM/GGP predictives, Laplace bridge) — and prints one table: seed | table/figure |
claim | paper | ours | protocol differences | held. Each module exposes
``rows(quick: bool, shared: Path) -> list[dict]`` with the keys ``seed, where, claim, paper, ours,
protocol, held``. A module that fails (or is missing) becomes an error row and the script exits 1
after printing the rest; it also exits 1 when a row has an ``error`` key.

Run: ``python benchmarks/seeds.py [--quick] [--shared ../shared] [--json seeds.json] [--markdown]``
(``--quick``: a reduced version, under 15 minutes on 2 cores; the full table goes into README).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bayescli.io import write_json  # noqa: E402

MODULES = ("seeds_vi", "seeds_glm")
COLUMNS = (
    ("seed", "seed"),
    ("where", "table/figure"),
    ("claim", "claim"),
    ("paper", "paper"),
    ("ours", "ours"),
    ("protocol", "protocol differences"),
    ("held", "held"),
)


def run_module(name: str, quick: bool, shared: Path) -> list[dict]:
    """``name.rows(quick, shared)``, or one error row when the module cannot be imported or fails."""
    start = time.perf_counter()
    try:
        got = list(importlib.import_module(name).rows(quick, shared))
    except Exception as exc:  # a failing module must not lose the other modules' rows
        got = [
            {
                "seed": name,
                "where": "—",
                "claim": f"all rows of {name}",
                "paper": "—",
                "ours": f"error: {type(exc).__name__}: {exc}",
                "protocol": "—",
                "held": False,
                "error": traceback.format_exc(),
            }
        ]
    for row in got:
        row.setdefault("module", name)
        row.setdefault("seconds", round(time.perf_counter() - start, 1))
    return got


def held_text(row: dict) -> str:
    if "error" in row:
        return "error"
    return "held" if row["held"] else "not held"


def markdown(rows: list[dict]) -> str:
    """The README table (pipes in cells escaped)."""
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [held_text(row) if key == "held" else str(row[key]) for key, _ in COLUMNS]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict], title: str) -> Table:
    out = Table(title=title, show_lines=True)
    for key, name in COLUMNS:
        out.add_column(name, overflow="fold", no_wrap=key in ("held",))
    for row in rows:
        style = {"held": "green", "not held": "yellow", "error": "red"}[held_text(row)]
        out.add_row(*(str(row[k]) for k, _ in COLUMNS[:-1]), f"[{style}]{held_text(row)}[/{style}]")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="reduced runs (< 15 min on 2 cores)")
    ap.add_argument(
        "--shared", type=Path, default=HERE.parents[1] / "shared", help="holds data/mnist, data/notmnist"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the rows here (atomically)")
    ap.add_argument("--markdown", action="store_true", help="also print the README table (markdown)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--only", choices=MODULES, action="append", help="run only this module (repeatable)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows: list[dict] = []
    for name in args.only or MODULES:
        rows.extend(run_module(name, args.quick, args.shared))
    seconds = time.perf_counter() - start
    mode = "quick" if args.quick else "full"
    Console(width=200).print(table(rows, f"Seed claims ({mode}, {args.threads} threads, {seconds:.0f} s)"))
    for row in rows:
        if "error" in row:
            print(f"\n{row['module']} / {row['claim']}:\n{row['error']}", file=sys.stderr)
    if args.markdown:
        print(markdown(rows))
    if args.json:
        write_json(args.json, {"mode": mode, "threads": args.threads, "seconds": seconds, "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
