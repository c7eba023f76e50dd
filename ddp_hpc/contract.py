"""What the rendered scripts, the launchers and the ranks agree on, in one place.

Torch-free and stdlib only, so that the submitting side (a login node) and the ranks
import the same names:

- the ``DDP_HPC_*`` environment variables they share;
- the exit statuses (:class:`ExitStatus`);
- the run folder's file names;
- :func:`atomic_write`, the one way a file is replaced so that a reader sees the old
  content or the whole new one, never a part.
"""

from __future__ import annotations

import enum
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

# --- Environment variables -------------------------------------------------------------
# Exported by a rendered script or a launcher, read by the ranks.

#: The device (``auto``, ``cuda``, ``xpu``, ``cpu``): a cluster profile's choice, below a CLI flag.
DEVICE_VAR = "DDP_HPC_DEVICE"
#: The communication backend (``auto``, ``nccl``, ``xccl``, ``ccl``, ``gloo``).
BACKEND_VAR = "DDP_HPC_BACKEND"
#: Appended to host names to reach the high-speed network (``-hsn``).
HOST_SUFFIX_VAR = "DDP_HPC_HOST_SUFFIX"
#: Seconds to connect to rank 0's store and meet every rank (wins over the config).
RENDEZVOUS_TIMEOUT_VAR = "DDP_HPC_RENDEZVOUS_TIMEOUT"
#: How many times the ranks were relaunched after a failure (0 on the first attempt).
RESTART_COUNT_VAR = "DDP_HPC_RESTART_COUNT"
#: In-job recovery (``ddp-hpc launch --recover``): ``host:port`` of the store the launch
#: serves (it outlives every rank), and the seconds a rank waits for the group to re-form.
RECOVERY_STORE_VAR = "DDP_HPC_RECOVERY_STORE"
RECOVERY_WAIT_VAR = "DDP_HPC_RECOVERY_WAIT_S"
#: The group generation a replacement rank joins (unset: the first group).
RECOVERY_GENERATION_VAR = "DDP_HPC_RECOVERY_GENERATION"
#: Set in a warm spare (``--warm-spare``): its id; it waits in ``InJobRecovery`` for the slot
#: of a lost rank (torch imported, the script run up to there), then joins in its place.
RECOVERY_SPARE_VAR = "DDP_HPC_RECOVERY_SPARE"
#: Set to 1 under ``--shrink``: a lost rank is not replaced, the survivors go on renumbered
#: (a loop that cannot continue on fewer ranks refuses at start-up).
RECOVERY_SHRINK_VAR = "DDP_HPC_RECOVERY_SHRINK"
#: The run folder (also read by ``ddp-hpc status``).
RUN_FOLDER_VAR = "DDP_HPC_RUN_FOLDER"
#: The job's end (walltime limit) in seconds since the epoch.
DEADLINE_VAR = "DDP_HPC_DEADLINE"
#: Alternatively: when the job started (seconds since the epoch) and its walltime in seconds.
START_TIME_VAR = "DDP_HPC_START_TIME"
WALLTIME_VAR = "DDP_HPC_WALLTIME_S"
#: A sweep element's index; each swept key is also exported as ``DDP_HPC_SWEEP_<KEY>``.
SWEEP_INDEX_VAR = "DDP_HPC_SWEEP_INDEX"
SWEEP_VAR_PREFIX = "DDP_HPC_SWEEP_"

#: ``--stage-env``: the node-local folder holding each node's copy of the environment
#: (``ROOT/<node name>``); set by the rendered script, read by ``ddp-hpc stage fan-out``.
STAGE_ROOT_VAR = "DDP_HPC_STAGE_ROOT"
#: ``ddp-hpc stage fan-out``: modules (comma-separated) each node then imports from the
#: shared environment and from its copy, timing both (``--env DDP_HPC_STAGE_TIME_IMPORT=torch``).
STAGE_TIME_IMPORT_VAR = "DDP_HPC_STAGE_TIME_IMPORT"

