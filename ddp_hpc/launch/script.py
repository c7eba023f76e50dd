"""Pieces shared by the PBS and SLURM script renderers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ddp_hpc import __version__
from ddp_hpc.contract import (
    DEADLINE_VAR,
    LEFT_OUT_FILE,
    MPIEXEC_VAR,
    RANK_FAILURES_PREFIX,
    PREEMPTED_MARKER,
    RESTART_COUNT_VAR,
    RUN_FOLDER_VAR,
    STAGE_ROOT_VAR,
    ExitStatus,
    exit_file_name,
)
from ddp_hpc.launch.mpi import PROGRAMS
from ddp_hpc.launch.restart import RestartPolicy
from ddp_hpc.specs.request import SubmitRequest, TrainPayload, export_lines, shell_quote
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


def staged_argv(request: SubmitRequest, argv: Sequence[str]) -> list[str]:
    """``argv``, run from the node-local copy of the environment when the job stages it."""
    return ["bash", "-c", STAGED_WRAPPER, "ddp-hpc-staged", *argv] if request.stage_env else list(argv)


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
        f'  printf \'%s\\n\' {ExitStatus.FAILED:d} >"${RUN_FOLDER_VAR}/{exit_file_name(job_key)}" || true',
        f"  exit {ExitStatus.FAILED:d}",
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
    candidates = " || ".join(f"command -v {name}" for name in PROGRAMS[flavour])
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
        f'  printf \'%s\\n\' {ExitStatus.FAILED:d} >"${RUN_FOLDER_VAR}/{exit_file_name(job_key)}" || true',
        f"  exit {ExitStatus.FAILED:d}",
        "fi",
    ]


def deadline_line(request: SubmitRequest) -> str:
    """The job's end as epoch seconds: the ranks stop and checkpoint before it (no signal needed)."""
    return f"export {DEADLINE_VAR}=$(( $(date +%s) + {request.walltime_s} ))"


@dataclass(frozen=True)
class LeaveOut:
    """How a batch script finds the node where a rank failed and starts the next attempt
    without it (``--spare-nodes``). The common launch loop adds the node to ``$excluded``
    (comma-separated), records it in ``RUN/left-out-hosts.jsonl`` and says so."""

    #: Before the first attempt.
    setup: tuple[str, ...]
    #: After a failed attempt ``$((attempt - 1))``: set ``failed`` (a node name, or empty) and ``reason``.
    find: tuple[str, ...]
    #: With ``$excluded`` updated: make the next attempt run without those nodes.
    apply: tuple[str, ...]
    #: Keep the attempt's stderr in ``$step_log`` (for ``find``).
    capture_stderr: bool = False


#: Wraps a rank's command under mpiexec: records ``RANK STATUS`` when it fails (SIGKILL
#: included: the wrapper outlives it), in the order the ranks fail, and passes the stop
#: signals on. The first line names the rank that failed first: the launcher kills the
#: others only after this wrapper has exited. A rank that stopped (75) touches the preempted
#: marker (``restart.status_of_attempt``): MPICH's Hydra, having passed a stop on, reports
#: the ranks' 75 as 0 about one time in six, whatever the ranks run. Nothing is recorded
#: without a run folder. A passed-on signal ends ``wait`` early
#: (128 + its number): the trap says so, and the wrapper waits again for the rank's own
#: status. (Only the trap can say so: a rank killed by a signal also ends with 128 + N, and
#: a second ``wait`` for a reaped child gives bash's saved status again, not 127.)
RANK_FAILURE_WRAPPER = (
    '"$@" & child=$!; interrupted=0; '
    'trap \'interrupted=1; kill -USR2 "$child" 2>/dev/null\' USR2; '
    'trap \'interrupted=1; kill -TERM "$child" 2>/dev/null\' TERM; '
    'status=0; wait "$child" || status=$?; '
    'while [ "$interrupted" = 1 ]; do interrupted=0; again=0; wait "$child" 2>/dev/null || again=$?; '
    '[ "$again" = 127 ] && break; status=$again; done; '
    f'if [ -z "${RUN_FOLDER_VAR}" ] || [ "$status" = 0 ]; then :; '
    f'elif [ "$status" = {ExitStatus.REQUEUE:d} ]; then touch "${RUN_FOLDER_VAR}/{PREEMPTED_MARKER}"; '
    'else printf \'%s %s\\n\' "${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PALS_RANKID:-?}}}" "$status" '
    f'>>"${RUN_FOLDER_VAR}/{RANK_FAILURES_PREFIX}${{{RESTART_COUNT_VAR}:-0}}"; fi; '
    'exit "$status"')


def recording_rank_failures(argv: Sequence[str]) -> list[str]:
    return ["sh", "-c", RANK_FAILURE_WRAPPER, "ddp-hpc-rank", *argv]


