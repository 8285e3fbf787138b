#!/usr/bin/env bash
# The project's environment, in two parts:
#  - shared, dependencies only: $BAYESCLI_ENV_ROOT/venv-<key> (default ~/.cache/bayescli), keyed by
#    the Python version and pyproject.toml's dependency list (`dependencies` and the `dev` and `docs`
#    extras: `make test` lints, tests and builds the docs), so torch (~5 GB) is installed once per
#    machine and list; never holds bayescli itself, so it cannot run one clone's code for another.
#  - per clone: .venv/ in this clone, a light venv of the same interpreter that sees the shared
#    site-packages and this clone's bayescli/, with bin/bayescli, bin/pytest, bin/torchrun and
#    bin/ruff. Rebuilt
#    (in well under a second) when the shared environment, the clone's path or this layout changes.
# Prints the per-clone environment's path on stdout; all progress goes to stderr.
# `scripts/env.sh --shared` prints the shared environment's path and builds nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
python=${BAYESCLI_PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
root=${BAYESCLI_ENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/bayescli}
deps=$("$python" - "$here/pyproject.toml" <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = p["optional-dependencies"]
print("\n".join(sorted(p["dependencies"]) + sorted(extras["dev"]) + sorted(extras["docs"])))
PY
)
key=$(printf '%s\n%s\n' "$("$python" -c 'import sys; print(sys.version)')" "$deps" | sha256sum | cut -c1-16)
venv="$root/venv-$key"
if [ "${1:-}" = --shared ]; then echo "$venv"; exit 0; fi
clone="$here/.venv"
stamp="bayescli-env 2 $venv $here"

locked=
lock() {  # one build at a time per shared environment (clones and makes running side by side)
  [ -n "$locked" ] && return 0
  locked=1
  mkdir -p "$root"
  if command -v flock >/dev/null 2>&1; then exec 9>"$venv.lock"; flock 9; fi
}
# bayescli in the shared environment (earlier versions of this script installed the clone there).
shared_bayescli() {
  compgen -G "$venv/lib/python*/site-packages/bayescli*" >/dev/null \
    || compgen -G "$venv/lib/python*/site-packages/__editable__*bayescli*" >/dev/null \
    || [ -e "$venv/bin/bayescli" ]
}
clone_ok() {
  [ -f "$clone/.bayescli-env" ] && [ "$(cat "$clone/.bayescli-env")" = "$stamp" ] && [ -x "$clone/bin/ruff" ] \
    && (cd / && "$clone/bin/python" -c 'import bayescli, importlib.util, pathlib, sys
sys.exit(pathlib.Path(bayescli.__file__).parent != pathlib.Path(sys.argv[1], "bayescli")
         or importlib.util.find_spec("typer") is None)' "$here") >/dev/null 2>&1
}

if [ ! -f "$venv/.complete" ] || shared_bayescli; then
  lock
  if [ ! -f "$venv/.complete" ]; then
    echo "bayescli: building environment $venv (once per dependency list)" >&2
    rm -rf "$venv"
    mkdir -p "$root"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel >&2
    # torch/torchvision first, from this machine's disk where available; ranges elsewhere.
    "$venv/bin/python" -m pip install -q "torch==2.14.1" "torchvision==0.29.1" >&2 \
      || "$venv/bin/python" -m pip install -q "torch>=2.2,<3" "torchvision>=0.17,<1" >&2
    printf '%s\n' "$deps" > "$venv/requirements.txt"
    "$venv/bin/python" -m pip install -q -r "$venv/requirements.txt" >&2
    touch "$venv/.complete"
  fi
  if shared_bayescli; then
    echo "bayescli: removing bayescli from the shared environment $venv (dependencies only)" >&2
    "$venv/bin/python" -m pip uninstall -y -q bayescli >/dev/null 2>&1 || true
    rm -rf "$venv"/lib/python*/site-packages/bayescli* "$venv"/lib/python*/site-packages/__editable__*bayescli* \
      "$venv/bin/bayescli"
  fi
fi

if ! clone_ok; then
  lock
  if [ -e "$clone" ] && [ ! -f "$clone/.bayescli-env" ]; then
    echo "bayescli: $clone exists and was not made by scripts/env.sh; move it away and run again" >&2
    exit 1
  fi
  echo "bayescli: making $clone (this clone's code on the shared dependencies)" >&2
  rm -rf "$clone"
  mkdir -p "$clone"
  echo building > "$clone/.bayescli-env"
  base=$("$venv/bin/python" -c 'import sys; print(sys._base_executable)')
  "$base" -m venv --without-pip "$clone" >&2
  "$clone/bin/python" - "$clone" "$here" "$venv" "$stamp" <<'PY'
import os, site as site_mod, sys, sysconfig, tomllib
from importlib.metadata import entry_points

clone, here, venv, stamp = sys.argv[1:]
shared = sysconfig.get_paths(vars={"base": venv, "platbase": venv})["purelib"]
site = sysconfig.get_paths()["purelib"]
os.makedirs(site, exist_ok=True)
# Processed in name order: this clone's bayescli/ comes before the shared site-packages, whose own
# .pth files addsitedir also runs.
with open(os.path.join(site, "_bayescli_clone.pth"), "w") as f:
    f.write(here + "\n")
with open(os.path.join(site, "_bayescli_shared.pth"), "w") as f:
    f.write(f"import site; site.addsitedir({shared!r})\n")
# Console scripts as pip writes them, for pyproject's [project.scripts], pytest and torchrun (which
# must start this clone's python: `torchrun -m bayescli` runs sys.executable); through /bin/sh
# where the kernel would not take the shebang.
site_mod.addsitedir(shared)
scripts = tomllib.load(open(os.path.join(here, "pyproject.toml"), "rb"))["project"].get("scripts", {})
for tool in ("pytest", "torchrun"):
    scripts.update({e.name: e.value for e in entry_points(group="console_scripts", name=tool)})
python = os.path.join(clone, "bin", "python")
if len(python) < 120 and " " not in python:
    head = f"#!{python}\n"
else:
    head = f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''\n"
for name, target in scripts.items():
    module, func = target.split(":")
    path = os.path.join(clone, "bin", name)
    with open(path, "w") as f:
        f.write(
            f"{head}import sys\nfrom {module} import {func}\nif __name__ == '__main__':\n"
            f"    sys.argv[0] = sys.argv[0].removesuffix('.exe')\n    sys.exit({func}())\n"
        )
    os.chmod(path, 0o755)
os.symlink(os.path.join(venv, "bin", "ruff"), os.path.join(clone, "bin", "ruff"))
with open(os.path.join(clone, ".bayescli-env"), "w") as f:
    f.write(stamp + "\n")
PY
  clone_ok || { echo "bayescli: $clone does not import this clone's bayescli" >&2; exit 1; }
fi
echo "$clone"
