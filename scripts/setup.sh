#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment at .venv with pinned dependencies.
# Idempotent: does nothing when .venv already matches pyproject.toml + constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
# The project's own modules, each time (compileall rewrites only what changed; well under a second):
# every launch.py, tracking process and Slurm task imports them, and where PYTHONDONTWRITEBYTECODE
# is set Python would compile them afresh in each (about 0.25 CPU-s a process)
compile_project() { .venv/bin/python -m compileall -q -j 0 marin hydra_plugins launch.py >/dev/null 2>&1 || true; }
if [[ -x .venv/bin/python && -f .venv/.marin-stamp && $(cat .venv/.marin-stamp) == "$stamp" ]]; then
  compile_project
  exit 0
fi
echo "setting up .venv (one time, about a minute)..." >&2
if [[ ! -x .venv/bin/python ]]; then
  # No bootstrap pip (venv's ensurepip: about 4 s, then replaced anyway): this Python's own pip puts
  # the newest pip straight in (pip >= 22.3's --python); ensurepip only where that pip is older
  "$PYTHON" -m venv --without-pip .venv
  "$PYTHON" -m pip --python .venv/bin/python install -q --upgrade pip >/dev/null 2>&1 || true
fi
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  .venv/bin/python -m ensurepip >/dev/null
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" >&2 || true
fi
# --no-compile, then compileall on every core: pip byte-compiles what it installs on one core (about
# 30 s here); the bytecode is written now because a PYTHONDONTWRITEBYTECODE environment never writes it later.
# Not the packages' own test suites (a fifth of the source, never imported): 23 -> 15 s here
.venv/bin/python -m pip install -q --no-compile -c constraints.txt -e ".[test]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
.venv/bin/python -m compileall -q -j 0 -x '/tests/' "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null 2>&1 || true
.venv/bin/python -c "import jax, flax, optax, hydra, mlflow, submitit, orbax.checkpoint" \
  || { echo "setup failed: dependencies did not import" >&2; exit 1; }
compile_project
echo "$stamp" > .venv/.marin-stamp
