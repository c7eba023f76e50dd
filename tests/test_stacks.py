"""The supported torch range, proven (issue 29): real 2-rank CPU launches of the paths a user
takes, on each torch in .ci/torch-versions (the lowest that pyproject.toml declares and the
newest this machine's pip allows), next to the suite's own torch.

Each version runs from a venv of its own that scripts/torch-venv.sh builds and caches (torch
as pip installs it, ddp_hpc's dependencies, no ddp_hpc); this checkout's ddp_hpc comes first
on PYTHONPATH, which every launcher hands to its ranks. .ci/run builds the venvs while the
rest of the suite runs, then runs these tests (marker ``stacks``). Elsewhere a missing venv
skips with the command that builds it, and fails under DDP_HPC_REQUIRE_ALL=1. The versions
marked ``light`` there get a light venv (``torch-venv.sh --light``) and only the one-rank
tests (the ``any_stack`` fixture): background DCP saves on every minor from 2.9."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import REPO, built_once, need, run
from ddp_hpc import torch_support

#: .ci/torch-versions: each line a version, ``light`` after the ones only the one-rank tests run on.
ENTRIES = tuple((fields[0], fields[1:] == ["light"])
                for fields in (line.split("#")[0].split() for line in
                               (REPO / ".ci" / "torch-versions").read_text().splitlines()) if fields)
#: The versions every test here runs on, in full venvs.
VERSIONS = tuple(version for version, light in ENTRIES if not light)
EXAMPLES = REPO / "examples"
FAULTS = str(REPO / "tests" / "scripts" / "own_loop_faults.py")
DIGITS = ["configs/digits.yaml", "logging.plot=false", "logging.progress=never"]
pytestmark = pytest.mark.stacks


@dataclass(frozen=True)
class Stack:
    """One torch version's venv and the environment that runs this checkout on it."""

    version: str
    venv: Path
    env: dict[str, str]
    #: ``torch.__version__`` there, e.g. ``2.5.1+cu124``.
    torch: str

    def bin(self, program: str) -> str:
        return str(self.venv / "bin" / program)

    def run(self, args: list[str], *, timeout: float = 300, env: dict[str, str] | None = None):
        return run(args, timeout=timeout, env={**self.env, **(env or {})})


