"""The ``ddp-hpc`` CLI run in forks of one interpreter that has imported it, and torch, once.

A case of the bad-input corpus is one CLI process that ends with one line: started afresh,
most of its time is the interpreter and ``import torch`` (2 s of CPU each on the 2-core CI
machine). Here a server process imports the CLI once; each call forks it, and the fork sets
its own environment, working folder, argv and stdout/stderr files, runs ``ddp_hpc.cli.main``
as the console script does (``sys.exit(main())``) and exits with its status: a real process,
its own signal dispositions and logging, ``os._exit`` and all. What a fresh interpreter adds
(import-time output, the console script itself) is checked by running some of the same cases
through the console script too (tests/test_bad_input.py).

    python tests/forked_cli.py    # the server: one JSON request per line on stdin
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence


class ForkedCli:
    """The client: ``run(argv, env, cwd)`` like ``conftest.run`` with the console script."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._files = Path(tempfile.mkdtemp(prefix="ddp-hpc-forked-cli-"))
        # The server's own environment is what torch and the CLI were imported under (the
        # same clean environment the console-script runs get, OMP_NUM_THREADS=1 among it).
        self._server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=dict(env), cwd=self._files)
        ready = self._server.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the forked-CLI server did not start (it said {ready!r})")
        self._calls = 0

    def run(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | Path,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        self._calls += 1
        out, err = self._files / f"{self._calls}.out", self._files / f"{self._calls}.err"
        request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd), "out": str(out), "err": str(err),
                   "timeout": timeout}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        reply = self._server.stdout.readline()
        if not reply:
            raise RuntimeError("the forked-CLI server ended")
        code = json.loads(reply)["returncode"]
        result = subprocess.CompletedProcess(["ddp-hpc", *argv], code, out.read_text(), err.read_text())
        out.unlink(), err.unlink()
        return result

    def close(self) -> None:
        self._server.stdin.close()
        self._server.wait(timeout=30)
        shutil.rmtree(self._files, ignore_errors=True)


#: Imported once by the server: what the corpus's commands import on their way to the error
#: (torch's optimizers import torch._dynamo).
PRELOADED = ("torch", "torch._dynamo", "torch.distributed.checkpoint", "ddp_hpc.cli", "ddp_hpc.training.run_on_rank",
             "ddp_hpc.training.trainer")


def _serve() -> None:
    import importlib

    for module in PRELOADED:
        try:
            importlib.import_module(module)
        except ImportError:  # an optional extra that is not installed: the fork imports nothing more
            pass

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)  # never returns
        print(json.dumps({"returncode": _wait(pid, request["timeout"])}), flush=True)


def _wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)  # -N for a signal, as subprocess says
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def _child(request: dict) -> None:
    code = 1
    try:
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((stdin, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        # As the console script under PYTHONUNBUFFERED=1 (clean_env): written through at once.
        sys.stdin = open(0, closefd=False)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      errors="backslashreplace")
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        console_script = Path(sys.executable).parent / "ddp-hpc"
        sys.argv = [str(console_script), *request["argv"]]
        sys.path[0] = str(console_script.parent)  # the script's folder, not tests/
        from ddp_hpc.cli import main

        try:
            code = main(request["argv"])
        except SystemExit as stop:  # what the interpreter does with it at exit
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
    finally:
        try:  # what the interpreter does at exit (train ends itself with os._exit, as it does there)
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    _serve()