# Shell variables that live only inside a rendered PBS script.
#: The job's hosts, one per line, duplicates removed.
HOSTFILE_VAR = "DDP_HPC_HOSTFILE"
#: The MPI flavour's ``mpiexec``, found on PATH when the job starts.
MPIEXEC_VAR = "DDP_HPC_MPIEXEC"

# Read on the submitting side.
#: A folder of cluster profiles, searched before the packaged ones.
CLUSTERS_DIR_VAR = "DDP_HPC_CLUSTERS_DIR"
#: ``ddp-hpc bench``: when the runner started a worker (``time.time()``), for start-up figures.
BENCH_STARTED_AT_VAR = "DDP_HPC_BENCH_T0"
#: ``train``/``doctor``: the ranks whose INFO lines reach the console (``--console-ranks``).
CONSOLE_RANKS_VAR = "DDP_HPC_CONSOLE_RANKS"


# --- Exit statuses -----------------------------------------------------------------------

class ExitStatus(enum.IntEnum):
    """What a rank, a launch or a rendered script exits with."""

    OK = 0
    #: A failure (a bug, a failed job): the traceback or the log says why.
    FAILED = 1
    #: The user's mistake (bad input, a missing tool): one line, no traceback.
    USAGE = 2
    #: Checkpointed and stopped on request (time limit, preemption): continue me
    #: (EX_TEMPFAIL, "try again later"). Not a failure: nothing restarts it as one.
    REQUEUE = 75
    #: ``ddp-hpc run``: the command was found but cannot be executed; not found (the shell's codes).
    CANNOT_EXECUTE = 126
    NOT_FOUND = 127
    #: Interrupted by Ctrl-C (128 + SIGINT).
    INTERRUPTED = 130
    #: 128 + SIGTERM: what ``srun --kill-on-bad-exit`` reports when the first rank to exit
    #: with REQUEUE got the others killed. The ``preempted`` marker tells the two apart.
    SIGTERM = 143

    @classmethod
    def of_returncode(cls, returncode: int) -> int:
        """A shell's exit status for ``subprocess``'s return code (``-15`` -> 143)."""
        return returncode if returncode >= 0 else 128 - returncode


#: Statuses that every rank reaches together: they end no one else's job.
AGREED_EXIT_STATUSES = frozenset({ExitStatus.OK, ExitStatus.REQUEUE})


# --- The run folder's file names -----------------------------------------------------------

#: The resolved config, as training ran it.
CONFIG_FILE = "config.yaml"
#: One JSON line per epoch.
METRICS_FILE = "metrics.jsonl"
#: The run's result (``RunSummary``).
SUMMARY_FILE = "summary.json"
#: Checkpoints: ``step-NNNNNNNN.pt`` files, ``last.pt`` and ``best.pt`` pointing at one of them.
CHECKPOINTS_DIR = "checkpoints"
LAST_CHECKPOINT = "last.pt"
BEST_CHECKPOINT = "best.pt"
#: Sharded checkpoints (``checkpoint.format: dcp``): ``step-NNNNNNNN/`` folders, and these
#: one-line files naming the newest complete one and the best one.
LAST_SHARDED_CHECKPOINT = "last.dcp"
BEST_SHARDED_CHECKPOINT = "best.dcp"
#: A sharded checkpoint's step folder, and the file written last in it (complete once it exists).
SHARDED_STEP_FOLDER = re.compile(r"^step-(\d{8})$")
SHARDED_METADATA_FILE = ".metadata"


def checkpoint_format_of(path: Path) -> str | None:
    """``file`` or ``dcp``: the format of the checkpoint at ``path`` as a user names it (a
    ``.pt`` file; a step folder, a file in one, ``last.dcp``/``best.dcp``, or any folder
    holding the sharded metadata); None when neither its name nor its contents say."""
    if path.suffix == ".pt":
        return "file"
    if path.suffix == ".dcp" or SHARDED_STEP_FOLDER.match(path.name) or SHARDED_STEP_FOLDER.match(path.parent.name):
        return "dcp"
    if path.is_dir() and (path / SHARDED_METADATA_FILE).exists():
        return "dcp"
    return None
