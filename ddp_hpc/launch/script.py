"""Pieces shared by the PBS and SLURM script renderers."""

from __future__ import annotations

from collections.abc import Sequence

from ddp_hpc import __version__
from ddp_hpc.contract import (
    DEADLINE_VAR,
    MPIEXEC_VAR,
    PREEMPTED_MARKER,
    RESTART_COUNT_VAR,
    RUN_FOLDER_VAR,
    STAGE_ROOT_VAR,
    ExitStatus,
    exit_file_name,
)
from ddp_hpc.launch.mpi import PROGRAMS
from ddp_hpc.launch.request import JobRequest, TrainPayload, export_lines, shell_quote
from ddp_hpc.staging.fanout import NODE_NAME_SHELL


class ShellVar(str):
    """An argument that is a shell variable (``"$NAME"``), not a literal to quote."""


class ShellArray(str):
    """An argument that expands a shell array (``"${NAME[@]}"``: zero or more words)."""


def render_argv(argv: Sequence[str]) -> str:
    def word(arg: str) -> str:
        if isinstance(arg, ShellArray):
            return f'"${{{arg}[@]}}"'
        return f'"${{{arg}}}"' if isinstance(arg, ShellVar) else shell_quote(str(arg))

    return " ".join(word(a) for a in argv)


#: The shell array of srun options that leave failed nodes out (``--spare-nodes``).
EXCLUDE_ARGS = "exclude_args"
#: The shell array holding a sweep element's overrides in a rendered array job.
SWEEP_ARGS = ShellArray("sweep_args")


def rank_argv(request: JobRequest) -> list[str]:
    """The per-rank command; in a sweep of a config, the element's overrides follow."""
    argv = request.rank_command()
    argv = [*argv, SWEEP_ARGS] if request.sweep is not None and isinstance(request.payload, TrainPayload) else argv
    return staged_argv(request, argv)


#: ``--stage-env``: a rank (or torchrun) starts with its node's copy of the environment
#: first on PATH, so ``ddp-hpc``, ``python`` and ``torchrun`` are the copy's. Plain shell:
#: nothing is imported from the shared file system to find the copy.
STAGED_WRAPPER = (f'd="${{{STAGE_ROOT_VAR}}}/{NODE_NAME_SHELL}"; export PATH="$d/bin:$PATH" VIRTUAL_ENV="$d"; '
                  'exec "$@"')


def staged_argv(request: JobRequest, argv: Sequence[str]) -> list[str]:
    """``argv``, run from the node-local copy of the environment when the job stages it."""
    return ["bash", "-c", STAGED_WRAPPER, "ddp-hpc-staged", *argv] if request.stage_env else list(argv)


#: What each node runs to get its copy (one process per node).
STAGE_FAN_OUT_ARGV = ("ddp-hpc", "stage", "fan-out", ShellVar("stage_archive"), "--rendezvous",
                      ShellVar("stage_rendezvous"))


def stage_lines(request: JobRequest, fan_out_command: str, job_id_var: str, job_key: str) -> list[str]:
    """``--stage-env``: pack the environment once (reused while unchanged), copy it to every
    node's ``--stage-dir`` over a tree of the nodes, and end the job (exit 1) if that fails."""
    if not request.stage_env:
        return []
    root = f'{shell_quote(request.stage_dir.rstrip("/") or "/")}/ddp_hpc-env-"${{{job_id_var}}}"'
    return [
        "# Environment staging (--stage-env): packed once, copied to node-local disk on every node (each node",
        "# that has it sends it to two more), the ranks run from there",
        f"export {STAGE_ROOT_VAR}={root}",
        f'stage_rendezvous=$(mktemp -d "${RUN_FOLDER_VAR}/.stage.XXXXXX")',
        f"if ! stage_archive=$(ddp-hpc stage pack) || ! {fan_out_command}; then",
        '  echo "ddp_hpc: staging the environment failed (see above): the ranks were not started" >&2',
        f'  printf \'%s\\n\' {ExitStatus.FAILED:d} >"${RUN_FOLDER_VAR}/{exit_file_name(job_key)}" || true',
        f"  exit {ExitStatus.FAILED:d}",
        "fi",
        'rm -rf "$stage_rendezvous"',
    ]


