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
echo "setting up .venv (one time, about half a minute)..." >&2
if [[ ! -x .venv/bin/python ]]; then
  # No bootstrap pip (venv's ensurepip: about 4 s); this Python's own pip puts uv straight in
  # (pip >= 22.3's --python), ensurepip only where that pip is older
  "$PYTHON" -m venv --without-pip .venv
fi
if ! "$PYTHON" -m pip --python .venv/bin/python install -q -c constraints.txt uv >/dev/null 2>&1; then
  .venv/bin/python -m ensurepip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -c constraints.txt uv 2>&1 | grep -v "^WARNING: Location" >&2 || true
fi
[[ -x .venv/bin/uv ]] || { echo "setup failed: could not install uv into .venv" >&2; exit 1; }
# uv, not pip, installs the dependencies: it downloads and unpacks them in parallel (from nothing,
# no download cache: the install 19 -> 7 s here; all of set-up 45 -> 21 s with the bytecode below).
# It reads UV_INDEX_URL, not pip's configuration: a site's own index (PIP_INDEX_URL, or index-url in
# pip.conf) is passed on. pip comes too, for `.venv/bin/pip install -e ".[gpu]"`.
if [[ -z ${UV_INDEX_URL:-} ]]; then
  UV_INDEX_URL=${PIP_INDEX_URL:-$("$PYTHON" -m pip config get global.index-url 2>/dev/null || true)}
  [[ -n $UV_INDEX_URL ]] && export UV_INDEX_URL || unset UV_INDEX_URL
fi
.venv/bin/uv pip install -q --python .venv/bin/python -c constraints.txt -e ".[test]" pip \
  || { echo "setup failed: uv could not install the dependencies" >&2; exit 1; }
# The check that everything imports also writes the bytecode of what runs (2,600 of site-packages'
# 11,000 modules), in two processes, one a core; where PYTHONDONTWRITEBYTECODE is set Python would
# never write it later and every process would compile its imports again. (compileall over
# site-packages: 14 s and 26 CPU-s here; this: 9 s and 14 CPU-s, the import check included.)
warm() { PYTHONDONTWRITEBYTECODE= .venv/bin/python -c "import $1" || { echo "setup failed: $1 did not import" >&2; exit 1; }; }
warm "jax, flax.linen, optax, orbax.checkpoint, marin.train.loop, marin.launch.slurm" &
warm "mlflow, matplotlib.pyplot, hydra, submitit, pytest, xdist, marin.track.worker, marin.track.report, marin.launch.entry"
wait $! || exit 1
compile_project
echo "$stamp" > .venv/.marin-stamp
