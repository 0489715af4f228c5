#!/usr/bin/env bash
# Start a real single-node Slurm cluster on loopback (Debian 12 / Slurm 22.05, run as root), for the
# tests and demos of marin's Slurm launcher. Installs the Debian packages when missing.
# Usually called by scripts/services_up.sh (SLURM_DBD=1 SLURM_CPUS=8).
#
#   SLURM_STATE   state/log dir            (default ${TMPDIR:-/tmp}/marin-slurm; wiped on start)
#   SLURM_AUTH    munge | none             (default munge; auth/none works in 22.05 without munged, but
#                                           is not the conventional setup and may not exist in newer Slurm)
#   SLURM_CPUS    CPUs advertised          (default: real count; more than real => config_overrides)
#   SLURM_DBD     1 => also start MariaDB + slurmdbd so that plain `sacct` works (default 0)
#   SLURM_INSTALL 0 => skip apt-get        (default 1)
#   SLURM_CRED_EXPIRE seconds              (default 10; Slurm's default 120 is also the delay
#                                           before a requeued job may start again)
#
# Usage:  bash slurm_start.sh && sinfo          Stop: bash slurm_stop.sh
# Writes /etc/slurm/slurm.conf (the default path all Slurm clients read).
set -euo pipefail

SLURM_STATE=${SLURM_STATE:-${TMPDIR:-/tmp}/marin-slurm}
SLURM_AUTH=${SLURM_AUTH:-munge}
SLURM_DBD=${SLURM_DBD:-0}
SLURM_INSTALL=${SLURM_INSTALL:-1}
SLURM_CRED_EXPIRE=${SLURM_CRED_EXPIRE:-10}
t0=$(date +%s%N)

if [[ $SLURM_INSTALL == 1 ]]; then
  pkgs=(slurmctld slurmd slurm-client)
  [[ $SLURM_AUTH == munge ]] && pkgs+=(munge)
  [[ $SLURM_DBD == 1 ]] && pkgs+=(slurmdbd mariadb-server)
  missing=()
  # installed = dpkg's "ii"; `dpkg -s` also succeeds for a package removed but not purged (only
  # its config files left), whose daemon is then missing
  installed() { [[ $(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null) == ii* ]]; }
  for p in "${pkgs[@]}"; do installed "$p" || missing+=("$p"); done
  if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi
t_inst=$(date +%s%N)

# Stop a previous instance of ours (by pid file), then start from a clean state dir.
if [[ -d $SLURM_STATE ]]; then
  bash "$(dirname "$0")/slurm_stop.sh" >/dev/null 2>&1 || true
fi
rm -rf "$SLURM_STATE"
mkdir -p "$SLURM_STATE"/{ctld,d,munge}

# Real hardware numbers as slurmd sees them (hostname may be anything; we call the node "localhost").
read -r real_cpus real_mem < <(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*RealMemory=\([0-9]*\).*/\1 \2/p')
cpus=${SLURM_CPUS:-$real_cpus}
overrides=""
if ((cpus != real_cpus)); then overrides="SlurmdParameters=config_overrides"; fi

if [[ $SLURM_AUTH == munge ]]; then
  auth="AuthType=auth/munge
CredType=cred/munge"
else
  auth="AuthType=auth/none
CredType=cred/none"
fi

if [[ $SLURM_DBD == 1 ]]; then
  acct="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux"
else
  acct="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi

mkdir -p /etc/slurm
cat > /etc/slurm/slurm.conf <<EOF
ClusterName=ci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
$auth
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=cred_expire=$SLURM_CRED_EXPIRE
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$SLURM_STATE/ctld
SlurmdSpoolDir=$SLURM_STATE/d
SlurmctldPidFile=$SLURM_STATE/slurmctld.pid
SlurmdPidFile=$SLURM_STATE/slurmd.pid
SlurmctldLogFile=$SLURM_STATE/slurmctld.log
SlurmdLogFile=$SLURM_STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# run the scheduling loops every 2 s (defaults 60 s / 30 s): a requeued job, once eligible, restarts quickly
SchedulerParameters=sched_interval=2,bf_interval=2
$acct
# job completion log: 'sacct -c' works from it even without slurmdbd
JobCompType=jobcomp/filetxt
JobCompLoc=$SLURM_STATE/jobcomp.txt
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
$overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$real_mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
chmod 644 /etc/slurm/slurm.conf

if [[ $SLURM_AUTH == munge ]]; then
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 0755 /run/munge
  [[ -s /etc/munge/munge.key ]] || { mungekey -c -k /etc/munge/munge.key 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  if ! munge -n >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    cp /run/munge/munged.pid "$SLURM_STATE/munged.pid"   # remember it as ours
  fi
  for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
fi

if [[ $SLURM_DBD == 1 ]]; then
  bash "$(dirname "$0")/slurmdbd_start.sh"
fi

slurmctld
slurmd -N localhost
for _ in $(seq 100); do
  st=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
  [[ $st == idle ]] && break
  sleep 0.1
done
[[ $st == idle ]] || { echo "slurm did not come up (state=$st)"; tail -20 "$SLURM_STATE"/*.log; exit 1; }
t1=$(date +%s%N)
printf 'slurm up: install %d ms, start %d ms (state=%s, auth=%s, cpus=%s, dbd=%s)\n' \
  "$(( (t_inst - t0) / 1000000 ))" "$(( (t1 - t_inst) / 1000000 ))" "$SLURM_STATE" "$SLURM_AUTH" "$cpus" "$SLURM_DBD"