#: Run records (``<UTC stamp>-step<N>.json``): who ran what, where, with which versions.
RECORD_DIR = "record"
#: In the record folder: the stragglers rank 0 named (a JSON list; rewritten as it names more).
STRAGGLERS_FILE = "stragglers.json"
#: What trackers write in the run folder; the CSV tracker's file inside it.
TRACKING_DIR = "tracking"
CSV_METRICS_FILE = "metrics.csv"
#: Training curves drawn from the metrics.
CURVES_FILE = "curves.png"
#: Each rank's log file (``rank-00003.log``), appended by every attempt.
RANK_LOG_DIR = "logs"
#: Written by rank 0 (``StopAgreement``) when the ranks stopped after a checkpoint: a batch
#: script whose ranks' REQUEUE reached it as SIGTERM (``srun --kill-on-bad-exit``) reads it.
PREEMPTED_MARKER = "preempted"
#: The newest submission of the run, and every one of them (one JSON line each).
SUBMISSION_FILE = "submission.json"
SUBMISSIONS_LOG = "submissions.jsonl"
#: What a rendered script writes when the job ends: its exit status, for ``status``/``--wait``.
EXIT_FILE_PREFIX = "exit-"
#: The nodes a batch script left out of a restart (``--spare-nodes``), one JSON line each:
#: ``{"host": ..., "attempt": N, "reason": ...}``; ``ddp-hpc status`` shows them.
LEFT_OUT_FILE = "left-out-hosts.jsonl"
#: ``.restarted-<job>``: made (O_EXCL) by the first task of a failed submitit job that
#: submits it again, so that the job is submitted again once.
RESTARTED_MARKER_PREFIX = ".restarted-"
#: ``rank-failures-<attempt>``: one line ``RANK STATUS`` per rank that failed in that attempt,
#: in the order they failed (the first names the node a PBS restart leaves out).
RANK_FAILURES_PREFIX = "rank-failures-"
#: The hidden temporaries of :func:`atomic_write` (``.NAME.tmp-...``): a crash may leave one.
TEMPORARY_GLOB = ".*.tmp-*"


def exit_file_name(job_id: str) -> str:
    """``exit-<job id>`` (``exit-123_4`` for an array element)."""
    return f"{EXIT_FILE_PREFIX}{job_id}"


# --- The one atomic write ----------------------------------------------------------------

def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` survive a crash of the machine."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], content: bytes | str | Callable[[BinaryIO], None], *,
                 durable: bool = True) -> None:
    """Replace ``path`` with ``content`` in one rename: a reader sees the old file or the
    whole new one, whatever happens meanwhile.

    ``content`` is bytes, text (UTF-8) or a function that writes to the open binary file
    (``torch.save``, ``figure.savefig``). The temporary file lies in the same folder (a
    rename does not cross file systems) and is removed if anything goes wrong.

    ``durable`` also fsyncs the file before the rename and the folder after it, so the new
    content survives a crash of the machine, not only of the process. It matters where
    the file is the only copy of something: checkpoints, the exit file, the preempted
    marker, the run's config, summary and record, the submission record. It costs a disk
    flush each time, so files that are rebuilt or rewritten often skip it: the CSV
    metrics (re-read and rewritten at each start), curves, rendered scripts.
    """
    path = Path(path)
    # O_EXCL on a random name: two writers of the same file (threads, ranks on a shared
    # folder) never share a temporary. Mode 0o666 under the umask, as open() would give.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "wb", closefd=True) as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content.encode() if isinstance(content, str) else content)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:  # also KeyboardInterrupt: the temporary never becomes visible
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_directory(path.parent)