def hostfile_leave_out(hostfile_var: str, nodes: int, per_node: int, master_lines: Sequence[str]) -> LeaveOut:
    """For mpiexec over a hostfile (PBS): the job's hosts stay in ``$job_hosts``; each
    attempt's hostfile is the first ``nodes`` of them not left out, rank 0's host the first
    of those (``master_lines`` export ``MASTER_ADDR`` from ``$first_host``). The failed
    rank's host is its line of the attempt's hostfile (ranks are placed ``per_node`` a host,
    in order)."""
    return LeaveOut(
        setup=("job_hosts=$(mktemp)", f"trap 'rm -f \"${hostfile_var}\" \"$job_hosts\"' EXIT",
               f'cp "${hostfile_var}" "$job_hosts"',
               f'head -n {nodes} "$job_hosts" >"${hostfile_var}"'),
        find=("  failed=; reason=",
              f'  failures="${RUN_FOLDER_VAR}/{RANK_FAILURES_PREFIX}$((attempt - 1))"',
              '  if [ -s "$failures" ]; then',
              '    read -r failed_rank failed_status <"$failures" || true',
              '    case "$failed_rank" in',
              f'      *[!0-9]*|"") ;;',
              f'      *) failed=$(sed -n "$((failed_rank / {per_node} + 1))p" "${hostfile_var}")',
              '         reason="rank $failed_rank exited with status $failed_status" ;;',
              "    esac",
              "  fi"),
        apply=("    awk -v out=\"$excluded\" 'BEGIN { n = split(out, x, \",\"); for (i = 1; i <= n; i++) skip[x[i]] = 1 } "
               f"!skip[$0]' \"$job_hosts\" | head -n {nodes} >\"${hostfile_var}\"",
               f'    if [ "$(wc -l <"${hostfile_var}")" -lt {nodes} ]; then '
               f'echo "ddp_hpc: no spare node left: the restart gets fewer than {nodes} node(s)" >&2; fi',
               f'    first_host=$(head -n 1 "${hostfile_var}")',
               *(f"    {line}" for line in master_lines),
               f'    echo "ddp_hpc: next attempt on $(paste -sd, "${hostfile_var}"), rank 0 at $MASTER_ADDR" >&2'),
    )


def launch_lines(restarts: int, command: str, job_key: str, requeue: str | None, *,
                 forward_signal: str = "USR2",
                 trap_signals: str = "USR2", leave_out: LeaveOut | None = None) -> list[str]:
    """Run the ranks' command in the background, pass the stop signal on, relaunch after a
    failure (``--max-restarts``), and record the exit status for ``--wait``/``status``.

    A trapped signal ends ``wait`` early, so the loop waits until the step is really over.
    Whether to restart, end or requeue is ``RestartPolicy``'s decision (launch/restart.py),
    rendered as bash: ``ExitStatus.REQUEUE`` means the ranks checkpointed and stopped on
    request: no restart; ``requeue`` (a shell command) then runs, if the scheduler has one.
    ``restarts`` is the request's ``max_restarts``.
    With ``leave_out`` (spare nodes), the node where a rank failed is left out of the next
    attempt and recorded (the family says how: srun's ``--exclude``, a hostfile).
    """
    capture = leave_out is not None and leave_out.capture_stderr
    policy = RestartPolicy(restarts).shell_tests()  # the one restart policy, as bash
    lines = [
        "stop_requested=0",
        "step_pid=",
        "on_stop_signal() {",
        '  echo "ddp_hpc: stop signal (time limit or preemption): the ranks checkpoint and stop" >&2',
        "  stop_requested=1",
        "  interrupted=1",
        f'  kill -{forward_signal} "$step_pid" 2>/dev/null || true',
        "}",
        f"trap on_stop_signal {trap_signals}",
        "attempt=0",
        *([*leave_out.setup, "excluded="] if leave_out else []),
        *(["step_log=$(mktemp)"] if capture else []),
        "while :; do",
        f"  export {RESTART_COUNT_VAR}=$attempt",
        "  step_started=$(date +%s)",
        # Asked to stop before the ranks started: nothing to checkpoint, the job goes on later.
        f'  if [ "$stop_requested" = 1 ]; then status={ExitStatus.REQUEUE:d}; break; fi',
        f'  {command} 2> >(tee "$step_log" >&2) &' if capture else f"  {command} &",
        "  step_pid=$!",
        # A signal that came while the step was being started is passed on now.
        f'  if [ "$stop_requested" = 1 ]; then kill -{forward_signal} "$step_pid" 2>/dev/null || true; fi',
        "  status=0",
        "  interrupted=0",
        '  wait "$step_pid" || status=$?',
        # A trapped stop signal ends wait early (status 128 + its number): on_stop_signal says
        # so, and the loop waits again for the step's own status (a step killed by a signal
        # also ends with 128 + N, and a reaped child's status comes back from wait again).
        '  while [ "$interrupted" = 1 ]; do interrupted=0; again=0; wait "$step_pid" 2>/dev/null || again=$?; '
        '[ "$again" = 127 ] && break; status=$again; done',
        # srun --kill-on-bad-exit turns the ranks' REQUEUE into SIGTERM, Hydra may turn it into 0
        # (restart.status_of_attempt): the marker rank 0 wrote says it.
        f'  marker="${RUN_FOLDER_VAR}/{PREEMPTED_MARKER}"',
        f'  if [ -f "$marker" ] && [ "$(stat -c %Y "$marker")" -ge "$step_started" ]; then '
        f'status={ExitStatus.REQUEUE:d}; fi',
        f"  if {policy.ends}; then break; fi",
        "  attempt=$((attempt + 1))",
        *([*leave_out.find, '  if [ -n "$failed" ]; then',
           '    excluded="${excluded:+$excluded,}$failed"',
           # The reason goes into a JSON string: no quotes or backslashes.
           '    printf \'{"host": "%s", "attempt": %d, "reason": "%s"}\\n\' "$failed" "$((attempt - 1))" '
           f'"$(printf %s "$reason" | tr -d \'"\\\\\')" >>"${RUN_FOLDER_VAR}/{LEFT_OUT_FILE}"',
           *leave_out.apply,
           '    echo "ddp_hpc: leaving out node(s) $excluded, where a rank failed ($reason)" >&2',
           "  fi"] if leave_out else []),
        f'  echo "ddp_hpc: the ranks failed (exit $status): restart $attempt of {restarts}, '
        f'resuming from the newest checkpoint" >&2',
        "done",
    ]
    if requeue:
        lines += [
            # A stop signal that comes after the ranks finished (exit 0: Slurm may signal up to
            # a minute early, during the run's teardown) requeues nothing: the run is done.
            f"if {policy.requeues}; then",
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
