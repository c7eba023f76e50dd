"""A rank that fails before or during the rendezvous ends the whole job within a minute,
under every launcher, with one line naming the rank, its host and the cause.

The launchers differ: torchrun, Open MPI and ``srun --kill-on-bad-exit`` end the job when
one rank exits non-zero; MPICH's Hydra and plain ``srun`` wait for the others, so the
failing rank asks them (PMI abort, ``scancel`` of the step). Plain ``srun`` is used here
on purpose: with ``--kill-on-bad-exit`` SLURM would do the work.
"""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import FIGURES, REPO, clean_env, ddp_hpc_command
from ddp_hpc.environment.ports import derive_port

pytestmark = [pytest.mark.multiproc, pytest.mark.reliability]
LIMIT_S = 60
TRAIN = ["train", str(REPO / "configs" / "synthetic.yaml"), "job.params.samples=512", "job.params.val_samples=0",
         "job.params.input_dim=16", "job.params.hidden=16", "job.params.depth=1", "training.batch_size=16",
         "training.epochs=1", "logging.progress=never", "checkpoint.every_n_epochs=null"]
LAUNCHERS = ["torchrun", "mpich", "openmpi", "srun"]
MARKS = {"mpich": [pytest.mark.mpi], "openmpi": [pytest.mark.mpi], "srun": [pytest.mark.slurm]}


def launchers(*names: str) -> list:
    return [pytest.param(name, marks=MARKS.get(name, [])) for name in names]


def prefix(launcher: str, request) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python"]
    if launcher == "srun":
        request.getfixturevalue("slurm_cluster")
        return ["srun", "-N2", "-n2"]
    program = request.getfixturevalue(launcher)
    return [program, "-n", "2", *(["--oversubscribe"] if launcher == "openmpi" else [])]


def launch(argv: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.time()
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                            env=clean_env({"PYTHONPATH": str(REPO / "tests"), **(env or {})}))
    return result, time.time() - started


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stderr + result.stdout).splitlines() if "ddp-hpc: error:" in line]


@pytest.fixture
def foreign_listener():
    """A program that is not a rendezvous store holds a port on 127.0.0.1: it accepts
    connections and never answers (as the listener in the issue did)."""
    server = socket.socket()
    for port in random.Random().sample(range(20000, 30000), 200):  # inside the derived range
        try:
            server.bind(("127.0.0.1", port))
            break
        except OSError:
            continue
    server.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in held:
        conn.close()


def pbs_job_id_for(port: int) -> str:
    """A PBS job id whose derived rendezvous port is ``port`` (as ``ddp-hpc port`` prints)."""
    low, span = 20000, 10000
    assert low <= port < low + span, port
    base = derive_port("0.pbs")
    job_id = f"{(port - base) % span}.pbs"
    assert derive_port(job_id) == port
    return job_id


@pytest.mark.parametrize("launcher", launchers("mpich", "openmpi", "srun"))
def test_rendezvous_port_taken_ends_the_job(launcher, request, tmp_path, foreign_listener):
    port = foreign_listener
    if launcher == "mpich":  # the port derived from the job id, as in the issue
        env = {"PBS_JOBID": pbs_job_id_for(port)}
    else:  # Open MPI's and srun's job keys are not known in advance: name the port
        env = {"MASTER_PORT": str(port)}
    result, seconds = launch([*prefix(launcher, request), *ddp_hpc_command(), *TRAIN,
                              f"logging.run_dir={tmp_path / 'runs'}"], tmp_path, env)
    FIGURES.append(f"rendezvous port taken under {launcher}: job ended {seconds:.1f}s after its start, "
                   f"exit {result.returncode}")
    assert result.returncode != 0 and seconds < LIMIT_S, result.stderr[-3000:]
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr[-3000:]
    assert re.fullmatch(rf"ddp-hpc: error: rank 0 on host \S+: rendezvous port {port} on \S+ is already "
                        r"in use: set MASTER_PORT to a free port", lines[0]), lines
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("launcher", launchers(*LAUNCHERS))
def test_an_exception_in_build_datasets_on_one_rank_ends_the_job(launcher, request, tmp_path):
    marker = tmp_path / "fault-time"
    result, _ = launch([*prefix(launcher, request), *ddp_hpc_command(), *TRAIN, f"logging.run_dir={tmp_path / 'runs'}",
                        "job.name=fault_injection:RaiseInBuildDatasets", f"job.params.marker={marker}"], tmp_path)
    ended = time.time()
    assert marker.exists(), "the fault was never injected:\n" + result.stderr[-3000:]
    seconds = ended - float(marker.read_text())
    FIGURES.append(f"exception in build_datasets on rank 1 under {launcher}: job ended {seconds:.1f}s after it, "
                   f"exit {result.returncode}")
    assert result.returncode != 0 and seconds < LIMIT_S, result.stderr[-3000:]
    assert re.search(r"\[rank 1\] ERROR ddp_hpc.training.run_on_rank: failed on host \S+ .*RuntimeError: injected failure in "
                     r"build_datasets on rank 1", result.stderr), result.stderr[-3000:]


RANK1_ONLY = ('case "${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:-$RANK}}}" in '
              '1) export DDP_HPC_RENDEZVOUS_TIMEOUT=soon;; esac; exec "$@"')


@pytest.mark.parametrize("launcher", launchers(*LAUNCHERS))
def test_one_rank_failing_before_the_rendezvous_ends_the_job(launcher, request, tmp_path):
    """Rank 1 stops on its own bad input while rank 0 waits for it in the rendezvous
    (whose timeout is the default 180 s): the job still ends within a minute."""
    result, seconds = launch([*prefix(launcher, request), "sh", "-c", RANK1_ONLY, "sh", *ddp_hpc_command(), *TRAIN,
                              f"logging.run_dir={tmp_path / 'runs'}"], tmp_path)
    FIGURES.append(f"rank 1 failing before the rendezvous under {launcher}: job ended {seconds:.1f}s after its "
                   f"start, exit {result.returncode}")
    assert result.returncode != 0 and seconds < LIMIT_S, result.stderr[-3000:]
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr[-3000:]
    assert re.fullmatch(r"ddp-hpc: error: rank 1 on host \S+: DDP_HPC_RENDEZVOUS_TIMEOUT='soon' is not a number "
                        r"of seconds", lines[0]), lines
