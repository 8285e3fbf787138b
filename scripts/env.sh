#!/usr/bin/env bash
# Create or reuse the project's virtual environment, outside the clone, keyed by the
# dependency list: a change in pyproject.toml's dependencies makes a fresh one.
# Prints the environment's path on stdout; all progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
python=${BAYESCLI_PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
root=${BAYESCLI_ENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/bayescli}
deps=$("$python" - "$here/pyproject.toml" <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(sorted(p["dependencies"]) + sorted(p["optional-dependencies"]["dev"])))
PY
)
key=$(printf '%s\n%s\n' "$("$python" -c 'import sys; print(sys.version)')" "$deps" | sha256sum | cut -c1-16)
venv="$root/venv-$key"
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
# The project itself is cheap to (re)install; editable so the current clone is the one used.
if ! (cd / && "$venv/bin/python" -c "import bayescli, pathlib, sys; sys.exit(pathlib.Path(bayescli.__file__).resolve().parent != pathlib.Path('$here/bayescli').resolve())" 2>/dev/null); then
  log=$(mktemp)
  if ! "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$here" >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; exit 1
  fi
  rm -f "$log"
fi
echo "$venv"
