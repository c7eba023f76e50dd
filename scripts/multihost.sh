#!/usr/bin/env bash
# The multi-host test world: N "hosts" on this machine, each a Linux network namespace with
# its own host name, two networks between them, and a SLURM cluster of its own.
#
#   scripts/dev-cluster.sh up --hosts N      (this script: scripts/multihost.sh up N)
#   scripts/dev-cluster.sh down --hosts      remove every namespace, link, hosts entry it made
#   scripts/dev-cluster.sh status --hosts    sinfo of the world's cluster, or non-zero exit
#
# Host hI (I = 1..N) is network namespace ddpmh-hI plus a UTS namespace whose host name is
# hI. It has two interfaces: eth0 on the management network (name hI) and hsn0 on a
# "high-speed network" (name hI-hsn, so the host suffix "-hsn" maps to another address).
# Both networks are private bridges in the root namespace; the root namespace has one
# address on the management bridge (slurmctld and srun/sbatch run there). There is no
# route, forwarding or NAT out of either network.
#
# The world's SLURM cluster is separate from the shared two-node cluster (n1, n2): its own
# config (use it with SLURM_CONF=/etc/slurm-mh/slurm.conf), ClusterName, ports, state, spool,
# pid and log directories, no accounting. munged is shared. One slurmd runs inside each
# host's namespaces. Run anything on a host with scripts/on-host HOST COMMAND, which is
# also the remote-start agent for Open MPI (plm_rsh_agent) and MPICH (launcher exec).
# docs/test-world.md has the details. Needs root.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLUSTER=ddphpcmh
PREFIX=ddpmh
# RFC 2544's benchmarking block (198.18.0.0/15): reserved for test networks, never routed on
# the internet; `up` refuses to start if any address or route on this machine uses them.
MGMT_NET=${DDP_HPC_MH_MGMT_NET:-198.18.14}
HSN_NET=${DDP_HPC_MH_HSN_NET:-198.18.15}
CTL_ADDR=$MGMT_NET.254
MGMT_BRIDGE=$PREFIX-mgmt
HSN_BRIDGE=$PREFIX-hsn
HSN_SUFFIX=-hsn
CTLD_PORT=${DDP_HPC_MH_CTLD_PORT:-17817}
SLURMD_PORT=${DDP_HPC_MH_SLURMD_PORT:-17818}
CPUS_PER_HOST=${DDP_HPC_MH_CPUS_PER_HOST:-2}
STATE=/run/ddp-hpc-mh
CONF_DIR=/etc/slurm-mh
CONF=$CONF_DIR/slurm.conf
RUN_DIR=/run/slurm-mh
LOG_DIR=/var/log/slurm-mh
SPOOL_DIR=/var/spool/slurm-mh
HOSTS_BEGIN="# >>> ddp_hpc multihost test world (scripts/dev-cluster.sh up --hosts): removed by down"
HOSTS_END="# <<< ddp_hpc multihost test world"
export SLURM_CONF=$CONF

log() { printf 'dev-cluster (multihost): %s\n' "$*" >&2; }
# shellcheck source=scripts/restored-jobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/restored-jobs.sh"
die() { log "error: $*"; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "run as root (it creates network namespaces and starts daemons)"; }