def _stack(version: str, light: bool, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    flags = ["--check", *(["--light"] if light else [])]
    found = subprocess.run([str(REPO / "scripts" / "torch-venv.sh"), *flags, version],
                           capture_output=True, text=True, timeout=60)
    need(found.returncode == 0, f"no venv with torch {version} (scripts/torch-venv.sh {' '.join(flags[1:] + [version])} "
                                "builds it: 1.3-6 GB, minutes the first time; .ci/run does)")
    venv = Path(found.stdout.strip())
    # Only ddp_hpc, as an installed package would be: not the checkout's other folders.
    path = tmp_path_factory.mktemp(f"pythonpath-{version}")
    (path / "ddp_hpc").symlink_to(REPO / "ddp_hpc")
    main_bin = str(Path(sys.executable).parent)
    rest = [part for part in os.environ.get("PATH", "").split(os.pathsep) if part and part != main_bin]
    # CPU ranks (gloo) on any host: these are CUDA builds of torch.
    env = {"PATH": os.pathsep.join([str(venv / "bin"), *rest]), "PYTHONPATH": str(path), "CUDA_VISIBLE_DEVICES": ""}
    probe = run([str(venv / "bin" / "python"), "-c", "import ddp_hpc, torch; print(torch.__version__, ddp_hpc.__file__)"],
                env=env, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    torch_version, package = probe.stdout.split()
    assert torch_version.split("+")[0] == version and Path(package).resolve() == REPO / "ddp_hpc" / "__init__.py", \
        probe.stdout
    return Stack(version, venv, env, torch_version)


@pytest.fixture(scope="session", params=VERSIONS)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    return _stack(request.param, False, tmp_path_factory)


@pytest.fixture(scope="session", params=[version for version, _ in ENTRIES])
def any_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """Every version of .ci/torch-versions, light ones too: for the one-rank tests."""
    return _stack(request.param, dict(ENTRIES)[request.param], tmp_path_factory)


def test_ci_proves_the_lowest_torch_that_pyproject_declares():
    """The range users are promised starts where these tests start."""
    with open(REPO / "pyproject.toml", "rb") as file:
        declared = tomllib.load(file)["project"]["dependencies"]
    torch_requirement = next(r for r in declared if re.match(r"torch\b", r))
    lowest = re.search(r">=\s*([\d.]+)", torch_requirement).group(1)
    assert torch_support.parse(lowest) == torch_support.parse(VERSIONS[0]) == torch_support.MINIMUM, \
        (torch_requirement, VERSIONS, torch_support.MINIMUM)
    assert [torch_support.parse(v) for v, _ in ENTRIES] == sorted(torch_support.parse(v) for v, _ in ENTRIES)


def test_ci_proves_background_dcp_saves_on_every_torch_minor_from_the_stager_path_on():
    """Every minor from the first whose ``async_save`` takes our stager to the newest here
    (the suite's own torch counts: tests/test_engine.py runs the same script on it), and a
    version below it (the other branch of ``DcpFormat.save``)."""
    minors = {torch_support.parse(v) for v, _ in ENTRIES} | {torch_support.parse(torch.__version__)}
    first, newest = torch_support.DCP_ASYNC_STAGER, max(minors)
    assert {(first[0], minor) for minor in range(first[1], newest[1] + 1)} <= minors, sorted(minors)
    assert min(minors) < first


def test_background_dcp_saves_resume_bit_identical(any_stack, tmp_path):
    """One rank, two ``Checkpointer(format="dcp", background=True)`` saves (the second refills
    the host buffers of the first) while training goes on, each restored bit-identical
    (tests/scripts/dcp_background_resume.py): DDP, and FSDP2 where the torch runs it. On
    torch 2.11 and 2.12 the stager kept between saves failed (KeyError: <class 'type'>)."""
    strategies = ["ddp"] + ([] if torch_support.fsdp2_refusal(any_stack.torch) else ["fsdp2"])
    result = any_stack.run([any_stack.bin("python"), str(REPO / "tests" / "scripts" / "dcp_background_resume.py"),
                            str(tmp_path), "cpu", *strategies], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = [line for line in result.stdout.splitlines() if line.startswith("resumed ")]  # torch < 2.11's gloo prints too
    assert resumed == [f"resumed {s} step {n}" for s in strategies for n in (3, 5)], result.stdout


def test_in_job_recovery_s_checks_run_on_this_torch(stack):
    """``InJobRecovery.run`` refuses an FSDP2 model by its class, which torch < 2.6 keeps
    only in ``torch.distributed._composable.fsdp``: a DDP model must pass on every torch
    (on 2.5 the import failed and every rank of a ``--recover`` launch exited 1)."""
    result = stack.run([stack.bin("python"), "-c", "import torch; from ddp_hpc.engine.recovery import run_refusal; "
                        "assert run_refusal(torch.nn.Linear(2, 2), None) is None; print('passed')"], timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "passed", result.stderr[-3000:]


@pytest.mark.multiproc
def test_this_torch_s_store_client_and_gloo_group_work_against_the_launch_s_torch_free_store(stack):
    """The launch serves the recovery store without torch (engine/recovery/store_server.py,
    this interpreter's): every request this torch's client makes, and a group formed over it."""
    from test_store_server import torch_client_passes

    assert f"passed {stack.torch}" in torch_client_passes(stack.bin("python"), stack.env)


@pytest.mark.multiproc
@pytest.mark.reliability
def test_a_rank_killed_under_launch_recover_is_replaced_in_the_job_over_the_torch_free_store(stack, tmp_path):
    """``launch --recover``'s store is served without torch; this torch's ranks meet in it
    (their clients, heartbeats, groups over its prefixes): slot 1 SIGKILLed after its
    optimizer step of step 4 (tests/scripts/recovery_faults) is replaced in the job."""
    faults = str(REPO / "tests" / "scripts" / "recovery_faults")
    result = stack.run([stack.bin("ddp-hpc"), "launch", "--nproc", "2", "--recover", "1", "--", "python",
                        str(EXAMPLES / "recovering_loop.py")], timeout=400,
                       env={"EPOCHS": "1", "RUN_DIR": str(tmp_path), "RECOVERY_FAULT": "window",
                            "RECOVERY_FAULT_SLOT": "1", "RECOVERY_FAULT_STEP": "4",
                            "PYTHONPATH": os.pathsep.join([stack.env["PYTHONPATH"], faults])})
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert (tmp_path / "fault-rank").exists(), "slot 1 was never killed"
    records = [json.loads(path.read_text()) for path in sorted(tmp_path.rglob("recovery-*.json"))]
    assert [(record["rank"], record["replaced"]) for record in records] == [(1, True)], records


@pytest.mark.mpi
@pytest.mark.multiproc
def test_doctor_under_mpich(stack, mpich):
    result = stack.run([mpich, "-n", "2", stack.bin("ddp-hpc"), "doctor"], timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line[:1].isdigit()]
    assert [line.split()[9].split("+")[0] for line in table] == [stack.version] * 2, result.stdout  # the torch column
    assert "doctor: OK: 2 ranks on 1 node(s)" in result.stdout


@pytest.mark.mpi
@pytest.mark.multiproc
@pytest.mark.slow
def test_digits_under_open_mpi_reach_the_accuracy_they_reach_on_the_suites_torch(stack, openmpi, tmp_path):
    """The full digits config: test_launch_real.py's README command asserts 95% on the suite's torch."""
    result = stack.run([openmpi, "-n", "2", "--oversubscribe", stack.bin("ddp-hpc"), "train", *DIGITS,
                        f"logging.run_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "digits" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["status"] == "completed"
    assert summary["test"]["accuracy"] >= 0.95, summary["test"]


@pytest.mark.slurm
@pytest.mark.multiproc
def test_digits_under_srun(stack, slurm_cluster, tmp_path):
    result = stack.run(["srun", "-n", "2", stack.bin("ddp-hpc"), "train", *DIGITS, "training.epochs=1",
                        f"logging.run_dir={tmp_path}"], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "digits" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs_run_per_rank"] == [1, 1]


@pytest.mark.mpi
@pytest.mark.multiproc
def test_ddp_hpc_run_of_the_plain_ddp_example_under_mpich(stack, mpich):
    result = stack.run([mpich, "-n", "2", stack.bin("ddp-hpc"), "run", "--", "python",
                        str(EXAMPLES / "plain_ddp.py")])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(re.findall(r"rank (\d)/2 local_rank \d: all_reduce (correct=\d+ total=297)", result.stdout))
    assert [rank for rank, _ in lines] == ["0", "1"] and lines[0][1] == lines[1][1], result.stdout


def _loop_states(stack: Stack, *folders: Path) -> list[dict]:
    """tests/scripts/loop_state.py in the stack's own torch: each run's step, sampler, and
    digests of its model, optimizer state and per-rank RNG."""
    result = stack.run([stack.bin("python"), str(REPO / "tests" / "scripts" / "loop_state.py"), *map(str, folders)],
                       timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def _torchrun(stack: Stack, max_restarts: int) -> list[str]:
    return [stack.bin("torchrun"), "--standalone", "--nproc_per_node=2", f"--max-restarts={max_restarts}",
            FAULTS, str(EXAMPLES / "resumable_loop.py")]


@pytest.mark.reliability
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(600)  # the uninterrupted run (once per version) and the killed one
# dcp's version-dependent calls (``no_dist`` on load, the stager of a background save) are all
# in dcp-background's save and resume; a synchronous dcp save is the same call on every version
# (tests/test_engine.py runs it on the suite's torch).
@pytest.mark.parametrize("form,background", [("file", False), ("dcp", True)], ids=["file", "dcp-background"])
def test_own_loop_sigkilled_under_torchrun_resumes_bit_identical(stack, form, background, tmp_path, tmp_path_factory):
    """examples/resumable_loop.py under ``torchrun --max-restarts 1``: rank 1 SIGKILLs itself
    after step 35, both ranks resume from step 30's checkpoint and end as an uninterrupted run
    ends, bit for bit (model, optimizer state, sampler, each rank's RNG). The uninterrupted
    run writes single-file checkpoints; the training it records is the same in either format.
    dcp's calls differ with the version (``torch_support``: ``no_dist`` from 2.7, a stager of
    our own for background saves from 2.9), so each version writes both kinds (dcp in the background)."""
    def uninterrupted(folder: Path) -> None:
        done = stack.run(_torchrun(stack, 0), env={"RUN_DIR": str(folder)})
        assert done.returncode == 0, done.stderr[-3000:]

    reference = built_once(tmp_path_factory, f"stack-{stack.version}-loop", uninterrupted)
    marker = tmp_path / "killed"
    done = stack.run(_torchrun(stack, 1), timeout=400, env={
        "RUN_DIR": str(tmp_path / "run"), "CHECKPOINT_FORMAT": form, "CHECKPOINT_BACKGROUND": "1" if background else "0",
        "FAULT_KILL_RANK": "1", "FAULT_AT_STEP": "35",
        "FAULT_MARKER": str(marker), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert done.returncode == 0, done.stderr[-6000:]
    assert marker.exists(), "rank 1 was not killed"
    # A background save of step 30 may still be under way when rank 1 dies at step 35: then
    # the newest complete checkpoint, step 20's, is the one to resume from.
    steps = "(20|30)" if background else "(30)"
    for rank in (0, 1):
        assert f"rank {rank}: restored None at step 0" in done.stderr
        found = re.search(rf"rank {rank}: restored \S+step-000000{steps}(\.pt)? at step {steps}", done.stderr)
        assert found and found[1] == found[3], done.stderr[-3000:]
    expected, resumed = _loop_states(stack, reference, tmp_path / "run")
    assert resumed["format"] == form and resumed["step"] == 120
    assert {**resumed, "format": "file"} == expected


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_fsdp2_trains_or_is_refused_in_one_line_before_the_first_step(stack, tmp_path):
    refusal = torch_support.fsdp2_refusal(stack.torch)
    if refusal:
        result = stack.run([stack.bin("ddp-hpc"), "train", *DIGITS, "training.strategy=fsdp2",
                            f"logging.run_dir={tmp_path}"], timeout=120)
        assert (result.returncode, result.stderr) == (2, f"ddp-hpc: error: {refusal}\n"), result.stderr[-3000:]
        assert not list(tmp_path.iterdir())  # refused at the config check: no run folder
        return
    result = stack.run([stack.bin("torchrun"), "--standalone", "--nproc_per_node=2", "-m", "ddp_hpc", "train", *DIGITS,
                        "training.strategy=fsdp2", "training.epochs=1", f"logging.run_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "digits" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs_run_per_rank"] == [1, 1]
    assert (tmp_path / "digits" / "checkpoints" / "last.dcp").exists()  # fsdp2 saves sharded
