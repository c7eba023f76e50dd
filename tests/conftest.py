"""Shared helpers for tests that start real processes (torchrun, mpiexec, srun)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

import leftovers

REPO = Path(__file__).resolve().parent.parent
#: Set by scripts/test.sh where it installed everything: a missing tool then fails the
#: test instead of skipping it, so CI cannot pass by skipping.
REQUIRE_ALL = os.environ.get("DDP_HPC_REQUIRE_ALL") == "1"
LAUNCHER_PREFIXES = ("OMPI_", "PMI", "PMIX_", "MPI_LOCAL", "SLURM_", "PALS_", "MV2_", "TORCHELASTIC",
                     "PBS_", "HYDRA_")
LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "DDP_HPC_DEVICE", "DDP_HPC_BACKEND", "DDP_HPC_HOST_SUFFIX"}


def need(condition: bool, reason: str) -> None:
    """Skip with ``reason`` unless the tool is required here, then fail."""
    if condition:
        return
    if REQUIRE_ALL:
        pytest.fail(f"required by DDP_HPC_REQUIRE_ALL=1 but missing: {reason}")
    pytest.skip(reason)


def require_module(name: str, extra: str = "test"):
    """Import ``name``; where it is missing, skip (or, under DDP_HPC_REQUIRE_ALL=1, fail) naming
    the extra that installs it. pytest.importorskip would skip even where CI requires it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as error:
        need(False, f"{name} is not installed ({error}): pip install -e '.[{extra}]'")


def ddp_hpc_command() -> list[str]:
    """The ``ddp-hpc`` console script of the interpreter running the tests."""
    script = Path(sys.executable).parent / "ddp-hpc"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ddp_hpc"]


#: ``submit --wait`` for jobs that are never requeued: the end must be seen on 3 polls in a
#: row (schedulers.wait), 4-6 s after it at the default 2 s, 1-1.5 s at 0.5 s. Requeued jobs
#: keep the default: its 3 polls span the moment a requeue looks like an end.
FAST_WAIT = ("--wait", "--poll", "0.5")


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without any launcher's variables, so tests behave the same anywhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    env.update(extra or {})
    return env


