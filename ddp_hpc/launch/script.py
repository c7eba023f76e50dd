"""Pieces shared by the PBS and SLURM script renderers (every script ends in ``exec ddp-hpc
launch``, which runs the attempts), and the rank wrappers the launch puts around a command."""

from __future__ import annotations

from collections.abc import Sequence

from ddp_hpc.contract import (
    DEADLINE_VAR,
    MPIEXEC_VAR,
    RANK_FAILURES_PREFIX,
    PREEMPTED_MARKER,
    RESTART_COUNT_VAR,
    RUN_FOLDER_VAR,
    STAGE_ROOT_VAR,
    ExitStatus,
    exit_file_name,
)
from ddp_hpc.launch.mpi import mpi_flavour
from ddp_hpc.specs.request import SubmitRequest, TrainPayload, export_lines, shell_quote
from ddp_hpc.staging.fanout import NODE_NAME_SHELL
from ddp_hpc.version import __version__


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


#: The shell array holding a sweep element's overrides in a rendered array job.
SWEEP_ARGS = ShellArray("sweep_args")


def rank_argv(request: SubmitRequest) -> list[str]:
    """The per-rank command; in a sweep of a config, the element's overrides follow."""
    argv = request.rank_command()
    argv = [*argv, SWEEP_ARGS] if request.sweep is not None and isinstance(request.payload, TrainPayload) else argv
    return staged_argv(request, argv)


#: ``--stage-env``: a rank (or torchrun) starts with its node's copy of the environment
#: first on PATH, so ``ddp-hpc``, ``python`` and ``torchrun`` are the copy's. Plain shell:
#: nothing is imported from the shared file system to find the copy.
STAGED_WRAPPER = (f'd="${{{STAGE_ROOT_VAR}}}/{NODE_NAME_SHELL}"; export PATH="$d/bin:$PATH" VIRTUAL_ENV="$d"; '
                  'exec "$@"')


#: What a staged rank's argv starts with: the wrapper, then the command it runs.
STAGED_PREFIX = ("bash", "-c", STAGED_WRAPPER, "ddp-hpc-staged")


def staged_argv(request: SubmitRequest, argv: Sequence[str]) -> list[str]:
    """``argv``, run from the node-local copy of the environment when the job stages it."""
    return [*STAGED_PREFIX, *argv] if request.stage_env else list(argv)


def split_staged(argv: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    """``argv`` as (the staged wrapper or nothing, the command it runs): ``ddp-hpc launch``
    keeps the wrapper outermost, so that what it puts in front of the command (``ddp-hpc
    run``, torchrun) is the node-local copy's too."""
    staged = tuple(argv[:len(STAGED_PREFIX)]) == STAGED_PREFIX
    return (STAGED_PREFIX, list(argv[len(STAGED_PREFIX):])) if staged else ((), list(argv))


#: What each node runs to get its copy (one process per node).
STAGE_FAN_OUT_ARGV = ("ddp-hpc", "stage", "fan-out", ShellVar("stage_archive"), "--rendezvous",
                      ShellVar("stage_rendezvous"))


def stage_lines(request: SubmitRequest, fan_out_command: str, job_id_var: str, job_key: str) -> list[str]:
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
        *_failed_before_launch(job_key),
        "fi",
        'rm -rf "$stage_rendezvous"',
    ]


def sweep_block(request: SubmitRequest, index_var: str, workdir_var: str) -> list[str]:
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


def header_comment(request: SubmitRequest, scheduler: str) -> str:
    return (f"# Rendered by ddp-hpc {__version__} for cluster profile {request.profile.name!r} ({scheduler}): "
            f"{request.world_size} ranks = {request.nodes} node(s) x {request.per_node}")


def environment_block(request: SubmitRequest) -> list[str]:
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
    candidates = " || ".join(f"command -v {name}" for name in mpi_flavour(flavour).programs)
    return (f'{MPIEXEC_VAR}=$({candidates}) || {{ echo "ddp_hpc: no {flavour} mpiexec on PATH" >&2; '
            f'exit {ExitStatus.FAILED:d}; }}')


def run_folder_lines(request: SubmitRequest, workdir_var: str) -> list[str]:
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
        *_failed_before_launch(job_key),
        "fi",
    ]


#: What records a job's exit status from its script (``restart.record_exit``, the one writer),
#: where the job ends before its launch starts.
RECORD_EXIT_ARGV = ("ddp-hpc", "record-exit")
#: What leaves the preempted marker from the rank wrapper (``contract.mark_stopped``, the one writer).
RECORD_STOP_ARGV = ("ddp-hpc", "record-stop")