def sweep_block(request: JobRequest, index_var: str, workdir_var: str) -> list[str]:
    """Pick this array task's element: its overrides, variables and run folder."""
    lines = ["", f"# Sweep: element ${index_var} of {len(request.elements)}", f'case "${{{index_var}}}" in']
    for element in request.elements:
        folder = _folder_value(request.element_run_folder(element), workdir_var)
        overrides = " ".join(shell_quote(o) for o in request.element_overrides(element))
        exports = "; ".join(f"export {k}={shell_quote(v)}" for k, v in element.environment().items())
        lines.append(f"  {element.index}) sweep_args=({overrides}); {exports}; export {RUN_FOLDER_VAR}={folder} ;;")
    lines += [f'  *) echo "ddp_hpc: no sweep element ${{{index_var}}}" >&2; exit {ExitStatus.USAGE:d} ;;', "esac",
              f'mkdir -p "${RUN_FOLDER_VAR}"', f'echo "ddp_hpc: sweep element ${index_var}: ${{sweep_args[*]}}"',
              f'echo "ddp_hpc: run folder ${RUN_FOLDER_VAR}"']
    return lines


def _folder_value(folder, workdir_var: str) -> str:
    quoted = shell_quote(str(folder))
    return quoted if folder.is_absolute() else f'"${{{workdir_var}}}/"{quoted}'


def header_comment(request: JobRequest, scheduler: str) -> str:
    return (f"# Rendered by ddp-hpc {__version__} for cluster profile {request.profile.name!r} ({scheduler}): "
            f"{request.world_size} ranks = {request.nodes} node(s) x {request.per_node}")


def environment_block(request: JobRequest) -> list[str]:
    lines = []
    setup = request.setup_lines()
    if setup:
        lines += ["", "# Set-up", *setup]
    env = request.environment()
    if env:
        lines += ["", "# Environment for every rank", *export_lines(env)]
    return lines


def mpiexec_lookup(flavour: str) -> str:
    """Shell that finds the flavour's mpiexec at run time (names differ between sites)."""
    candidates = " || ".join(f"command -v {name}" for name in PROGRAMS[flavour])
    return (f'{MPIEXEC_VAR}=$({candidates}) || {{ echo "ddp_hpc: no {flavour} mpiexec on PATH" >&2; '
            f'exit {ExitStatus.FAILED:d}; }}')


def run_folder_lines(request: JobRequest, workdir_var: str) -> list[str]:
    """``$DDP_HPC_RUN_FOLDER`` (relative folders are under the workdir), created, and named in
    the job's output."""
    value = _folder_value(request.run_folder, workdir_var)
    return [f"export {RUN_FOLDER_VAR}={value}", f'mkdir -p "${RUN_FOLDER_VAR}"',
            f'echo "ddp_hpc: run folder ${RUN_FOLDER_VAR}"']


#: What a pre-flight step runs on one rank per node (``--preflight``).
PREFLIGHT_ARGV = ("ddp-hpc", "doctor", "--links")


def preflight_lines(command: str, job_key: str) -> list[str]:
    """Run ``command`` (the pre-flight launch) and end the job, recording exit 1, if it fails."""
    return [
        "# Pre-flight (--preflight): bandwidth and latency between the nodes, before any rank starts",
        f"if ! {command}; then",
        '  echo "ddp_hpc: pre-flight link check failed (see above): the ranks were not started" >&2',
        f'  printf \'%s\\n\' {ExitStatus.FAILED:d} >"${RUN_FOLDER_VAR}/{exit_file_name(job_key)}" || true',
        f"  exit {ExitStatus.FAILED:d}",
        "fi",
    ]


def deadline_line(request: JobRequest) -> str:
    """The job's end as epoch seconds: the ranks stop and checkpoint before it (no signal needed)."""
    return f"export {DEADLINE_VAR}=$(( $(date +%s) + {request.walltime_s} ))"


