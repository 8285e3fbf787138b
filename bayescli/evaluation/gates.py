"""CI gates: ``--fail-if "PATH OP NUMBER"`` conditions on a report's ``results``.

``PATH`` is a dotted path into ``results`` (e.g. ``ood.noise:uniform.glm-probit.max_prob.auroc``);
keys may themselves contain dots (``fgsm.0.03.map.accuracy``): each step takes the longest key
that matches. ``OP`` is one of ``< <= > >=``. A condition that *holds* is a failure.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from bayescli.errors import BayescliError

_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
_PATTERN = re.compile(r"^\s*(\S+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+|nan|inf)\s*$")


@dataclass(frozen=True)
class Gate:
    text: str
    path: str
    op: str
    threshold: float


def parse_gate(text: str) -> Gate:
    match = _PATTERN.match(text)
    if not match:
        raise BayescliError(f"malformed --fail-if '{text}'; use \"PATH OP NUMBER\" with OP one of < <= > >=")
    path, op, number = match.groups()
    try:
        return Gate(text.strip(), path, op, float(number))
    except ValueError:
        raise BayescliError(f"malformed number in --fail-if '{text}'") from None


def numeric_paths(tree: dict, prefix: str = "") -> list[str]:
    """Every dotted path to a number in ``tree`` (lists are not addressable)."""
    out = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out += numeric_paths(value, path + ".")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out.append(path)
    return out


def resolve(tree: dict, path: str) -> float:
    """The number at ``path`` (longest-key matching at each level)."""
    node, rest = tree, path
    while rest:
        if not isinstance(node, dict):
            raise KeyError(path)
        keys = sorted((k for k in node if rest == k or rest.startswith(k + ".")), key=len, reverse=True)
        if not keys:
            raise KeyError(path)
        node, rest = node[keys[0]], rest[len(keys[0]) + 1 :]
    if isinstance(node, bool) or not isinstance(node, int | float):
        raise KeyError(path)
    return float(node)


def check_gates(results: dict, gates: list[Gate]) -> list[dict]:
    """Evaluate every gate; unknown paths are a usage error listing the valid ones."""
    outcomes = []
    for gate in gates:
        try:
            value = resolve(results, gate.path)
        except KeyError:
            paths = numeric_paths(results)
            shown = ", ".join(paths[:40]) + (f", … ({len(paths)} in all)" if len(paths) > 40 else "")
            raise BayescliError(
                f"--fail-if path '{gate.path}' is not in the results; valid paths: {shown}"
            ) from None
        outcomes.append(
            {"condition": gate.text, "value": value, "failed": bool(_OPS[gate.op](value, gate.threshold))}
        )
    return outcomes