# The number of hosts of a complete world (written last by `up`), or 0.
hosts_up() { [ -s "$STATE/hosts" ] && cat "$STATE/hosts" || echo 0; }

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local seconds=$1 what=$2; shift 2
  for _ in $(seq 1 $((seconds * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  die "$what did not come up in ${seconds}s (logs in $LOG_DIR)"
}

install_packages() {
  local missing=()
  for p in slurmctld slurmd slurm-client munge iproute2 util-linux; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

check_range_free() {
  # Ours (a half-built world) does not count: `up` first removes it.
  local net used
  for net in "$MGMT_NET" "$HSN_NET"; do
    used=$( { ip -4 -o addr show; ip -4 route show table all; } | grep -F " $net." || true)
    [ -z "$used" ] || die "addresses $net.0/24 are already in use on this machine:
$used
set DDP_HPC_MH_MGMT_NET / DDP_HPC_MH_HSN_NET to two other unused /24 prefixes (e.g. 198.18.40)"
  done
}

no_ipv6() { [ ! -e "/proc/sys/net/ipv6/conf/$1/disable_ipv6" ] || echo 1 >"/proc/sys/net/ipv6/conf/$1/disable_ipv6"; }

make_host() {  # make_host I
  local i=$1 h="h$1" ns="$PREFIX-h$1"
  ip netns add "$ns"
  ip link add "$PREFIX-h${i}m" type veth peer name eth0 netns "$ns"
  ip link add "$PREFIX-h${i}h" type veth peer name hsn0 netns "$ns"
  ip link set "$PREFIX-h${i}m" master "$MGMT_BRIDGE" up
  ip link set "$PREFIX-h${i}h" master "$HSN_BRIDGE" up
  # IPv4 only: no IPv6 link-local chatter on the networks (the tests read their counters).
  ip netns exec "$ns" sh -c 'for f in /proc/sys/net/ipv6/conf/*/disable_ipv6; do echo 1 >"$f"; done'
  no_ipv6 "$PREFIX-h${i}m"; no_ipv6 "$PREFIX-h${i}h"
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$MGMT_NET.$((10 + i))/24" dev eth0
  ip -n "$ns" addr add "$HSN_NET.$((10 + i))/24" dev hsn0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set hsn0 up
  # A persistent UTS namespace (bind-mounted on a file) holds the host name.
  touch "$STATE/uts/$h"
  unshare --uts="$STATE/uts/$h" hostname "$h"
}

write_hosts() {  # write_hosts N: our block replaces any earlier one; the rest of the file is kept
  local n=$1 tmp
  tmp=$(mktemp /etc/.hosts.ddpmh.XXXXXX)
  awk -v begin="$HOSTS_BEGIN" -v end="$HOSTS_END" \
    '$0 == begin { skip = 1 } !skip { print } $0 == end { skip = 0 }' /etc/hosts >"$tmp"
  if [ "$n" -gt 0 ]; then
    {
      echo "$HOSTS_BEGIN"
      echo "$CTL_ADDR $PREFIX-ctl"
      for i in $(seq 1 "$n"); do
        echo "$MGMT_NET.$((10 + i)) h$i"
        echo "$HSN_NET.$((10 + i)) h$i$HSN_SUFFIX"
      done
      echo "$HOSTS_END"
    } >>"$tmp"
  fi
  chmod --reference=/etc/hosts "$tmp"
  mv -f "$tmp" /etc/hosts  # a rename: readers never see a half-written file
}

write_config() {  # write_config N
  local n=$1 ctl_host
  ctl_host=$(hostname -s)
  mkdir -p "$CONF_DIR" "$RUN_DIR" "$LOG_DIR" "$SPOOL_DIR/ctld"
  for i in $(seq 1 "$n"); do mkdir -p "$SPOOL_DIR/d-h$i"; done
  {
    cat <<EOF
# Written by ddp_hpc scripts/dev-cluster.sh up --hosts $n: the multihost test world's own
# cluster (hosts in network namespaces). Use it with SLURM_CONF=$CONF.
ClusterName=$CLUSTER
SlurmctldHost=$ctl_host($CTL_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
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
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
EOF
    for i in $(seq 1 "$n"); do
      echo "NodeName=h$i NodeAddr=$MGMT_NET.$((10 + i)) CPUs=$CPUS_PER_HOST State=UNKNOWN"
    done
    echo "PartitionName=hosts Nodes=h[1-$n] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } >"$CONF"
}

start_munge() {  # shared with the two-node cluster: started if it is not running, never restarted
  pgrep -x munged >/dev/null && return 0
  mkdir -p /run/munge && chown munge:munge /run/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
  wait_for 10 munged sh -c 'munge -n | unmunge'
}

nodes_idle() {  # nodes_idle N
  local states; states=$(sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
  for i in $(seq 1 "$1"); do
    echo "$states" | grep -qE "^h$i (idle|mix|alloc)" || {
      echo "$states" | grep -qE "^h$i (down|drain|drng)" && scontrol update nodename="h$i" state=resume 2>/dev/null
      return 1
    }
  done
}

start_slurm() {  # start_slurm N
  local fresh=""
  alive "$RUN_DIR/slurmctld.pid" || { /usr/sbin/slurmctld -f "$CONF"; fresh=1; }
  wait_for 30 "slurmctld (port $CTLD_PORT)" scontrol ping
  for i in $(seq 1 "$1"); do
    alive "$RUN_DIR/slurmd-h$i.pid" && continue
    # nsenter, not `ip netns exec`: slurmd needs the machine's /sys (its cgroup mounts).
    nsenter --net="/run/netns/$PREFIX-h$i" --uts="$STATE/uts/h$i" -- /usr/sbin/slurmd -f "$CONF"
  done
  wait_for 60 "nodes h[1-$1]" nodes_idle "$1"
  [ -z "$fresh" ] || cancel_restored_jobs "the world"
}

stop_pidfile() {  # stop_pidfile FILE: TERM, then KILL after 10 s
  local pid
  [ -s "$1" ] || return 0
  pid=$(cat "$1")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

up() {  # up N
  local n=$1 started=$SECONDS
  [[ "$n" =~ ^[1-9][0-9]*$ ]] && [ "$n" -le 200 ] || die "--hosts needs a number of hosts (1-200), not '$n'"
  need_root
  if [ "$(hosts_up)" = "$n" ] && [ -e "/run/netns/$PREFIX-h$n" ]; then
    log "$n hosts already exist; checking the daemons"
  else
    [ "$(hosts_up)" = 0 ] && [ ! -e "$STATE" ] || down  # a different or half-built world
    install_packages
    check_range_free
    mkdir -p "$STATE/uts"
    ip link add "$MGMT_BRIDGE" type bridge
    ip link add "$HSN_BRIDGE" type bridge
    no_ipv6 "$MGMT_BRIDGE"; no_ipv6 "$HSN_BRIDGE"
    ip addr add "$CTL_ADDR/24" dev "$MGMT_BRIDGE"
    ip link set "$MGMT_BRIDGE" up
    ip link set "$HSN_BRIDGE" up
    for i in $(seq 1 "$n"); do make_host "$i"; done
    write_hosts "$n"
    echo "$n" >"$STATE/hosts"
  fi
  write_config "$n"
  start_munge
  start_slurm "$n"
  log "up in $((SECONDS - started))s: hosts h[1-$n] ($MGMT_NET.0/24 eth0, $HSN_NET.0/24 hsn0 as hI$HSN_SUFFIX);" \
      "SLURM_CONF=$CONF; run on a host with scripts/on-host HOST COMMAND"
}

down() {
  need_root
  local pidfile ns pid
  for pidfile in "$RUN_DIR"/slurmd-h*.pid; do [ -e "$pidfile" ] && stop_pidfile "$pidfile"; done
  stop_pidfile "$RUN_DIR/slurmctld.pid"
  for ns in $(ip netns list | awk '{print $1}' | grep "^$PREFIX-h[0-9]*$" || true); do
    # Whatever still runs on a test host was started there by the world or its tests.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns"
  done
  for uts in "$STATE"/uts/*; do
    [ -e "$uts" ] || continue
    umount "$uts" 2>/dev/null || true
    rm -f "$uts"
  done
  ip link del "$MGMT_BRIDGE" 2>/dev/null || true
  ip link del "$HSN_BRIDGE" 2>/dev/null || true
  write_hosts 0
  rm -rf "$STATE"
  log "down: namespaces, links, hosts entries and daemons of the world removed (logs kept in $LOG_DIR)"
}

status() {
  local n; n=$(hosts_up)
  [ "$n" -gt 0 ] && [ -e "/run/netns/$PREFIX-h$n" ] || { log "not up"; return 1; }
  scontrol ping >/dev/null 2>&1 || { log "$n hosts exist but slurmctld does not answer"; return 1; }
  nodes_idle "$n" || { log "$n hosts exist but not every slurmd is idle:"; sinfo -N >&2; return 1; }
  echo "hosts: $n  SLURM_CONF=$CONF"
  sinfo -N
}

case "${1:-}" in
  up) up "${2:-2}" ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up N|down|status" >&2; exit 2 ;;
esac
