"""The docs cannot drift from the code: every command a guide shows runs, every recorded output is
of the commands the scripts hold now, generated pages are current, README's commands, Python lines
and method table come from what the tests run, and every public name the API reference renders has
a docstring (mkdocstrings renders a missing one as nothing, without a warning, so ``--strict``
cannot catch it).

The guides' scripts (``docs/snippets/*.sh``) run here in their fast variant: the session's trained
digits checkpoint stands in for the one their set-up line would train, ``bayescli train``
commands train for 3 epochs and ``select`` compares three methods (``docs_snippets.FAST_ARGS``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

import bayescli
from bayescli.fitting.registry import methods as registry_methods

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


snippets = _load("docs_snippets")
docs_gen = _load("docs_gen")
SCRIPTS = {p.stem: p for p in snippets.scripts()}
PAGES = sorted(DOCS.rglob("*.md"))


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


# What each script must leave behind: the files and JSON keys its guide talks about.
def _check_quickstart(d: Path) -> None:
    report = _json(d / "report.json")
    assert {"in_distribution", "ood"} <= set(report["results"])
    assert report["gates"] and not report["gates"][0]["failed"]
    assert (d / "report.html").exists() and (d / "figures" / "reliability.png").exists()


def _check_tour(d: Path) -> None:
    for name in ("model.safetensors", "posterior.safetensors", "dirichlet.safetensors"):
        assert (d / name).exists()
    pred = _json(d / "pred.json")
    assert pred["link"] == "probit" and {"predicted", "max_prob"} <= set(pred["rows"][0])
    topk = _json(d / "topk.json")
    assert "mean_k" in topk["summary"] and len(topk["sets"]) == len(pred["rows"])
    conformal = _json(d / "conformal.json")
    assert "coverage" in json.dumps(conformal) and len(conformal["sets"]) == len(pred["rows"])


def _check_checkpoints(d: Path) -> None:
    assert (d / "mlp-laplace.safetensors").exists() and (d / "pred.json").exists()


def _check_select(d: Path) -> None:
    board = _json(d / "select" / "leaderboard.json")
    assert set(board["methods"]) == {"laplace-kron", "mnvi", "temperature"}  # FAST_ARGS
    assert board["best"] in board["methods"] and (d / "select" / "best.safetensors").exists()


def _check_methods(d: Path) -> None:
    results = _json(d / "compare.json")["results"]["in_distribution"]
    assert {"map", "mnvi/glm-probit", "glm-vi/glm-probit", "laplace-marglik/glm-probit"} <= set(results)
    assert (d / "laplace-diag.safetensors").exists()


def _check_evaluation(d: Path) -> None:
    results = _json(d / "report.json")["results"]
    assert {"in_distribution", "ood", "rotation", "corruption", "fgsm", "conformal"} <= set(results)
    assert (d / "report.html").exists()


def _check_ci_gate(d: Path) -> None:
    assert len(_json(d / "report.json")["gates"]) == 3
    assert "map_accuracy" in _json(d / "inspect.json")


def _check_scale(d: Path) -> None:
    assert any((d / "features").iterdir())
    assert _json(d / "report-2proc.json")["results"]["in_distribution"]
    assert not (d / "posterior-fp16.safetensors").exists()


def _check_multilabel(d: Path) -> None:
    report = _json(d / "multi-report.json")
    assert report["likelihood"] == "bernoulli"
    assert "3" in report["results"]["in_distribution"]["glm-probit"]["per_label"]["nll"]


def _check_segmentation(d: Path) -> None:
    report = _json(d / "seg-report.json")
    assert report["task"] == "segmentation" and set(report["results"]["in_distribution"]) == {
        "map",
        "temp",
        "glm-probit",
    }
    cell = report["results"]["anomaly"]["digit-scenes:anomaly"]["glm-probit"]
    assert cell["anomalous"] > 0 and {"auroc", "ap", "fpr95", "error_bound"} <= set(cell["entropy"])
    assert len(report["gates"]) == 2 and not any(g["failed"] for g in report["gates"])


def _check_python_api(d: Path) -> None:
    assert (d / "laplace.safetensors").exists()


def _check_troubleshooting(d: Path) -> None:
    # the one command that succeeds (validation on training rows: a warning) wrote its posterior
    assert (d / "p.safetensors").exists()


CHECKS = {
    "quickstart": _check_quickstart,
    "tour": _check_tour,
    "checkpoints": _check_checkpoints,
    "select": _check_select,
    "methods": _check_methods,
    "evaluation": _check_evaluation,
    "ci_gate": _check_ci_gate,
    "scale": _check_scale,
    "multilabel": _check_multilabel,
    "segmentation": _check_segmentation,
    "python_api": _check_python_api,
    "troubleshooting": _check_troubleshooting,
}


def test_every_script_has_its_checks():
    assert set(CHECKS) == set(SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_guide_script_runs(name, digits_ckpt, tmp_path):
    """Every command of the script exits as the guide shows, and leaves what the guide says."""
    if name not in snippets.TRAINS:
        shutil.copyfile(digits_ckpt, tmp_path / "model.safetensors")
    snippets.run(SCRIPTS[name], tmp_path, Path(sys.executable).parent, fast=True)
    CHECKS[name](tmp_path)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_recorded_output_is_of_the_scripts_commands(name):
    """Each section's recorded output holds exactly the section's commands, in order: a command
    changed in a script without rerunning ``scripts/docs_snippets.py`` fails here."""
    sections: dict[str, list[str]] = {}
    for cmd in snippets.parse(SCRIPTS[name]):
        if cmd.section is not None:
            sections.setdefault(cmd.section, []).append(cmd.line)
    for section, lines in sections.items():
        path = snippets.output_name(SCRIPTS[name], section)
        assert path.exists(), f"{path.name} missing: run python scripts/docs_snippets.py {name}"
        assert snippets.recorded(path.read_text()) == lines, f"{path.name} is stale: rerun {name}"


def test_machine_label_is_recorded():
    text = (snippets.OUTPUT / "machine.txt").read_text()
    assert "CPU" in text and "torch" in text and "bayescli" in text


def test_guides_include_existing_sections():
    """``--8<-- "SCRIPT.sh:SECTION"`` names a section the script has, and every section is shown
    (its commands or its recorded output) somewhere."""
    shown = set()
    for page in PAGES:
        for target in re.findall(r'--8<-- "([^"]+)"', page.read_text()):
            if target.startswith("output/") and target.count(".") == 2:
                stem, section = Path(target).stem.split(".", 1)
            elif ".sh:" in target:
                stem, section = target.split(".sh:")
            else:
                continue
            assert section in {c.section for c in snippets.parse(SCRIPTS[stem])}, (page.name, target)
            shown.add((stem, section))
    every = {(s, c.section) for s, p in SCRIPTS.items() for c in snippets.parse(p) if c.section}
    assert every <= shown, f"sections no page shows: {sorted(every - shown)}"


def test_examples_run_in_a_guide_script():
    """Each ``examples/*.py`` is run by a snippet script, so the suite runs it."""
    scripts_text = "\n".join(p.read_text() for p in SCRIPTS.values())
    for example in (ROOT / "examples").glob("*.py"):
        assert f"examples/{example.name}" in scripts_text, example.name


@pytest.mark.parametrize("page", sorted(docs_gen.PAGES))
def test_generated_page_is_current(page):
    text = docs_gen.PAGES[page]()
    assert (docs_gen.GENERATED / page).read_text() == text, f"run python scripts/docs_gen.py ({page})"


# -- README -----------------------------------------------------------------------------------------

README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_is_short_and_its_figure_small():
    assert len(README.splitlines()) <= 200
    figure = ROOT / "docs" / "assets" / "reliability.png"
    assert "docs/assets/reliability.png" in README and figure.stat().st_size <= 100_000


def test_readme_commands_are_run_by_the_guide_scripts():
    """Every ``bayescli`` command in README is a command a snippet script runs, verbatim."""
    run = {c.line for p in SCRIPTS.values() for c in snippets.parse(p)}
    commands = [
        re.sub(r"\\\n\s*", "", c)
        for block in _blocks("bash")
        for c in re.split(r"\n(?=\S)", block.strip())
        if c.startswith("bayescli ")
    ]
    assert len(commands) >= 4
    for command in commands:
        assert command in run, command


def test_readme_python_is_the_example():
    """README's Python lines are lines of ``examples/python_api.py``, which the suite runs."""
    example = {line.strip() for line in (ROOT / "examples" / "python_api.py").read_text().splitlines()}
    lines = [line.strip() for block in _blocks("python") for line in block.splitlines() if line.strip()]
    assert len(lines) >= 5
    for line in lines:
        assert line in example, line


def test_readme_method_table_is_the_registry():
    table = re.findall(r"^\| `([\w-]+)` \|", README, flags=re.M)
    assert table == registry_methods()


def test_readme_links_exist():
    for target in re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]+)", README):
        assert (ROOT / target).exists(), target


# -- docstrings of what the API reference renders ---------------------------------------------------


def _rendered() -> list[tuple[str, object]]:
    """(name, object) for each ``::: target`` of the docs and each member it lists."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for target, options in re.findall(r"^::: ([\w.]+)\n((?:    .*\n)*)", text, flags=re.M):
            module_name, obj = target, None
            while obj is None:
                try:
                    obj = importlib.import_module(module_name)
                except ModuleNotFoundError:
                    module_name, _, _ = module_name.rpartition(".")
            for part in target[len(module_name) :].strip(".").split(".") if target != module_name else []:
                obj = getattr(obj, part)
            found.append((target, obj))
            listed = re.search(r"members: \[(.*)\]", options)
            for member in listed.group(1).split(",") if listed else []:
                found.append((f"{target}.{member.strip()}", getattr(obj, member.strip())))
    return found


def test_api_reference_names_have_docstrings():
    rendered = _rendered()
    assert len(rendered) > 30
    for name, obj in rendered:
        assert inspect.getdoc(obj), f"{name} has no docstring (the API reference would show nothing)"


def test_top_level_exports_have_docstrings():
    for name in bayescli.__all__:
        if name != "__version__":
            assert inspect.getdoc(getattr(bayescli, name)), f"bayescli.{name} has no docstring"


def test_public_functions_of_the_api_module_have_docstrings():
    from bayescli import api

    for name, obj in vars(api).items():
        if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == api.__name__:
            assert inspect.getdoc(obj), f"bayescli.api.{name} has no docstring"
