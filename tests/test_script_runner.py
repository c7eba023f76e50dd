"""``ddp-hpc run -- python ...`` runs the script through ddp_hpc/run/script_runner.py: the
script sees what the interpreter alone would give it, and a process group it leaves to
interpreter exit is ended in order afterwards (issue 18: a finished script ends with 0)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, ddp_hpc_command, run
from ddp_hpc.environment.ports import free_port
from ddp_hpc.run.python_command import RUNNER, PythonCommand, parse_python_command, runner_argv

SCRIPTS = REPO / "tests" / "scripts"
PROBE = "../scripts/runner_probe.py"  # relative and not normalized, as users may type it
CODE = "from probe_pkg import report; report(globals())"

# ----- which commands are Python commands (pure) ------------------------------------------------


@pytest.mark.parametrize("argv,expected", [
    (["python", "train.py", "--lr", "3"], PythonCommand("python", (), "file", "train.py", ("--lr", "3"))),
    (["/opt/venv/bin/python3.11", "-u", "-W", "ignore", "-m", "pkg.mod", "-m", "x"],
     PythonCommand("/opt/venv/bin/python3.11", ("-u", "-W", "ignore"), "module", "pkg.mod", ("-m", "x"))),
    (["python3", "-mpkg", "a"], PythonCommand("python3", (), "module", "pkg", ("a",))),
    (["python", "-uc", "print(1)", "a"], PythonCommand("python", ("-u",), "code", "print(1)", ("a",))),
    (["python", "-Xdev", "-OO", "--check-hash-based-pycs", "never", "t.py"],
     PythonCommand("python", ("-Xdev", "-OO", "--check-hash-based-pycs", "never"), "file", "t.py", ())),
    (["python", "-Bu", "t.py", "-c", "x"], PythonCommand("python", ("-Bu",), "file", "t.py", ("-c", "x"))),
])
def test_python_commands_are_taken_apart_with_their_options_kept(argv, expected):
    assert parse_python_command(argv) == expected
    assert runner_argv(argv) == (expected.interpreter, *expected.options, str(RUNNER), expected.mode,
                                 expected.target, *expected.args)


@pytest.mark.parametrize("argv", [
    ["sh", "-c", "exit 7"], ["ipython", "t.py"], ["python"], ["python", "-i", "t.py"],
    ["python", "-x", "t.py"], ["python", "-"], ["python", "--version"], ["python", "-m"], ["python", "-W"],
    ["torchrun", "t.py"]])
def test_other_commands_are_exec_d_as_typed(argv):
    assert parse_python_command(argv) is None
    assert runner_argv(argv) == tuple(argv)


# ----- the script sees what the interpreter gives it ------------------------------------------


def _forms(action: list[str]) -> dict[str, list[str]]:
    return {"file": [sys.executable, PROBE, *action],
            "module": [sys.executable, "-m", "probe_pkg.mod", *action],
            "code": [sys.executable, "-c", CODE, *action]}


@pytest.mark.parametrize("form", ["file", "module", "code"])
@pytest.mark.parametrize("action", [["plain", "--lr", "3"], ["raise"], ["exit", "3"], ["exit", "stop now"],
                                    ["interrupt"]], ids=["argv", "raise", "exit-3", "exit-text", "interrupt"])
def test_the_script_sees_and_reports_exactly_what_python_gives_it(form, action):
    """Same stdout (__name__, __file__, sys.argv, sys.path[0], __spec__, ...), same stderr
    (tracebacks, sys.exit messages), same status (KeyboardInterrupt: killed by SIGINT)."""
    typed = _forms(action)[form]
    alone = run(typed, cwd=SCRIPTS)
    through = run(runner_argv(typed), cwd=SCRIPTS)
    assert (through.returncode, through.stdout, through.stderr) == (
        alone.returncode, alone.stdout, alone.stderr)
    seen = json.loads(through.stdout.splitlines()[0])
    assert seen["name"] == "__main__" and seen["main_is_this"]
    assert seen["argv"][1:] == action
    expected_status = {"raise": 1, "exit": 3 if action[1:] == ["3"] else 1, "interrupt": -2}.get(action[0], 0)
    assert through.returncode == expected_status


@pytest.mark.parametrize("target", ["missing.py", "broken.py", "folder", "bad_hook.py"])
def test_missing_scripts_syntax_errors_folders_and_failing_excepthooks_go_as_python_has_them(target, tmp_path):
    (tmp_path / "broken.py").write_text("def (\n")
    (tmp_path / "bad_hook.py").write_text("import sys\nsys.excepthook = lambda *a: 1 / 0\nraise ValueError(3)\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "__main__.py").write_text(
        "import sys\nprint(sys.argv, sys.path[0], __name__, __file__)\nsys.exit(4)\n")
    typed = [sys.executable, target, "a"]
    alone, through = run(typed, cwd=tmp_path), run(runner_argv(typed), cwd=tmp_path)
    assert (through.returncode, through.stdout, through.stderr) == (
        alone.returncode, alone.stdout, alone.stderr)
    assert through.returncode == {"missing.py": 2, "broken.py": 1, "folder": 4, "bad_hook.py": 1}[target]


def test_interpreter_options_still_apply_to_the_script():
    typed = [sys.executable, "-W", "error::DeprecationWarning", PROBE, "warn"]
    alone, through = run(typed, cwd=SCRIPTS), run(runner_argv(typed), cwd=SCRIPTS)
    assert through.returncode == alone.returncode == 1
    assert through.stderr == alone.stderr and "DeprecationWarning: deprecated in the probe" in through.stderr


# ----- the process group left by the script -----------------------------------------------------


def _one_rank_env() -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


@pytest.mark.parametrize("action,status", [(["exit", "3"], 3), (["raise"], 1)], ids=["exit-3", "raise"])
def test_a_group_left_open_is_destroyed_after_threads_and_atexit_only_if_the_script_finished(action, status):
    script = [sys.executable, str(SCRIPTS / "leaves_group.py"), *action]
    result = run(runner_argv(script), env=_one_rank_env(), timeout=240)
    assert result.returncode == status, result.stderr[-3000:]
    events = [line for line in result.stdout.splitlines() if line]
    if action == ["raise"]:
        # A failed rank's peers may be inside a collective with it: no teardown that could wait.
        assert "destroy_process_group called" not in events
        frames = [line for line in result.stderr.splitlines() if 'File "' in line]
        assert "leaves_group.py" in frames[0] and "script_runner" not in result.stderr  # the script's own
        assert result.stderr.rstrip().endswith("RuntimeError: the script fails")
        return
    assert events == ["thread ended, group initialized=True", "atexit ran, group initialized=True",
                      "destroy_process_group called"]
    assert "terminate called" not in result.stderr


# ----- through ddp-hpc run -------------------------------------------------------------------------


def test_ddp_hpc_run_passes_module_argv_and_exit_status_through():
    result = run([*ddp_hpc_command(), "run", "--", "python", "-m", "probe_pkg.mod", "exit", "3", "--lr"],
                 cwd=SCRIPTS)
    assert result.returncode == 3, result.stderr
    seen = json.loads(result.stdout.splitlines()[0])
    assert seen["argv"] == [str(SCRIPTS / "probe_pkg" / "mod.py"), "exit", "3", "--lr"]
    assert seen["name"] == "__main__" and seen["spec"] == "probe_pkg.mod" and seen["path0"] == str(SCRIPTS)
    assert result.stderr == ""


NO_DESTROY = str(SCRIPTS / "ddp_no_destroy.py")


@pytest.mark.mpi
@pytest.mark.multiproc
@pytest.mark.slow
def test_mpich_ranks_that_never_destroy_the_group_end_with_0_and_a_raising_rank_fails(mpich, tmp_path):
    """The 30-run figure is benchmarks/exit_statuses.py's; here one run of each."""
    launch = [mpich, "-n", "2", *ddp_hpc_command(), "run", "--", "python", NO_DESTROY]
    finished = run(launch, env={"NO_DESTROY_STEPS": "5"}, timeout=240, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert sorted(finished.stdout.splitlines()) == ["rank 0 trained 5 steps", "rank 1 trained 5 steps"]
    failed = run(launch, env={"NO_DESTROY_STEPS": "5", "NO_DESTROY_RAISE_ON_RANK": "1"}, timeout=240,
                 cwd=tmp_path)
    # Rank 0 was left inside an all-reduce: it fails too once rank 1 is gone; the job ends.
    assert failed.returncode != 0
    assert "RuntimeError: rank 1 fails on purpose at step 2" in failed.stderr
    assert "trained" not in failed.stdout


def test_in_job_recovery_given_up_is_one_line_and_status_1_and_its_traceback_only_when_debugging(tmp_path):
    """A ``RecoveryError`` that escapes the user's script (the launch gave up in-job recovery:
    the fall-back to a restart in place working) is reported in one line, status 1, no
    traceback (issue 44: 15-20 lines on every survivor); ``DDP_HPC_DEBUG=1`` shows it."""
    (tmp_path / "given_up.py").write_text(
        "from ddp_hpc.engine.recovery.errors import RecoveryError\n\n"
        "def train():\n    raise RecoveryError('rank 2: the launch gave up in-job recovery after losing rank 1')\n\n"
        "train()\n")
    typed = [sys.executable, "given_up.py"]
    through = run(runner_argv(typed), cwd=tmp_path)
    assert through.returncode == 1
    assert through.stderr == "rank 2: the launch gave up in-job recovery after losing rank 1\n"
    debugging = run(runner_argv(typed), cwd=tmp_path, env={"DDP_HPC_DEBUG": "1"})
    assert debugging.returncode == 1 and "Traceback" in debugging.stderr and "train()" in debugging.stderr
