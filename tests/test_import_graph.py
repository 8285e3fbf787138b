"""The package's import graph is the pipeline of DESIGN.md §1: no cycles, and no module reaches up.

Every import counts — module level, function-local and ``if TYPE_CHECKING:`` alike: a cycle that
only type checkers or a late call see is still a loop in the design. The floors below are the
layers of ``docs/internals.md``; a module may import from its own floor and the floors beneath.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "bayescli"

# (module or package prefix, floor); the longest matching prefix wins.
FLOORS = {
    "bayescli": 0,  # errors, options, io, numbers, devices, parallel, progress, dirichlet maths
    "bayescli.data": 1,
    "bayescli.models": 1,
    "bayescli.metrics": 1,
    "bayescli.models.features": 2,
    "bayescli.fitting.fit_source": 2,
    # a table of "module:attribute" strings: it imports no method, so posteriors may read it
    "bayescli.fitting.registry": 2,
    "bayescli.posterior": 3,
    "bayescli.predictive": 4,
    "bayescli.fitting.laplace": 5,
    "bayescli.training": 5,
    "bayescli.evaluation": 5,
    "bayescli.fitting.pipeline": 6,
    "bayescli.fitting.dense": 6,
    "bayescli.fitting.select": 6,
    "bayescli.evaluation.report": 6,
    "bayescli.api": 6,
    "bayescli.cli": 7,
    "bayescli.__main__": 7,
}


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package (packages by their ``__init__``)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, every import statement included."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names if a.name.startswith("bayescli")]
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("bayescli")
            ):
                # ``from bayescli.x import y`` imports the module bayescli.x.y when there is one
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else known(node.module)
                    for a in node.names
                ]
            graph[name].update(t for t in targets if t is not None and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def floor(module: str) -> int:
    prefix = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[prefix]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(module_files())


def test_the_package_has_no_import_cycles(graph):
    loops = cycles(graph)
    detail = "\n".join("\n".join(f"  {m} -> {sorted(graph[m] & set(loop))}" for m in loop) for loop in loops)
    assert not loops, f"import cycles:\n{detail}"


def test_no_module_imports_from_a_floor_above_its_own(graph):
    upward = [
        f"{m} (floor {floor(m)}) imports {t} (floor {floor(t)})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if t != "bayescli" and floor(t) > floor(m)
    ]
    assert not upward, "\n".join(upward)


def test_the_checks_see_function_local_and_type_checking_imports(tmp_path):
    """The walker's own oracle: a package whose only loop goes through a function-local import and
    a ``TYPE_CHECKING`` block."""
    pkg = tmp_path / "bayescli"
    (pkg / "posterior").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "api.py").write_text("from bayescli.posterior import base\n")
    (pkg / "posterior" / "__init__.py").write_text("")
    (pkg / "posterior" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bayescli.posterior import vi\n"
        "def predict():\n    from bayescli.api import x\n"
    )
    (pkg / "posterior" / "vi.py").write_text("import bayescli.posterior.base\n")
    graph = import_graph(module_files(pkg))
    assert graph["bayescli.posterior.base"] == {"bayescli.posterior.vi", "bayescli.api"}
    assert sorted(map(sorted, cycles(graph))) == [
        ["bayescli.api", "bayescli.posterior.base", "bayescli.posterior.vi"]
    ]
    assert floor("bayescli.posterior.base") < floor("bayescli.api")


def test_no_subpackage_shadows_a_top_level_name():
    """``bayescli.methods()`` and friends are resolved lazily; a subpackage of the same name would
    replace them with a module once anything imports it."""
    import importlib
    import types

    import bayescli

    for name in module_files():
        if name != "bayescli.__main__":
            importlib.import_module(name)
    shadowed = [n for n in bayescli._EXPORTS if isinstance(getattr(bayescli, n), types.ModuleType)]
    assert not shadowed, f"top-level names shadowed by modules: {shadowed}"
