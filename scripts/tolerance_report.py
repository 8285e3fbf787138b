"""Merge tolerance logs (``BAYESCLI_TOL_LOG``) from several runs; print the worst ratio per check.

Usage: ``python scripts/tolerance_report.py LABEL=FILE [LABEL=FILE ...]``. A ratio is the observed
error over the allowed one; the suite's standard is a margin of at least 10× (ratio ≤ 0.1) in
every setting. Checks above that are listed first.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    labels = []
    worst: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for arg in argv:
        label, _, path = arg.partition("=")
        labels.append(label)
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                row = json.loads(line)
                key = (row["test"], row["what"])
                worst[key][label] = max(worst[key].get(label, 0.0), row["ratio"])
    rows = sorted(worst.items(), key=lambda kv: -max(kv[1].values()))
    width = max(len(f"{t} [{w}]") for t, w in worst) if worst else 10
    print(f"{'check':<{width}}  " + "  ".join(f"{lab:>12}" for lab in labels) + "  max")
    for (test, what), per in rows:
        vals = "  ".join(f"{per.get(lab, float('nan')):12.3g}" for lab in labels)
        print(f"{test + ' [' + what + ']':<{width}}  {vals}  {max(per.values()):.3g}")
    over = [k for k, per in rows if max(per.values()) > 0.1]
    print(f"{len(rows)} checks; {len(over)} with a margin under 10×")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