def run(args: Sequence[str], *, timeout: float = 120, env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          env=clean_env(env), cwd=cwd or REPO)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder that ``build`` fills once per test run, shared by every xdist worker: a
    module's reference run is used by its SLURM-cluster tests on one worker and by its other
    tests on another, and would otherwise run on each. The first worker builds it under a
    lock; the others wait for it, then read it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, holding each worker's popen-gwN/
    folder = root / f"built-once-{name}"
    with open(root / f"built-once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / ".failed").exists():  # one failure is enough: the waiting worker fails at once
            pytest.fail(f"building {name} failed on another worker: {(folder / '.failed').read_text()}")
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                build(folder)
            except BaseException as failure:
                (folder / ".failed").write_text(str(failure).splitlines()[0] if str(failure) else repr(failure))
                raise
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def forked_cli():
    """``ddp-hpc`` in forks of one interpreter that imported it and torch (tests/forked_cli.py):
    for the many one-line refusals, a fraction of a second each instead of 2-3 s."""
    from forked_cli import ForkedCli

    cli = ForkedCli(clean_env())
    yield cli
    cli.close()


@pytest.fixture
def openmpi() -> str:
    program = shutil.which("mpiexec.openmpi")
    need(program is not None, "Open MPI is not installed (apt-get install openmpi-bin)")
    return "mpiexec.openmpi"


@pytest.fixture
def mpich() -> str:
    program = shutil.which("mpiexec.mpich") or shutil.which("mpiexec.hydra")
    need(program is not None, "MPICH is not installed (apt-get install mpich)")
    return Path(program).name


# ----- test worlds shared between tests, and pytest-xdist -----------------------------------
# Under `pytest -n 2 --dist loadgroup` (.ci/run) tests run on two workers at once. The SLURM
# test cluster (2 nodes, also behind qsub and submitit), the multihost world (h1, h2) and the
# GPUs are one each: tests that use one are put in its xdist group, so one worker runs them one after
# the other and a 2-node job never waits behind another test's job or has its timing skewed.
SLURM_GROUP = "slurm-cluster"
MULTIHOST_GROUP = "multihost-world"
GPU_GROUP = "gpu-devices"  # the host's GPUs: a gpu2 test takes both
#: Launcher parameters of tests that pick their launcher at run time (request.getfixturevalue)
#: and reach the SLURM cluster through it.
CLUSTER_PARAMETERS = frozenset({"srun", "sbatch", "qsub", "submitit", "slurm_cluster"})


def _parameter_strings(item: pytest.Item) -> set[str]:
    callspec = getattr(item, "callspec", None)
    strings: set[str] = set()
    for value in (callspec.params.values() if callspec else ()):
        for part in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(part, str):
                strings.add(part)
    return strings


def shared_world_group(item: pytest.Item) -> str | None:
    """The xdist group of a test that uses a shared test world, from its markers, fixtures
    and launcher parameters; None for a test that uses neither."""
    if item.get_closest_marker("multihost"):
        return MULTIHOST_GROUP
    if item.get_closest_marker("gpu") or item.get_closest_marker("gpu2"):
        return GPU_GROUP
    if item.get_closest_marker("slurm") or {"slurm_cluster", "qsub"} & set(item.fixturenames) \
            or CLUSTER_PARAMETERS & _parameter_strings(item):
        return SLURM_GROUP
    return None


def stack_group(item: pytest.Item) -> str | None:
    """tests/test_stacks.py's launches on one torch version (the ``stack`` fixture's
    parameter) stay on one worker: they share that version's reference run. The two
    versions run side by side on the two workers, its srun test in the SLURM group."""
    callspec = getattr(item, "callspec", None)
    version = callspec.params.get("stack") if callspec else None
    return f"torch-{version}" if item.get_closest_marker("stacks") and version else None


def module_fixture_group(item: pytest.Item) -> str | None:
    """Tests of one module that share a module-scoped fixture (a reference run, a built
    wheel) stay on one worker: split over two, each worker would build it again, at once
    (the wheel in the same build folder of the repository)."""
    definitions = getattr(item, "_fixtureinfo", None)
    for name in item.fixturenames:
        found = definitions.name2fixturedefs.get(name) if definitions else None
        if found and found[-1].scope == "module":
            return "module:" + item.nodeid.split("::")[0]
    return None


def pytest_itemcollected(item: pytest.Item) -> None:
    # Here, before any pytest_collection_modifyitems: xdist's worker reads the markers there.
    # A world's test that also uses a module fixture builds it once more on its own worker
    # (at most twice in all): cheaper than moving the fixture's other tests into the world's
    # group, which is the longest already.
    group = shared_world_group(item) or stack_group(item) or module_fixture_group(item)
    if group:
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _loadgroup(config):
        # The SLURM group is the longest unit of work: handed out first, it does not end last.
        items.sort(key=lambda item: _xdist_group(item) != SLURM_GROUP)


def _loadgroup(config: pytest.Config) -> bool:
    """Whether xdist schedules by group: on a worker xdist sets --dist to "no" and keeps
    the choice in its own option."""
    return config.getoption("loadgroup", False) or config.getoption("dist", "no") == "loadgroup"


def _xdist_group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return (marker.kwargs.get("name") or (marker.args[0] if marker.args else None)) if marker else None


SLURM_DOWN = "the SLURM test cluster is not running (scripts/dev-cluster.sh up, as root)"


@pytest.fixture(scope="session")
def slurm_cluster_up() -> bool:
    """Whether the cluster answers; module-scoped fixtures use this and need(..., SLURM_DOWN)."""
    return shutil.which("srun") is not None and subprocess.run(
        ["scontrol", "ping"], capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def slurm_cluster(request: pytest.FixtureRequest, slurm_cluster_up: bool) -> Iterator[None]:
    need(slurm_cluster_up, SLURM_DOWN)
    # A test that reaches the cluster without being grouped (a launcher parameter missing
    # from CLUSTER_PARAMETERS) would share it with another worker's test: fail it, here,
    # in serial runs too, rather than let it flake under xdist.
    if _xdist_group(request.node) != SLURM_GROUP:
        pytest.fail(f"{request.node.nodeid} uses the SLURM test cluster but is not in the "
                    f"{SLURM_GROUP!r} xdist group: add its launcher parameter to CLUSTER_PARAMETERS "
                    "or mark it @pytest.mark.slurm (tests/conftest.py)")
    # On an xdist worker under --dist loadgroup, xdist appends the group to the test's id
    # where it honoured the marker (it reads it after this conftest's collection hook).
    if os.environ.get("PYTEST_XDIST_WORKER") and _loadgroup(request.config):
        assert request.node.nodeid.endswith(f"@{SLURM_GROUP}"), \
            f"xdist did not schedule {request.node.nodeid} with its group {SLURM_GROUP!r}"
    yield
    left = _jobs_left_on_the_cluster()
    if left:
        # The cluster has no default time limit: a job left running (its srun killed at a
        # test's time-out, say) would hold a node for every later test. The test that left it
        # is named here, and its jobs cancelled so that the tests after it start clean.
        subprocess.run(["scancel", *left], capture_output=True, timeout=30)
        freed = _wait(lambda: not _queued(), 60)
        pytest.fail(f"{request.node.nodeid} left job(s) {', '.join(left)} on the SLURM test cluster: "
                    + ("cancelled" if freed else "cancelled, yet still there 60 s later"), pytrace=False)


def _jobs_left_on_the_cluster(grace_s: float = 30.0) -> list[str]:
    """The jobs still pending or running after grace_s: a job ending as its test returns may
    stay a few seconds (slurmctld has yet to hear of its end); one completing (CG: KillWait,
    the epilog) is on its way out and not counted."""
    _wait(lambda: all(state == "CG" for state in _queued().values()), grace_s)
    return [job for job, state in _queued().items() if state != "CG"]


def _queued() -> dict[str, str]:
    """The test cluster's jobs and their short states."""
    listed = subprocess.run(["squeue", "-h", "-o", "%i %t"], capture_output=True, text=True, timeout=30)
    return dict(line.split(maxsplit=1) for line in listed.stdout.splitlines() if line.strip())


def _wait(condition, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.fixture
def qsub(slurm_cluster) -> str:
    """Slurm's PBS wrapper (``qsub``) in front of the test cluster."""
    program = shutil.which("qsub")
    need(program is not None, "qsub is not on PATH (Slurm's PBS wrappers: apt-get install slurm-wlm-torque)")
    return program


def load_last_checkpoint(checkpoints: Path) -> dict:
    """The newest checkpoint in a run's checkpoints folder, either format, as one dict."""
    from ddp_hpc.engine.checkpoint.files import load_checkpoint
    from ddp_hpc.engine.checkpoint.dcp_read import read_whole

    pointer = checkpoints / "last.dcp"
    if pointer.exists():
        return read_whole(checkpoints / pointer.read_text().strip())
    return load_checkpoint(checkpoints / "last.pt")


def assert_same_training_state(expected: dict, actual: dict) -> None:
    """Two checkpoints hold the same progress and bit-identical model and optimizer state."""
    assert actual["progress"] == expected["progress"]
    assert_same_model_and_optimizer(expected, actual)


def assert_same_model_and_optimizer(expected: dict, actual: dict) -> None:
    """Two checkpoints hold bit-identical model weights and optimizer state."""
    import torch

    for key, value in expected["model"].items():
        assert torch.equal(value, actual["model"][key]), key
    for index, state in expected["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, actual["optimizer"]["state"][index][name]), (index, name)


#: What each test's call found running in this process's tree before it began.
_RUNNING_BEFORE = pytest.StashKey[dict]()


def pytest_sessionstart(session: pytest.Session) -> None:
    # Orphans (a rank whose wrapper died) come to this process, where the teardown finds them.
    leftovers.become_subreaper()
    # multiprocessing's resource tracker, which a test's spawned processes start once for the
    # whole session, is pytest's own: started here, it is not any one test's leftover.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    item.stash[_RUNNING_BEFORE] = leftovers.descendants()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    before = item.stash.get(_RUNNING_BEFORE, None)
    if before is None:  # the test never ran (a setup failed or it skipped)
        return
    # Passed, failed or timed out: nothing its call started outlives it.
    killed = leftovers.end_new(before)
    if killed:
        item.warn(pytest.PytestWarning(f"left {len(killed)} process(es) running after it, now killed: "
                                       f"{'; '.join(killed)}"))


#: Figures measured by reliability and scheduler tests, printed after the run.
FIGURES: list[str] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    # On an xdist worker: hand this worker's figures to the controller, which prints them.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["ddp_hpc_figures"] = list(FIGURES)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown where xdist is not installed
def pytest_testnodedown(node, error) -> None:
    FIGURES.extend(getattr(node, "workeroutput", {}).get("ddp_hpc_figures", []))


def pytest_terminal_summary(terminalreporter) -> None:
    if FIGURES:
        terminalreporter.section("measured figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _ddp_hpc_loggers_as_found():
    """The ``ddp_hpc`` loggers put back after each test: a verb run in-process configures the
    package's logger (a handler on the stream of that moment, ``propagate`` off), and a
    library's ``logging.config.dictConfig`` disables every logger that exists; the next test
    of the same worker would then log nowhere it captures (seen in CI: caplog and the
    captured stderr empty in tests that pass alone)."""
    import logging

    def package_loggers():
        return {name: one for name, one in logging.root.manager.loggerDict.items()
                if (name == "ddp_hpc" or name.startswith("ddp_hpc.")) and isinstance(one, logging.Logger)}

    saved = {name: (list(one.handlers), one.level, one.propagate, one.disabled)
             for name, one in package_loggers().items()}
    yield
    for name, one in package_loggers().items():
        handlers, level, propagate, disabled = saved.get(name, ([], logging.NOTSET, True, False))
        for handler in [h for h in one.handlers if h not in handlers]:
            one.removeHandler(handler)
        one.handlers[:] = handlers
        one.level, one.propagate, one.disabled = level, propagate, disabled
