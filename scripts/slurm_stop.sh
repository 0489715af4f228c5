#!/usr/bin/env bash
# Stop the daemons started by slurm_start.sh, by their pid files only (never by name).
set -uo pipefail
SLURM_STATE=${SLURM_STATE:-${TMPDIR:-/tmp}/marin-slurm}
stop_pidfile() {  # $1 = pid file
  [[ -s $1 ]] || return 0
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}
# cancel leftover jobs first so that slurmd does not leave job steps behind
if [[ -s $SLURM_STATE/slurmctld.pid ]] && kill -0 "$(cat "$SLURM_STATE/slurmctld.pid")" 2>/dev/null; then
  scancel --user=root >/dev/null 2>&1 || true
fi
stop_pidfile "$SLURM_STATE/slurmd.pid"
stop_pidfile "$SLURM_STATE/slurmctld.pid"
stop_pidfile "$SLURM_STATE/slurmdbd.pid"
stop_pidfile "$SLURM_STATE/mysql/mysqld.pid"
stop_pidfile "$SLURM_STATE/munged.pid"
echo "slurm stopped"
