"""Two clones on one machine each run their own code (issue 22): the cached environment under
~/.cache/bayescli holds the dependencies only, and each clone's scripts/env.sh (what every make
target runs first) gives that clone an environment importing its own bayescli/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _shared_venv() -> Path:
    """The shared environment this interpreter's dependencies come from; skips where that is not a
    complete scripts/env.sh environment (this test never builds one: torch is ~5 GB)."""
    if not (REPO / "scripts" / "env.sh").is_file():
        pytest.skip("not run from a checkout with scripts/env.sh")
    import typer

    # <venv>/lib/pythonX.Y/site-packages/typer/__init__.py
    return Path(os.path.abspath(typer.__file__)).parents[4]


def _clone(dest: Path, name: str) -> Path:
    """The working tree's files that `make env` needs, with a version marking this copy."""
    dest.mkdir()
    for f in ("pyproject.toml", "Makefile"):
        shutil.copy2(REPO / f, dest / f)
    for d in ("scripts", "bayescli"):
        shutil.copytree(REPO / d, dest / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    with open(dest / "bayescli" / "_version.py", "a") as f:
        f.write(f'__version__ = "0.0.0+{name}"\n')
    return dest


def _run(cmd, cwd, env) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out.stdout.strip()


def test_two_clones_each_run_their_own_code(tmp_path):
    venv = _shared_venv()
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(BAYESCLI_ENV_ROOT=str(venv.parent), BAYESCLI_PYTHON=sys._base_executable)
    a, b = _clone(tmp_path / "a", "clone-a"), _clone(tmp_path / "b", "clone-b")
    shared = _run(["bash", "scripts/env.sh", "--shared"], a, env)
    if shared != str(venv) or not (venv / ".complete").is_file():
        pytest.skip(
            f"the running interpreter's dependencies ({venv}) are not the complete scripts/env.sh "
            f"environment for this pyproject.toml ({shared}); run it through `make test`"
        )

    # Clone a as scripts/env.sh, then clone b as `make env`, in that order: one environment shared
    # by both would now run b's code for a.
    envs = {a: Path(_run(["bash", "scripts/env.sh"], a, env))}
    envs[b] = Path(
        _run(["make", "-s", "env"], b, env)
        if shutil.which("make")
        else _run(["bash", "scripts/env.sh"], b, env)
    )
    neutral = tmp_path / "elsewhere"
    neutral.mkdir()
    for clone, name in [(a, "clone-a"), (b, "clone-b")]:
        v = envs[clone]
        code = "import bayescli; print(bayescli.__file__)"
        imported = _run([v / "bin" / "python", "-c", code], neutral, env)
        assert Path(imported).resolve() == (clone / "bayescli" / "__init__.py").resolve()
        assert _run([v / "bin" / "bayescli", "--version"], neutral, env) == f"bayescli 0.0.0+{name}"
        assert "Usage" in _run([v / "bin" / "bayescli", "--help"], neutral, env)
        # What `make test` and `make lint` run.
        _run([v / "bin" / "ruff", "--version"], neutral, env)
        _run([v / "bin" / "python", "-m", "pytest", "--version"], neutral, env)

    # The shared environment holds no bayescli that could shadow a clone.
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([venv / "bin" / "python", "-c", code], neutral, env))
    assert not sorted(p.name for p in site.glob("*bayescli*"))
    gone = subprocess.run(
        [venv / "bin" / "python", "-c", "import bayescli"],
        cwd=neutral,
        env=env,
        capture_output=True,
        text=True,
    )
    assert gone.returncode != 0 and "No module named 'bayescli'" in gone.stderr
