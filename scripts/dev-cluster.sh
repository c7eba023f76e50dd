#!/usr/bin/env bash
# A real two-node SLURM cluster on this machine, for the tests and for trying the launchers.
#
#   scripts/dev-cluster.sh up       install (Debian packages) if needed, configure, start
#   scripts/dev-cluster.sh down     stop every daemon it started
#   scripts/dev-cluster.sh status   sinfo, or a non-zero exit when the cluster is not up
#
#   scripts/dev-cluster.sh up --hosts N   the multi-host test world instead: N hosts in network
#                                         namespaces with their own SLURM cluster (scripts/multihost.sh,
#                                         docs/test-world.md); `down --hosts`, `status --hosts`
#
# Nodes n1 and n2 are two slurmd processes on this host (Debian's slurmd is built with
# multiple-slurmd support), so `srun -N2` really starts tasks through two node daemons.
# Two partitions, for `ddp-hpc cluster probe`: debug (the default: n1, n2, CPU only) and gpu
# (n3, n4, two more slurmd processes), whose nodes declare 4 A100s each as GRES that no GPU
# backs: Slurm 22.05 drops a GPU without a File, so each is a link to /dev/null
# ($RUN_DIR/fake-gpus/gpuN, outside /dev so that nothing takes it for an NVIDIA device).
# `up` on a cluster already running an older config restarts slurmctld and the slurmds. What
# they run is known only for a slurmctld this script started: $RUN_DIR/config.sha256 holds its
# pid and the config's hash; any other slurmctld (an older script's) is restarted once.
# There is no systemd here: munged, mariadbd, slurmdbd, slurmctld and slurmd are started
# by hand. Accounting (slurmdbd + MariaDB) is on because submitit polls `sacct`.
# Needs root: it writes /etc/slurm and /etc/hosts.
set -euo pipefail

CLUSTER=ddphpc
NODES=(n1 n2 n3 n4)
CPUS_PER_NODE=${DDP_HPC_DEV_CPUS_PER_NODE:-4}
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server slurm-wlm-torque)
CONF_DIR=/etc/slurm
RUN_DIR=/run/slurm
LOG_DIR=/var/log/slurm
SPOOL_DIR=/var/spool/slurm
DB_PASS=ddphpc-dev-only

log() { printf 'dev-cluster: %s\n' "$*" >&2; }
# shellcheck source=scripts/restored-jobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/restored-jobs.sh"
die() { log "error: $*"; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "run as root (it configures /etc/slurm and starts daemons)"; }

install_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

write_config() {
  local host; host=$(hostname -s)
  mkdir -p "$CONF_DIR" "$RUN_DIR" "$LOG_DIR" "$SPOOL_DIR/ctld" /run/munge /run/mysqld
  for n in "${NODES[@]}"; do mkdir -p "$SPOOL_DIR/d-$n"; done
  grep -qE "^127\.0\.0\.1[[:space:]].*\bn1\b" /etc/hosts || echo "127.0.0.1 ${NODES[*]}" >>/etc/hosts
  getent hosts "$host" >/dev/null || echo "127.0.0.1 $host" >>/etc/hosts

  cat >"$CONF_DIR/slurm.conf" <<EOF
# Written by ddp_hpc scripts/dev-cluster.sh: a two-node test cluster on one host.
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
GresTypes=gpu
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmdSpoolDir=$SPOOL_DIR/d-%n
StateSaveLocation=$SPOOL_DIR/ctld
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
KillWait=5
InactiveLimit=0
MinJobAge=300
JobRequeue=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=17001-17002 CPUs=$CPUS_PER_NODE State=UNKNOWN
NodeName=n[3-4] NodeHostname=$host NodeAddr=127.0.0.1 Port=17003-17004 CPUs=$CPUS_PER_NODE Gres=gpu:a100:4 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=gpu Nodes=n[3-4] MaxTime=02:00:00 State=UP OverSubscribe=NO
EOF

  mkdir -p "$RUN_DIR/fake-gpus"
  for i in 0 1 2 3; do ln -sfn /dev/null "$RUN_DIR/fake-gpus/gpu$i"; done
  cat >"$CONF_DIR/gres.conf" <<EOF
# Written by ddp_hpc scripts/dev-cluster.sh: GPUs declared, /dev/null behind them.
AutoDetect=off
NodeName=n[3-4] Name=gpu Type=a100 File=$RUN_DIR/fake-gpus/gpu[0-3]
EOF

  cat >"$CONF_DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
PidFile=$RUN_DIR/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
EOF
  chmod 600 "$CONF_DIR/slurmdbd.conf"
}