#: After a failed step: the node srun names first in ``srun: error: NODE: task N: ...``.
_FAILED_NODE = '  failed=$(sed -n \'s/^srun: error: \\([^:]*\\): task [0-9].*/\\1/p\' "$step_log" | head -n 1)'


def launch_lines(request: JobRequest, command: str, job_key: str, requeue: str | None, *,
                 restarts: int | None = None, forward_signal: str = "USR2",
                 trap_signals: str = "USR2", leave_out_failed_node: bool = False) -> list[str]:
    """Run the ranks' command in the background, pass the stop signal on, relaunch after a
    failure (``--max-restarts``), and record the exit status for ``--wait``/``status``.

    A trapped signal ends ``wait`` early, so the loop waits until the step is really over.
    ``ExitStatus.REQUEUE`` means the ranks checkpointed and stopped on request: no restart;
    ``requeue`` (a shell command) then runs, if the scheduler has one. ``restarts`` defaults to the
    request's ``max_restarts`` (0 where the launcher restarts by itself, like torchrun).
    With ``leave_out_failed_node`` (srun with spare nodes), the node where a rank failed is
    added to ``EXCLUDE_ARGS`` for the next attempt.
    """
    restarts = request.max_restarts if restarts is None else restarts
    lines = [
        "stop_requested=0",
        "on_stop_signal() {",
        '  echo "ddp_hpc: stop signal (time limit or preemption): the ranks checkpoint and stop" >&2',
        "  stop_requested=1",
        f'  kill -{forward_signal} "$step_pid" 2>/dev/null || true',
        "}",
        f"trap on_stop_signal {trap_signals}",
        "attempt=0",
        *([f"{EXCLUDE_ARGS}=()", "excluded=", "step_log=$(mktemp)"] if leave_out_failed_node else []),
        "while :; do",
        f"  export {RESTART_COUNT_VAR}=$attempt",
        "  step_started=$(date +%s)",
        f'  {command} 2> >(tee "$step_log" >&2) &' if leave_out_failed_node else f"  {command} &",
        "  step_pid=$!",
        "  status=0",
        '  wait "$step_pid" || status=$?',
        '  while kill -0 "$step_pid" 2>/dev/null; do wait "$step_pid" || status=$?; done',
        # srun --kill-on-bad-exit turns the ranks' REQUEUE into SIGTERM: the marker rank 0 wrote says it.
        f'  marker="${RUN_FOLDER_VAR}/{PREEMPTED_MARKER}"',
        f'  if [ "$status" != 0 ] && [ -f "$marker" ] && [ "$(stat -c %Y "$marker")" -ge "$step_started" ]; then '
        f'status={ExitStatus.REQUEUE:d}; fi',
        f'  if [ "$status" = {ExitStatus.OK:d} ] || [ "$status" = {ExitStatus.REQUEUE:d} ] || '
        f'[ "$stop_requested" = 1 ] || [ "$attempt" -ge {restarts} ]; then break; fi',
        "  attempt=$((attempt + 1))",
        *([_FAILED_NODE, '  if [ -n "$failed" ]; then',
           '    excluded="${excluded:+$excluded,}$failed"',
           f'    {EXCLUDE_ARGS}=(--exclude="$excluded")',
           '    echo "ddp_hpc: leaving out node(s) $excluded, where a rank failed" >&2',
           "  fi"] if leave_out_failed_node else []),
        f'  echo "ddp_hpc: the ranks failed (exit $status): restart $attempt of {restarts}, '
        f'resuming from the newest checkpoint" >&2',
        "done",
    ]
    if requeue:
        lines += [
            f'if [ "$stop_requested" = 1 ] || [ "$status" = {ExitStatus.REQUEUE:d} ]; then',
            f'  echo "ddp_hpc: requeueing job {job_key}" >&2',
            f'  {requeue} || echo "ddp_hpc: requeue failed" >&2',
            '  exit "$status"',
            "fi",
        ]
    lines += [
        f'printf \'%s\\n\' "$status" >"${RUN_FOLDER_VAR}/{exit_file_name(job_key)}" || true',
        'exit "$status"',
    ]
    return lines
