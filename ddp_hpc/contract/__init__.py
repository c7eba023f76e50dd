"""What the rendered scripts, the launchers and the ranks agree on, in one place.

Torch-free and stdlib only, so that the submitting side (a login node) and the ranks
import the same names. This package only re-exports its modules:

- ``variables``: the ``DDP_HPC_*`` environment variables they share;
- ``exit_status``: the exit statuses (:class:`ExitStatus`);
- ``run_files``: the run folder's file names;
- ``atomic``: :func:`atomic_write`, the one way a file is replaced;
- ``submission``: a job's record in its run folder (:class:`Submission`).
"""

from __future__ import annotations

from ddp_hpc.contract.variables import (  # noqa: F401
    DEVICE_VAR,
    BACKEND_VAR,
    HOST_SUFFIX_VAR,
    RENDEZVOUS_TIMEOUT_VAR,
    RESTART_COUNT_VAR,
    RECOVERY_STORE_VAR,
    RECOVERY_WAIT_VAR,
    RECOVERY_GENERATION_VAR,
    RECOVERY_SPARE_VAR,
    RECOVERY_SHRINK_VAR,
    RUN_FOLDER_VAR,
    DEBUG_VAR,
    SNAPSHOT_DIR_VAR,
    FUZZ_DEVICE_VAR,
    VAR_PREFIX,
    SNAPSHOT_EVERY_VAR,
    DEADLINE_VAR,
    START_TIME_VAR,
    WALLTIME_VAR,
    SWEEP_INDEX_VAR,
    SWEEP_VAR_PREFIX,
    STAGE_ROOT_VAR,
    STAGE_TIME_IMPORT_VAR,
    HOSTFILE_VAR,
    MPIEXEC_VAR,
    CLUSTERS_DIR_VAR,
    BENCH_STARTED_AT_VAR,
    CONSOLE_RANKS_VAR,
)
from ddp_hpc.contract.exit_status import (  # noqa: F401
    ExitStatus,
    AGREED_EXIT_STATUSES,
)
from ddp_hpc.contract.run_files import (  # noqa: F401
    CONFIG_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    CHECKPOINTS_DIR,
    LAST_CHECKPOINT,
    BEST_CHECKPOINT,
    LAST_SHARDED_CHECKPOINT,
    BEST_SHARDED_CHECKPOINT,
    SHARDED_STEP_FOLDER,
    SHARDED_METADATA_FILE,
    checkpoint_format_of,
    RECORD_DIR,
    STRAGGLERS_FILE,
    TRACKING_DIR,
    CSV_METRICS_FILE,
    CURVES_FILE,
    RANK_LOG_DIR,
    PREEMPTED_MARKER,
    SUBMISSION_FILE,
    SUBMISSIONS_LOG,
    EXIT_FILE_PREFIX,
    LEFT_OUT_FILE,
    RESTARTED_MARKER_PREFIX,
    RANK_FAILURES_PREFIX,
    TEMPORARY_GLOB,
    exit_file_name,
    mark_stopped,
)
from ddp_hpc.contract.atomic import (  # noqa: F401
    fsync_directory,
    atomic_write,
)
from ddp_hpc.contract.submission import (  # noqa: F401
    LOCAL_SCHEDULER,
    ElementRecord,
    Submission,
)
