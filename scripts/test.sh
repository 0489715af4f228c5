#!/usr/bin/env bash
# The whole test suite, as CI runs it: the environment (scripts/setup.sh), then pytest on 3 workers
# (pytest-xdist; 3 on 2 cores because the tests wait on subprocesses, Slurm and servers much of the time:
# with 4 the cores were 3 % idle but the suite slower, 710 s against 624 s with 3, as the processes'
# CPU grows with the contention, 1,133 CPU-s against 977; MARIN_TEST_WORKERS=N for another count, or pass -n 0). The services some tests need
# start when the first of those tests runs and stop at the end (tests/services.py): the local Slurm
# cluster and an MLflow server for the `slurm` tests, a headless Chromium for the `browser` test;
# a run that selects none of them starts nothing. Extra arguments go to pytest
# (e.g. `bash scripts/test.sh tests/launch -x`).
#
# The quick pass (no root, Slurm or browser; on 2 cores about 3 min, with a warm JAX cache or a
# cold one: the suite's XLA flags make compiles cheap, tests/helpers.py):
#   .venv/bin/python -m pytest -n 2 -m "not slow and not slurm and not browser"
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is cached during the run even where the environment turns that off: pytest then
# rewrites each test module's asserts once, not once in every worker (collection 6.3 -> 3.8 CPU-s a
# process), and every launch.py, tracking process and Slurm task reuses the project's bytecode.
unset PYTHONDONTWRITEBYTECODE
if [[ -f scripts/setup.sh ]]; then bash scripts/setup.sh; fi
exec .venv/bin/python -m pytest -n "${MARIN_TEST_WORKERS:-3}" "$@"
