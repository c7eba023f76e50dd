"""SLURM batch scripts: one srun task per rank, or one torchrun per node."""

from __future__ import annotations

from collections.abc import Sequence

from ddp_hpc.contract import DEADLINE_VAR, RUN_FOLDER_VAR
from ddp_hpc.errors import UserError
from ddp_hpc.specs.request import SubmitRequest, directive_value, job_name_directive, parse_walltime
from ddp_hpc.launch.script import (
    ShellVar,
    deadline_line,
    environment_block,
    header_comment,
    PREFLIGHT_ARGV,
    preflight_lines,
    rank_argv,
    render_argv,
    run_folder_lines,
    stage_lines,
    STAGE_FAN_OUT_ARGV,
    sweep_block,
)
from ddp_hpc.contract.slurm_job_key import script_job_key
from ddp_hpc.schedulers.slurm.state import SlurmJobs

LOG_DIR = "logs"


def job_key(request: SubmitRequest) -> str:
    """The job's id as ``sacct``/``scancel`` name it: ``ID``, or ``ARRAYID_INDEX`` in a sweep."""
    return script_job_key(array=request.sweep is not None)


#: Lines for a SLURM batch script (before the ranks start): export the job's end time,
#: looked up once per job (and again after a requeue, which reruns the script). squeue
#: prints the end in the controller's local time; an unknown end (no limit) leaves it unset.
SLURM_DEADLINE_LINES = (
    'ddp_hpc_end=$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null || true)',
    'case "$ddp_hpc_end" in [0-9][0-9][0-9][0-9]-*) '
    f'export {DEADLINE_VAR}=$(date -d "$ddp_hpc_end" +%s) ;; esac',
)


def sbatch_directives(request: SubmitRequest) -> list[str]:
    profile = request.profile
    hms, _ = parse_walltime(request.walltime)
    torchrun = SlurmJobs.torchrun_per_node(request)
    tasks_per_node = 1 if torchrun else request.per_node
    lines = [
        f"#SBATCH --job-name={job_name_directive(request.name)}",
        f"#SBATCH --nodes={request.nodes + request.spare_nodes}",
        f"#SBATCH --ntasks-per-node={tasks_per_node}",
    ]
    if profile.cpus_per_task:
        cpus = profile.cpus_per_task * (request.per_node if torchrun else 1)
        lines.append(f"#SBATCH --cpus-per-task={cpus}")
    if profile.uses_gpus and profile.devices_per_node:
        lines.append(f"#SBATCH --gpus-per-node={request.per_node}")
    lines.append(f"#SBATCH --time={hms}")
    if request.sweep is not None:
        lines.append(f"#SBATCH --array={request.sweep.array_spec()}")
    if request.resolved_account:
        lines.append(f"#SBATCH --account={directive_value(request.resolved_account, 'account')}")
    if request.resolved_queue:
        lines.append(f"#SBATCH --partition={directive_value(request.resolved_queue, 'partition')}")
    lines += [
        f"#SBATCH --output={LOG_DIR}/%x-{'%A_%a' if request.sweep is not None else '%j'}.out",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=B:{request.stop_signal}",
        "#SBATCH --requeue",
    ]
    return lines


def launch_call(request: SubmitRequest) -> list[str]:
    """The script's last lines: the launch becomes the batch shell (``exec``), so Slurm's stop
    signal (``--signal=B:``) reaches it; it runs every attempt as an srun step under the one
    restart policy, leaves out a failed node (the allocation's spares), requeues after a stop
    and writes the exit status. With ``--stage-env`` the command after ``--`` starts with the
    staged wrapper, which the launch keeps outermost (``launch.script.split_staged``): each
    task (or torchrun) runs from its node's copy of the environment."""
    argv = ["ddp-hpc", "launch", "--launcher", "srun", "--nodes", str(request.nodes), "--nproc", str(request.per_node),
            "--max-restarts", str(request.max_restarts), "--run-folder", ShellVar(RUN_FOLDER_VAR),
            "--stop-signal", request.stop_signal.name, *(["--requeue"] if request.chain == 1 else []),
            *(["--torchrun", ShellVar("rdzv_endpoint")] if SlurmJobs.torchrun_per_node(request) else []),
            *(["--recover", str(request.recover)] if request.recover else []),
            "--", *rank_argv(request)]
    return [
        "# The attempts, the stop signal, leaving out a failed node, the requeue and the exit status: ddp-hpc launch",
        "# (the one restart policy). A stop signal while it starts up (under a second) is ignored: the ranks",
        f"# still stop ahead of ${DEADLINE_VAR}.",
        f"trap '' {request.stop_signal.name}",
        f"exec {render_argv(argv)}",
    ]


def _one_task_per_node(request: SubmitRequest, argv: Sequence[str], *, spare_too: bool = False) -> list[str]:
    nodes = request.nodes + (request.spare_nodes if spare_too else 0)
    return ["srun", "--kill-on-bad-exit=1", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", *argv]


def render_sbatch(request: SubmitRequest) -> str:
    """The complete sbatch script: ``srun`` one task per rank, or one torchrun per node."""
    torchrun = SlurmJobs.torchrun_per_node(request)
    if request.recover and (torchrun or request.stage_env):
        raise UserError("--recover needs one srun task per rank under ddp-hpc launch: not with --torchrun (torchrun "
                        "owns its ranks) or --stage-env (the node supervisors would run from the shared environment)")
    lines = [
        "#!/bin/bash",
        *sbatch_directives(request),
        header_comment(request, "slurm, " + ("torchrun per node" if torchrun else "srun task per rank")),
        "set -euo pipefail",
        'cd "${SLURM_SUBMIT_DIR:-$PWD}"',
        *environment_block(request),
        "",
    ]
    if torchrun:
        lines += [
            "# torchrun's c10d rendezvous on the first node, on a port derived from the job id",
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            'rdzv_endpoint="$head_node:$(ddp-hpc port)"',
        ]
    lines += [
        f'echo "ddp_hpc: job $SLURM_JOB_ID: {request.world_size} ranks on {request.nodes} node(s)"',
        *(sweep_block(request, "SLURM_ARRAY_TASK_ID", "PWD") if request.sweep is not None
          else run_folder_lines(request, "PWD")),
        *(preflight_lines(render_argv(_one_task_per_node(request, PREFLIGHT_ARGV)), job_key(request))
          if request.preflight else []),
        *stage_lines(request, render_argv(_one_task_per_node(request, STAGE_FAN_OUT_ARGV, spare_too=True)), "SLURM_JOB_ID",
                     job_key(request)),
        deadline_line(request),
        *SLURM_DEADLINE_LINES,
        *launch_call(request),
        "",
    ]
    return "\n".join(lines)
