"""SLURM batch scripts: one srun task per rank, or one torchrun per node."""

from __future__ import annotations

from collections.abc import Sequence

from ddp_hpc.contract import DEADLINE_VAR, RUN_FOLDER_VAR
from ddp_hpc.errors import UserError
from ddp_hpc.specs.request import SubmitRequest, directive_value, job_name_directive, parse_walltime
from ddp_hpc.launch.script import (
    LeaveOut,
    ShellArray,
    ShellVar,
    deadline_line,
    environment_block,
    header_comment,
    PREFLIGHT_ARGV,
    launch_lines,
    preflight_lines,
    rank_argv,
    render_argv,
    run_folder_lines,
    stage_lines,
    STAGE_FAN_OUT_ARGV,
    staged_argv,
    sweep_block,
)
from ddp_hpc.schedulers.slurm.job_key import script_job_key

LOG_DIR = "logs"

#: The shell array of srun options that leave failed nodes out (``--spare-nodes``).
EXCLUDE_ARGS = "exclude_args"

#: srun names the node of the failed task first in ``srun: error: NODE: task N: ...``.
SRUN_LEAVE_OUT = LeaveOut(
    setup=(f"{EXCLUDE_ARGS}=()",),
    find=('  failed=$(sed -n \'s/^srun: error: \\([^:]*\\): task [0-9].*/\\1/p\' "$step_log" | head -n 1)',
          '  reason=$(grep -m 1 "^srun: error: $failed: task" "$step_log" || true)'),
    apply=(f'    {EXCLUDE_ARGS}=(--exclude="$excluded")',),
    capture_stderr=True,
)

# The batch shell gets the stop signal (SIGUSR2, 90 s ahead by default; --signal) before the time limit (or on
# preemption with a grace time). It passes the signal to the ranks, which agree on a step,
# write a checkpoint and exit; only then is the job requeued (requeueing a running job
# kills it), and the requeued job resumes from that checkpoint. Without a trap, bash
# would die on SIGUSR2 at once.
REQUEUE = 'scontrol requeue "$SLURM_JOB_ID"'


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
    torchrun = request.torchrun_per_node
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


def step_argv(request: SubmitRequest) -> list[str]:
    srun = ["srun", "--kill-on-bad-exit=1", "--wait=60"]
    if request.spare_nodes:
        # The allocation has spare nodes: the step takes the nodes it needs, not the failed ones.
        tasks_per_node = 1 if request.torchrun_per_node else request.per_node
        srun += [f"--nodes={request.nodes}", f"--ntasks={request.nodes * tasks_per_node}",
                 f"--ntasks-per-node={tasks_per_node}", ShellArray(EXCLUDE_ARGS)]
    if not request.torchrun_per_node:
        return [*srun, *rank_argv(request)]
    # torchrun never restarts (--max-restarts 0): it would restart a stop (75) as a failure. The
    # script's loop restarts the step under the one restart policy (launch/restart.py).
    return [*srun, *staged_argv(request, ["torchrun"]), "--nnodes", str(request.nodes), "--nproc-per-node", str(request.per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", ShellVar("rdzv_endpoint"),
            "--rdzv-id", ShellVar("SLURM_JOB_ID"), "--max-restarts", "0",
            "--no-python", *rank_argv(request)]


def supervised(request: SubmitRequest) -> bool:
    """Scripts whose attempts ``ddp-hpc launch --launcher srun`` runs (one restart loop, in
    Python). A staged environment keeps the bash loop of ``launch_lines`` until the launch
    supports it (the staged wrapper would be wrapped in `ddp-hpc run` from the shared environment)."""
    return not request.stage_env


def launch_call(request: SubmitRequest) -> list[str]:
    """The script's last lines: the launch becomes the batch shell (``exec``), so Slurm's stop
    signal (``--signal=B:``) reaches it; it runs every attempt as an srun step under the one
    restart policy, leaves out a failed node (the allocation's spares), requeues after a stop
    and writes the exit status."""
    argv = ["ddp-hpc", "launch", "--launcher", "srun", "--nodes", str(request.nodes), "--nproc", str(request.per_node),
            "--max-restarts", str(request.max_restarts), "--run-folder", ShellVar(RUN_FOLDER_VAR),
            "--stop-signal", request.stop_signal.name, *(["--requeue"] if request.chain == 1 else []),
            *(["--torchrun", ShellVar("rdzv_endpoint")] if request.torchrun_per_node else []),
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
    torchrun = request.torchrun_per_node
    if request.recover and (torchrun or not supervised(request)):
        raise UserError("--recover needs one srun task per rank under ddp-hpc launch: not with --torchrun (torchrun "
                        "owns its ranks) or --stage-env (its script keeps the bash loop)")
    command = render_argv(step_argv(request))
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
        # torchrun passes SIGTERM (not SIGUSR2, which would kill the agent) on to its workers.
        *(launch_call(request) if supervised(request) else
          launch_lines(request.max_restarts, command, job_key(request),
                       requeue=REQUEUE if request.chain == 1 else None, forward_signal="TERM" if torchrun else "USR2",
                       trap_signals=request.stop_signal.name,
                       leave_out=SRUN_LEAVE_OUT if request.spare_nodes else None)),
        "",
    ]
    return "\n".join(lines)
