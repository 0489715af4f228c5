#!/usr/bin/env bash
# Bring up what the tests need: a single-machine Slurm cluster (slurmctld, slurmd, munge, and
# slurmdbd so that `sacct` — which submitit polls — works) and an MLflow server on loopback.
# Services that already answer are reused; what this script starts is listed in
# $MARIN_SERVICES_DIR/started so that services_down.sh stops only that.
#
# Writes $MARIN_SERVICES_DIR/services.env (read by the tests):
#   MARIN_TEST_MLFLOW_URI=http://127.0.0.1:<port>   when the MLflow server is up
#   MARIN_SLURM_SKIP=<reason>                       when Slurm cannot run on this machine
# Under CI (CI=true) a Slurm that cannot start is an error, not a skip.
#
#   MARIN_SERVICES_DIR  (default <project>/outputs/services)   MLFLOW_PORT (default 5055)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
dir=${MARIN_SERVICES_DIR:-$root/outputs/services}
port=${MLFLOW_PORT:-5055}
mkdir -p "$dir"
: > "$dir/services.env"
touch "$dir/started"

started() { grep -qx "$1" "$dir/started" || echo "$1" >> "$dir/started"; }
slurm_answers() { timeout 10 sinfo -h -n localhost -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }
skip_slurm() {
  echo "MARIN_SLURM_SKIP=\"$1\"" >> "$dir/services.env"
  if [[ ${CI:-} == true ]]; then echo "error: Slurm is required under CI: $1" >&2; exit 1; fi
  echo "slurm: not started ($1); the Slurm tests will be skipped" >&2
}

# --- Slurm
if command -v sinfo >/dev/null 2>&1 && slurm_answers; then
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
if curl -fsS --max-time 3 "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
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
