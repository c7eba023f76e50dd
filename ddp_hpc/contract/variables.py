"""Every ``DDP_HPC_*`` environment variable: exported by a rendered script or a launcher,
read by the ranks (and a few read on the submitting side)."""

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
#: In-job recovery of a sharded model: steps between snapshots of each rank's shards (default
#: 1), and the folder on node-local memory they are kept in (default ``/dev/shm``).
SNAPSHOT_EVERY_VAR = "DDP_HPC_SNAPSHOT_EVERY"
SNAPSHOT_DIR_VAR = "DDP_HPC_SNAPSHOT_DIR"
#: The recovery fuzzer's ranks' device (``python -m ddp_hpc.bench.recovery_fuzz --device``).
FUZZ_DEVICE_VAR = "DDP_HPC_FUZZ_DEVICE"
#: What every variable of this contract begins with (a launch of one's own may clear them all).
VAR_PREFIX = "DDP_HPC_"
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
#: Set to 1 (``ddp-hpc --debug`` sets it for what it starts): an error a rank reports in one
#: line (in-job recovery given up, ``RecoveryError``) keeps its traceback.
DEBUG_VAR = "DDP_HPC_DEBUG"
#: ``train``/``doctor``: the ranks whose INFO lines reach the console (``--console-ranks``).
CONSOLE_RANKS_VAR = "DDP_HPC_CONSOLE_RANKS"
