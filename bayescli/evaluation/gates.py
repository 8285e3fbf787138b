"""CI gates: ``--fail-if "PATH OP NUMBER"`` conditions on a report's ``results``.

``PATH`` is a dotted path into ``results`` (e.g. ``ood.noise:uniform.glm-probit.max_prob.auroc``);
keys may themselves contain dots (``fgsm.0.03.map.accuracy``): each step takes the longest key
that matches. ``OP`` is one of ``< <= > >=``. A condition that *holds* is a failure.
"""

from __future__ import annotations

import operator
import os
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
        if node is None:
            raise LookupError(path)  # inside a null cell: a detector that could not be fitted
        if not isinstance(node, dict):
            raise KeyError(path)
        keys = sorted((k for k in node if rest == k or rest.startswith(k + ".")), key=len, reverse=True)
        if not keys:
            raise KeyError(path)
        node, rest = node[keys[0]], rest[len(keys[0]) + 1 :]
    if node is None:
        raise LookupError(path)  # a null cell: a detector that could not be fitted
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
        except LookupError:
            # no value (a detector that could not be fitted): the gate fails rather than pass silently
            outcomes.append({"condition": gate.text, "value": None, "failed": True})
            continue
        outcomes.append(
            {"condition": gate.text, "value": value, "failed": bool(_OPS[gate.op](value, gate.threshold))}
        )
    return outcomes


# --- checking paths before any work --------------------------------------------------------
# A skeleton of the results an evaluation will write: nested dicts whose leaves are None
# (a number); ANY stands for any key (a subtree the options cannot predict, e.g. conformal rows).
ANY = "*"
SUMMARY = ("accuracy", "nll", "brier", "ece", "mmc", "entropy")
IN_DISTRIBUTION = (
    *SUMMARY,
    "classwise_ece",
    "adaptive_ece",
    "mce",
    "accuracy_at_50",
    "accuracy_at_80",
    "accuracy_at_90",
    "aurc",
    "argmax_changed_fraction",
)
DETECTION = ("auroc", "aupr_in", "aupr_out", "fpr95", "tied_fraction")
_MAP_ONLY = ("mahalanobis", "rel_mahalanobis", "knn", "vim", "react", "odin")
_LOGITS = ("max_logit", "energy")
_POSTERIOR_ONLY = ("alpha0", "neg_mutual_information")
# multi-label (bernoulli) reports: bayescli.evaluation.multilabel
MULTILABEL_SUMMARY = (
    "map",
    "micro_f1",
    "macro_f1",
    "hamming_loss",
    "subset_accuracy",
    "nll",
    "brier",
    "ece",
    "mean_entropy",
)
MULTILABEL_IN_DISTRIBUTION = (
    *MULTILABEL_SUMMARY,
    *(f"{m}_at_{c}" for m in ("subset_accuracy", "hamming_loss") for c in (50, 80, 90)),
    "aurc_hamming",
    "aurc_subset",
)
_WITH_MI = ("neg_mi_sum", "neg_mi_max")  # the links with a per-label mutual information


def _leaves(keys: tuple[str, ...]) -> dict:
    return dict.fromkeys(keys)


def _detection(score: str, multilabel: bool) -> dict:
    # a softmax method's max_prob row also holds the ties of its float32 max probability
    extra = ("float32_tied_fraction",) if score == "max_prob" and not multilabel else ()
    return _leaves(DETECTION + extra)


def expected_results(
    methods: list[str],
    ood: list[str] = (),
    ood_scores: list[str] = (),
    rotations: list[str] = (),
    corruptions: dict[str, list[str]] | None = None,
    epsilons: list[str] = (),
    conformal: bool = False,
    fidelity: bool = False,
    likelihood: str = "categorical",
) -> dict:
    """The skeleton of ``results`` for these options (method names as in the report; set keys
    as the runner writes them: ``cifar10:test`` → ``cifar10``, angles ``f"{a:g}"``, severities
    as strings). A ``bernoulli`` (multi-label) report has the multi-label metrics, its
    ``per_label`` blocks keyed by class name."""
    multilabel = likelihood == "bernoulli"

    def per_method(leaves: tuple[str, ...]) -> dict:
        if multilabel:
            return {m: {**_leaves(leaves), "per_label": ANY} for m in methods}
        return {m: _leaves(leaves) for m in methods}

    def base(method: str) -> str:
        return method.rsplit("/", 1)[-1]

    def applies(score: str, m: str) -> bool:
        if multilabel:
            return not (score in _MAP_ONLY and base(m) != "map") and not (
                score in _WITH_MI and not base(m).endswith(("-mc", "-beta"))
            )
        return (
            not (score in _MAP_ONLY and base(m) != "map")
            and not (score in _LOGITS and base(m) not in ("map", "temp"))
            and not (score in _POSTERIOR_ONLY and base(m) in ("map", "temp"))
        )

    summary = MULTILABEL_SUMMARY if multilabel else SUMMARY
    tree: dict = {
        "in_distribution": per_method(MULTILABEL_IN_DISTRIBUTION if multilabel else IN_DISTRIBUTION)
    }
    if ood:
        mean = "mean_max_sigmoid" if multilabel else "mmc"
        cells = {
            m: {mean: None, **{s: _detection(s, multilabel) for s in ood_scores if applies(s, m)}}
            for m in methods
        }
        tree["ood"] = {(k[:-5] if k.endswith(":test") else k): cells for k in ood}
    if rotations:
        tree["rotation"] = {a: per_method(summary) for a in rotations}
    if corruptions:
        tree["corruption"] = {n: {s: per_method(summary) for s in sevs} for n, sevs in corruptions.items()}
    if epsilons:
        tree["fgsm"] = {e: per_method(summary) for e in epsilons}
    if conformal:
        tree["conformal"] = {m: ANY for m in methods}
    if fidelity:
        tree["link_fidelity"] = ANY
    return tree


def _matches(tree: dict | str | None, path: str) -> bool:
    """Whether ``path`` can name a number of the skeleton (longest-key matching, as ``resolve``)."""
    node, rest = tree, path
    while rest:
        if node == ANY:
            return True
        if not isinstance(node, dict):
            return False
        keys = sorted((k for k in node if rest == k or rest.startswith(k + ".")), key=len, reverse=True)
        if not keys:
            return False
        node, rest = node[keys[0]], rest[len(keys[0]) + 1 :]
    return node is None or node == ANY


def _skeleton_paths(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _skeleton_paths(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}" + (".*" if value == ANY else ""))
    return out


def check_paths(gates: list[Gate], expected: dict) -> None:
    """Refuse, before any work, a gate whose path the requested evaluation will not write."""
    for gate in gates:
        if not _matches(expected, gate.path):
            # those sharing the longest prefix with the unknown path first
            paths = sorted(
                _skeleton_paths(expected), key=lambda p: -len(os.path.commonprefix([p, gate.path]))
            )
            shown = ", ".join(paths[:40]) + (f", … ({len(paths)} in all)" if len(paths) > 40 else "")
            raise BayescliError(
                f"--fail-if path '{gate.path}' is not in what this evaluation reports; valid paths: {shown}"
            )
