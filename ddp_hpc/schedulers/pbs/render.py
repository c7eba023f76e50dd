"""PBS Pro job scripts (Aurora, Polaris, generic clusters): rendered, then handed to qsub."""

from __future__ import annotations

from collections.abc import Sequence

from ddp_hpc.contract import HOSTFILE_VAR, MPIEXEC_VAR, ExitStatus
from ddp_hpc.launch.mpi import STOP_PASSED_ON, MpiLaunch, build_mpiexec
from ddp_hpc.specs.request import SubmitRequest, directive_value, job_name_directive, parse_walltime, shell_quote
from ddp_hpc.launch.script import (
    ShellVar,
    deadline_line,
    environment_block,
    header_comment,
    hostfile_leave_out,
    PREFLIGHT_ARGV,
    launch_lines,
    preflight_lines,
    mpiexec_lookup,
    rank_argv,
    recording_rank_failures,
    render_argv,
    run_folder_lines,
    stage_lines,
    STAGE_FAN_OUT_ARGV,
    sweep_block,
)

# Slurm's PBS wrappers (slurm-wlm-torque) run the script with Slurm's variables only:
# derive what PBS Pro would have set, so the same script works on both.
_PBS_FROM_SLURM = r'''
# PBS Pro sets these; under Slurm's qsub wrappers they are derived from Slurm's.
if [ -z "${PBS_NODEFILE:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  PBS_NODEFILE=$(mktemp)
  scontrol show hostnames "$SLURM_JOB_NODELIST" >"$PBS_NODEFILE"
  export PBS_NODEFILE
fi
if [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then
  export PBS_JOBID="${PBS_JOBID:-${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"
  export PBS_ARRAY_INDEX="${PBS_ARRAY_INDEX:-$SLURM_ARRAY_TASK_ID}"
fi
export PBS_JOBID="${PBS_JOBID:-${SLURM_JOB_ID:-}}"
export PBS_JOBNAME="${PBS_JOBNAME:-${SLURM_JOB_NAME:-}}"
export PBS_O_WORKDIR="${PBS_O_WORKDIR:-${SLURM_SUBMIT_DIR:-$PWD}}"
: "${PBS_NODEFILE:?is not set: submit this script with qsub}"
cd "$PBS_O_WORKDIR"'''


def pbs_directives(request: SubmitRequest) -> list[str]:
    profile = request.profile
    hms, _ = parse_walltime(request.walltime)
    select = f"select={request.nodes + request.spare_nodes}"
    if profile.system:
        select += f":system={directive_value(profile.system, 'system')}"
    lines = [f"#PBS -N {job_name_directive(request.name)}"]
    if request.resolved_account:
        lines.append(f"#PBS -A {directive_value(request.resolved_account, 'account')}")
    if request.resolved_queue:
        lines.append(f"#PBS -q {directive_value(request.resolved_queue, 'queue')}")
    lines.append(f"#PBS -l {select}")
    if profile.place:
        lines.append(f"#PBS -l place={directive_value(profile.place, 'place')}")
    lines.append(f"#PBS -l walltime={hms}")
    if request.sweep is not None:
        lines.append(f"#PBS -J {request.sweep.array_spec()}")
    if profile.filesystems:
        lines.append(f"#PBS -l filesystems={directive_value(profile.filesystems, 'filesystems')}")
    lines += ["#PBS -j oe", "#PBS -k doe", "#PBS -r y"]
    return lines


def mpiexec_argv(request: SubmitRequest, *, per_node: Sequence[str] | None = None,
                 spare_too: bool = False) -> list[str]:
    """The ranks' mpiexec line; with ``per_node``, that command once per node instead (the
    pre-flight check, the environment's fan-out), ``spare_too``: on the spare nodes as well."""
    profile = request.profile
    argv = rank_argv(request)
    if request.spare_nodes:  # the first rank to fail names the node a restart leaves out
        argv = recording_rank_failures(argv)
    nodes = request.nodes + (request.spare_nodes if spare_too else 0)
    launch = MpiLaunch(profile.launcher, nodes, 1 if per_node else request.per_node,
                       list(per_node) if per_node else argv,
                       hostfile=ShellVar(HOSTFILE_VAR), cpu_bind=profile.cpu_bind,
                       depth=None if per_node else profile.depth)
    return build_mpiexec(launch, program=ShellVar(MPIEXEC_VAR))


def render_pbs(request: SubmitRequest) -> str:
    """The complete PBS script for ``request`` (pure: nothing is read or run)."""
    suffix = request.profile.host_suffix
    master = f'"${{first_host%%.*}}"{shell_quote(suffix)}' if suffix else '"$first_host"'
    lines = [
        "#!/bin/bash",
        *pbs_directives(request),
        header_comment(request, "pbs"),
        "set -euo pipefail",
        _PBS_FROM_SLURM,
        *environment_block(request),
        "",
        "# Nodes, rank 0's address and the rendezvous port",
        f"{HOSTFILE_VAR}=$(mktemp)",
        f"trap 'rm -f \"${HOSTFILE_VAR}\"' EXIT",
        f"awk 'NF && !seen[$0]++' \"$PBS_NODEFILE\" >\"${HOSTFILE_VAR}\"",
        f'nodes_found=$(wc -l <"${HOSTFILE_VAR}")',
        f'if [ "$nodes_found" -lt {request.nodes} ]; then',
        f'  echo "ddp_hpc: PBS_NODEFILE lists $nodes_found node(s), this job needs {request.nodes}" >&2',
        f"  exit {ExitStatus.FAILED:d}",
        "fi",
        f'first_host=$(head -n 1 "${HOSTFILE_VAR}")',
        f"export MASTER_ADDR={master}",
        'export MASTER_PORT="$(ddp-hpc port)"',
        mpiexec_lookup(request.profile.launcher),
        "",
        f'echo "ddp_hpc: job $PBS_JOBID: {request.world_size} ranks on {request.nodes} node(s), '
        f'rank 0 at $MASTER_ADDR:$MASTER_PORT"',
        *(sweep_block(request, "PBS_ARRAY_INDEX", "PBS_O_WORKDIR") if request.sweep is not None
          else run_folder_lines(request, "PBS_O_WORKDIR")),
        *(preflight_lines(render_argv(mpiexec_argv(request, per_node=PREFLIGHT_ARGV)), "${PBS_JOBID}")
          if request.preflight else []),
        # The spare nodes get their copy too: a restart swaps one in for a failed node.
        *stage_lines(request, render_argv(mpiexec_argv(request, per_node=STAGE_FAN_OUT_ARGV, spare_too=True)),
                     "PBS_JOBID", "${PBS_JOBID}"),
        deadline_line(request),
        # PBS sends SIGTERM at the walltime (SIGKILL follows after its kill_delay) and has no
        # requeue a user may ask for: a run stopped with REQUEUE continues when submitted again.
        # The stop goes to mpiexec as the signal it passes on (Hydra ends the job on SIGUSR2).
        *launch_lines(request.max_restarts, render_argv(mpiexec_argv(request)), "${PBS_JOBID}", requeue=None,
                      forward_signal=STOP_PASSED_ON[request.profile.launcher].name.removeprefix("SIG"),
                      trap_signals=" ".join(dict.fromkeys(("USR2", "TERM", request.stop_signal.name))),
                      leave_out=hostfile_leave_out(HOSTFILE_VAR, request.nodes, request.per_node,
                                                   [f"export MASTER_ADDR={master}"])
                      if request.spare_nodes else None),
        "",
    ]
    return "\n".join(lines)
