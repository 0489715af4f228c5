#!/usr/bin/env bash
# Bring up what the tests need: a single-machine Slurm cluster (slurmctld, slurmd, munge, and
# slurmdbd so that `sacct` — which submitit polls — works) and an MLflow server on loopback.
# Arguments name the services to start (`slurm`, `mlflow`; default both): the tests start each one
# this way when the first test that needs it runs (tests/services.py), so by hand it is only needed
# to keep them up between test runs. Services that already answer are reused; what this script
# starts is listed in $MARIN_SERVICES_DIR/started so that services_down.sh stops only that.
#
# Writes $MARIN_SERVICES_DIR/services.env (read by the tests):
#   MARIN_TEST_MLFLOW_URI=http://127.0.0.1:<port>   when the MLflow server is up
#   MARIN_SLURM_SKIP=<reason>                       when Slurm cannot run on this machine
# Under CI (CI=true) a Slurm that cannot start is an error, not a skip.
#
#   MARIN_SERVICES_DIR  (default <project>/outputs/services)   MLFLOW_PORT (default 5055)
#   MLFLOW_DIR (mlflow_server_start.sh's folder; give services_down.sh the same one)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
dir=${MARIN_SERVICES_DIR:-$root/outputs/services}
port=${MLFLOW_PORT:-5055}
mkdir -p "$dir"
touch "$dir/started" "$dir/services.env"
wanted=("$@"); ((${#wanted[@]})) || wanted=(slurm mlflow)
want() { [[ " ${wanted[*]} " == *" $1 "* ]]; }
# this invocation's lines of services.env are written afresh
if want slurm; then sed -i '/^MARIN_SLURM_SKIP=/d' "$dir/services.env"; fi
if want mlflow; then sed -i '/^MARIN_TEST_MLFLOW_URI=/d' "$dir/services.env"; fi

started() { grep -qx "$1" "$dir/started" || echo "$1" >> "$dir/started"; }
slurm_answers() { timeout 10 sinfo -h -n localhost -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }
skip_slurm() {
  echo "MARIN_SLURM_SKIP=\"$1\"" >> "$dir/services.env"
  if [[ ${CI:-} == true ]]; then echo "error: Slurm is required under CI: $1" >&2; exit 1; fi
  echo "slurm: not started ($1); the Slurm tests will be skipped" >&2
}

# --- Slurm
if ! want slurm; then
  :
elif command -v sinfo >/dev/null 2>&1 && slurm_answers; then
  echo "slurm: already up ($(sinfo -h -o '%P %D %T' | head -1))"
elif [[ $(id -u) != 0 ]]; then
  skip_slurm "not root: the local cluster needs root to install packages and run slurmctld/slurmd"
elif ! command -v apt-get >/dev/null 2>&1 && ! command -v slurmctld >/dev/null 2>&1; then
  skip_slurm "no apt-get and no slurmctld: cannot install Slurm on this system"
else
  if SLURM_DBD=1 SLURM_CPUS=${SLURM_CPUS:-8} bash "$here/slurm_start.sh"; then
    started slurm
  else
    skip_slurm "scripts/slurm_start.sh failed (see above)"
  fi
fi

# --- MLflow
if ! want mlflow; then
  :
elif curl -fsS --max-time 3 "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
  echo "mlflow: already up on port $port"
  echo "MARIN_TEST_MLFLOW_URI=http://127.0.0.1:$port" >> "$dir/services.env"
elif MLFLOW_PORT=$port bash "$here/mlflow_server_start.sh"; then
  started mlflow
  echo "MARIN_TEST_MLFLOW_URI=http://127.0.0.1:$port" >> "$dir/services.env"
else
  echo "mlflow: server did not start; tests fall back to a sqlite store" >&2
  [[ ${CI:-} == true ]] && exit 1
fi
exit 0