running() { pgrep -x "$1" >/dev/null 2>&1; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local seconds=$1 what=$2; shift 2
  for _ in $(seq 1 $((seconds * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  die "$what did not come up in ${seconds}s (logs in $LOG_DIR)"
}

start_munge() {
  running munged && return 0
  chown munge:munge /run/munge
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
  wait_for 10 munged sh -c 'munge -n | unmunge'
}

start_mariadb() {
  running mariadbd && return 0
  chown mysql:mysql /run/mysqld
  [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  setsid /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 --skip-networking=0 \
    >"$LOG_DIR/mariadb.log" 2>&1 </dev/null &
  wait_for 30 mariadb mariadb -uroot -e 'select 1'
  mariadb -uroot <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF
}

config_hash() { cat "$CONF_DIR/slurm.conf" "$CONF_DIR/gres.conf" 2>/dev/null | sha256sum | cut -d' ' -f1; }
running_stamp() { echo "$(cat "$RUN_DIR/slurmctld.pid" 2>/dev/null) $(config_hash)"; }

# A cluster started with another config (older partitions or nodes) is stopped here and
# started again by start_slurm: `scontrol reconfigure` starts no node daemons.
restart_if_changed() {
  local have=""
  [ -s "$RUN_DIR/config.sha256" ] && have=$(cat "$RUN_DIR/config.sha256")
  if [ "$(running_stamp)" != "$have" ] && scontrol ping >/dev/null 2>&1; then
    log "config changed: restarting slurmctld and the slurmds"
    local ctld=""; [ -s "$RUN_DIR/slurmctld.pid" ] && ctld=$(cat "$RUN_DIR/slurmctld.pid")
    [ -n "$ctld" ] && kill "$ctld" 2>/dev/null || true
    for n in "${NODES[@]}"; do pkill -f "slurmd -N $n\$" || true; done
    for _ in $(seq 1 150); do
      pgrep -f "slurmd -N n[0-9]+\$" >/dev/null || { [ -n "$ctld" ] && kill -0 "$ctld" 2>/dev/null; } || break
      sleep 0.2
    done
  fi
}

start_slurm() {
  local fresh=""
  running slurmdbd || /usr/sbin/slurmdbd
  wait_for 30 slurmdbd sacctmgr -n list cluster
  sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true
  # By pid file: the multihost world's slurmctld (scripts/multihost.sh) has the same name.
  { [ -s "$RUN_DIR/slurmctld.pid" ] && kill -0 "$(cat "$RUN_DIR/slurmctld.pid")" 2>/dev/null; } || {
    /usr/sbin/slurmctld; fresh=1; }
  wait_for 30 slurmctld scontrol ping
  for n in "${NODES[@]}"; do
    pgrep -f "slurmd -N $n\$" >/dev/null || /usr/sbin/slurmd -N "$n"
  done
  wait_for 60 "nodes ${NODES[*]}" nodes_idle
  [ -z "$fresh" ] || cancel_restored_jobs "the cluster"
}

nodes_idle() {
  local states; states=$(sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
  for n in "${NODES[@]}"; do
    echo "$states" | grep -qE "^$n (idle|mix|alloc)" || {
      # A node left down/drained by an earlier run is brought back.
      echo "$states" | grep -qE "^$n (down|drain|drng)" && scontrol update nodename="$n" state=resume 2>/dev/null
      return 1
    }
  done
}

up() {
  need_root
  install_packages
  write_config
  start_munge
  start_mariadb
  restart_if_changed
  start_slurm
  running_stamp >"$RUN_DIR/config.sha256"  # this slurmctld runs this config
  log "up: $(sinfo -h -o '%P %D nodes %t' | tr '\n' ' ')"
}

down() {
  need_root
  scancel --user=root >/dev/null 2>&1 || true
  pkill -x slurmd || true
  pkill -x slurmctld || true
  pkill -x slurmdbd || true
  pkill -x mariadbd || true
  pkill -x munged || true
  log "down"
}

status() {
  scontrol ping >/dev/null 2>&1 || { log "not up"; return 1; }
  sinfo -N
}

if [ "${2:-}" = --hosts ]; then
  exec "$(dirname "${BASH_SOURCE[0]}")/multihost.sh" "$1" "${3:-2}"
fi

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status [--hosts N]" >&2; exit 2 ;;
esac
