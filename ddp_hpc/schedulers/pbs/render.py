"""PBS Pro job scripts (Aurora, Polaris, generic clusters): rendered, then handed to qsub."""

from __future__ import annotations

from collections.abc import Sequence

from ddp_hpc.contract import DEADLINE_VAR, HOSTFILE_VAR, MPIEXEC_VAR, RUN_FOLDER_VAR, ExitStatus
from ddp_hpc.errors import UserError
from ddp_hpc.launch.mpi import MpiLaunch, build_mpiexec, mpi_flavour
from ddp_hpc.specs.request import SubmitRequest, directive_value, job_name_directive, parse_walltime, shell_quote
from ddp_hpc.launch.script import (
    ShellVar,
    deadline_line,
    environment_block,
    header_comment,
    PREFLIGHT_ARGV,
    preflight_lines,
    mpiexec_lookup,
    rank_argv,
    render_argv,
    run_folder_lines,
    stage_lines,
    STAGE_FAN_OUT_ARGV,
    sweep_block,
)

#: The job's nodes (each once, in ``$PBS_NODEFILE``'s order) in the run folder: what the
#: script's ``ddp-hpc launch --hostfile`` reads (each attempt's own host file is ``.hosts``).
JOB_HOSTFILE = ".job-hosts"

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


def per_node_mpiexec(request: SubmitRequest, argv: Sequence[str], *, spare_too: bool = False) -> list[str]:
    """``argv`` once per node through the job's mpiexec (the pre-flight check, the
    environment's fan-out); ``spare_too``: on the spare nodes as well."""
    nodes = request.nodes + (request.spare_nodes if spare_too else 0)
    launch = MpiLaunch(request.profile.launcher, nodes, 1, list(argv), hostfile=ShellVar(HOSTFILE_VAR),
                       cpu_bind=request.profile.cpu_bind)
    return build_mpiexec(launch, program=ShellVar(MPIEXEC_VAR))


def launch_call(request: SubmitRequest) -> list[str]:
    """The script's last lines: the launch becomes the job's shell (``exec``), so PBS's SIGTERM
    at the walltime and the stop signal reach it. It runs every attempt as one mpiexec over
    the job's nodes under the one restart policy (``ddp-hpc launch --hostfile``), leaves out
    the node where a rank failed (the spares are the hostfile's last nodes), moves rank 0's
    address with it, passes a stop on as the signal the flavour's mpiexec passes on, and
    writes ``RUN/exit-$PBS_JOBID``. PBS has no requeue a user may ask for: a stopped run exits
    75 and continues when submitted again."""
    profile = request.profile
    binds = mpi_flavour(profile.launcher).binds  # PALS's binding options; the other mpiexecs never took them
    argv = ["ddp-hpc", "launch", "--launcher", profile.launcher, "--hostfile", ShellVar(HOSTFILE_VAR),
            "--nodes", str(request.nodes), "--nproc", str(request.per_node),
            "--max-restarts", str(request.max_restarts), "--run-folder", ShellVar(RUN_FOLDER_VAR),
            "--stop-signal", request.stop_signal.name, "--mpiexec", ShellVar(MPIEXEC_VAR),
            *(["--cpu-bind", profile.cpu_bind] if profile.cpu_bind and binds else []),
            *(["--depth", str(profile.depth)] if profile.depth and binds else []),
            *(["--host-suffix", profile.host_suffix] if profile.host_suffix else []),
            *(["--recover", str(request.recover)] if request.recover else []),
            "--job-id", ShellVar("PBS_JOBID"), "--", *rank_argv(request)]
    signals = " ".join(dict.fromkeys(("USR2", "TERM", request.stop_signal.name)))
    return [
        "# The attempts, the stop signal, leaving out a failed node and the exit status: ddp-hpc launch (the one",
        "# restart policy). A stop signal while it starts up (under a second) is ignored: the ranks still stop",
        f"# ahead of ${DEADLINE_VAR}.",
        f"trap '' {signals}",
        f"exec {render_argv(argv)}",
    ]


def render_pbs(request: SubmitRequest) -> str:
    """The complete PBS script for ``request`` (pure: nothing is read or run)."""
    if request.recover and request.stage_env:
        raise UserError("--recover with --stage-env: the node supervisors would run from the shared environment "
                        "(give one of them)")
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
        # The job's nodes move to the run folder: the launch the script becomes (exec) leaves no
        # EXIT trap behind to remove a temporary file.
        f'mv "${HOSTFILE_VAR}" "${RUN_FOLDER_VAR}/{JOB_HOSTFILE}" && {HOSTFILE_VAR}="${RUN_FOLDER_VAR}/{JOB_HOSTFILE}"',
        *(preflight_lines(render_argv(per_node_mpiexec(request, PREFLIGHT_ARGV)), "${PBS_JOBID}")
          if request.preflight else []),
        # The spare nodes get their copy too: a restart swaps one in for a failed node.
        *stage_lines(request, render_argv(per_node_mpiexec(request, STAGE_FAN_OUT_ARGV, spare_too=True)),
                     "PBS_JOBID", "${PBS_JOBID}"),
        deadline_line(request),
        # PBS sends SIGTERM at the walltime (SIGKILL follows after its kill_delay).
        *launch_call(request),
        "",
    ]
    return "\n".join(lines)
