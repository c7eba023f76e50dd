# Sourced by scripts/dev-cluster.sh and scripts/multihost.sh (their own log and wait_for, and
# SLURM_CONF naming the cluster): a slurmctld started by them restores the jobs of its saved
# state. Their srun or batch shell ended with the daemons that ran them (a machine stopped
# mid-test, or resumed from a snapshot), and with MaxTime=INFINITE and InactiveLimit=0 such a
# job would hold its node for good, so every later test waiting for a free node would time out.

cancel_restored_jobs() {  # cancel_restored_jobs WHAT: WHAT names the cluster in the log line
  local jobs; jobs=$(squeue -h -o %i | tr '\n' ' ')
  [ -n "${jobs// /}" ] || return 0
  log "cancelling jobs restored from an earlier run of $1: $jobs"
  # shellcheck disable=SC2086  # one id per word
  scancel $jobs || true  # a job that ended meanwhile is no error; the wait below tells
  wait_for 60 "nodes free of the cancelled jobs" all_nodes_idle
}

all_nodes_idle() { [ -z "$(sinfo -h -N -o %t | grep -vx idle)" ]; }
