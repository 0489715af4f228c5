#!/usr/bin/env bash
# Private MariaDB + slurmdbd for the local Slurm, so that plain `sacct` (what submitit polls) works.
# Called by slurm_start.sh when SLURM_DBD=1 (after munged, before slurmctld). Root only.
set -euo pipefail
SLURM_STATE=${SLURM_STATE:-${TMPDIR:-/tmp}/marin-slurm}
SLURM_AUTH=${SLURM_AUTH:-munge}
DB=$SLURM_STATE/mysql
SOCK=/run/mysqld/mysqld.sock   # libmariadb's compiled-in default: slurmdbd finds it with StorageHost=localhost

mkdir -p "$DB" /run/mysqld
mariadb-install-db --user=root --datadir="$DB" --skip-test-db >"$SLURM_STATE/mysql-install.log" 2>&1
mariadbd --user=root --datadir="$DB" --socket="$SOCK" --pid-file="$DB/mysqld.pid" \
  --skip-networking --log-error="$DB/error.log" --innodb-buffer-pool-size=64M >/dev/null 2>&1 &
for _ in $(seq 100); do [[ -S $SOCK ]] && mariadb -uroot --socket="$SOCK" -e 'select 1' >/dev/null 2>&1 && break; sleep 0.1; done
mariadb -uroot --socket="$SOCK" -e 'select 1' >/dev/null

cat > /etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/$SLURM_AUTH
DbdHost=localhost
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
PidFile=$SLURM_STATE/slurmdbd.pid
LogFile=$SLURM_STATE/slurmdbd.log
EOF
chmod 600 /etc/slurm/slurmdbd.conf   # slurmdbd refuses a config readable by others

slurmdbd
for _ in $(seq 100); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.1; done
sacctmgr -i add cluster ci >/dev/null