def _failed_before_launch(job_key: str) -> list[str]:
    """End the job (exit 1) before its launch starts, its exit status recorded for ``--wait``
    and ``status`` (``job_key``: the job's id as the shell expands it)."""
    folder, failed = f'"${RUN_FOLDER_VAR}"', f"{ExitStatus.FAILED:d}"
    return [
        "  # printf only where ddp-hpc itself cannot start (a broken environment may be why this failed)",
        f'  {render_argv(RECORD_EXIT_ARGV)} {folder} "{job_key}" {failed} ||',
        f'    printf \'%s\\n\' {failed} >"${RUN_FOLDER_VAR}/{exit_file_name(job_key)}" || true',
        f"  exit {failed}",
    ]


def deadline_line(request: SubmitRequest) -> str:
    """The job's end as epoch seconds: the ranks stop and checkpoint before it (no signal needed)."""
    return f"export {DEADLINE_VAR}=$(( $(date +%s) + {request.walltime_s} ))"


#: Wraps a rank's command under mpiexec: records ``RANK STATUS`` when it fails (SIGKILL
#: included: the wrapper outlives it), in the order the ranks fail, and passes the stop
#: signals on. The first line names the rank that failed first: the launcher kills the
#: others only after this wrapper has exited. Rank 0 stopping (75) leaves the preempted
#: marker (``attempts.MarkedAttempts`` reads it) through its one writer, ``StopAgreement``'s
#: (``ddp-hpc record-stop``; ``touch`` only where ddp-hpc cannot start on the host): MPICH's
#: Hydra, having passed a stop on, reports the ranks' 75 as 0 about one time in six,
#: whatever the ranks run. Nothing is recorded without a run folder. The traps are set before
#: the rank starts: a signal before it has started is held (``pending``) and passed on once
#: it has, so that none ends the wrapper and leaves the rank running. bash, not sh: a signal
#: that reaches the rank between its fork and its exec lands in the shell's handler there
#: and is lost (dash: 3 of 40 SIGTERMs in the first 6 ms left the wrapper waiting for a rank
#: that never saw them); bash blocks SIGTERM and SIGINT until the child has reset them. The rank runs as a
#: background job, which a non-interactive shell starts with SIGINT ignored and stdin from
#: /dev/null: stdin is handed on, and SIGINT or SIGHUP reach it as SIGTERM. The wrapper does
#: not ``wait`` for the running rank: a trapped signal that ends bash's ``wait`` early loses
#: the rank's status about one time in ten (bash 5.2: every later ``wait`` gives -1, which
#: ``exit`` makes 255, read as a failure; measured 9-19 in 100 with the signal sent to the
#: process group, as Hydra sends it). It watches the rank with ``kill -0`` every 0.1 s (a
#: ``read`` that times out on a pipe nobody writes: no process started, and a trap runs at
#: once; ``sleep`` where that pipe could not be made) and asks ``wait`` only once the rank
#: has ended, for the status bash saved then.
RANK_FAILURE_WRAPPER = (
    'child=; pending=; interrupted=0; '
    'rank="${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PALS_RANKID:-?}}}"; '
    'pass_on() { interrupted=1; if [ -n "$child" ]; then kill -"$1" "$child" 2>/dev/null; else pending=$1; fi; }; '
    'trap \'pass_on USR2\' USR2; trap \'pass_on TERM\' TERM INT HUP; '
    'exec 3<&0; "$@" <&3 3<&- & child=$!; exec 3<&-; '
    '[ -z "$pending" ] || kill -"$pending" "$child" 2>/dev/null; '
    '{ exec 4<> <(:); } 2>/dev/null; '
    'while kill -0 "$child" 2>/dev/null; do read -r -t 0.1 -u 4 _ 2>/dev/null; [ $? -gt 128 ] || sleep 0.1; done; '
    '{ exec 4<&-; } 2>/dev/null; '
    'interrupted=0; status=0; wait "$child" || status=$?; '
    '[ "$interrupted" = 0 ] || { status=0; wait "$child" 2>/dev/null || status=$?; }; '
    f'if [ -z "${RUN_FOLDER_VAR}" ] || [ "$status" = 0 ]; then :; '
    f'elif [ "$status" = {ExitStatus.REQUEUE:d} ]; then '
    f'[ "$rank" != 0 ] || {{ command -v {RECORD_STOP_ARGV[0]} >/dev/null && {render_argv(RECORD_STOP_ARGV)} '
    f'"${RUN_FOLDER_VAR}"; }} || touch "${RUN_FOLDER_VAR}/{PREEMPTED_MARKER}"; '
    'else printf \'%s %s\\n\' "$rank" "$status" '
    f'>>"${RUN_FOLDER_VAR}/{RANK_FAILURES_PREFIX}${{{RESTART_COUNT_VAR}:-0}}"; fi; '
    'exit "$status"')


def recording_rank_failures(argv: Sequence[str]) -> list[str]:
    return ["bash", "-c", RANK_FAILURE_WRAPPER, "ddp-hpc-rank", *argv]
