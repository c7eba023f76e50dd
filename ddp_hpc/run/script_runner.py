"""Run a Python script, module or ``-c`` code as the interpreter would, then end the
process group in order: what ``ddp-hpc run`` execs for a Python command.

``ddp-hpc run -- python [OPTIONS] train.py ARGS`` becomes
``python [OPTIONS] /path/to/script_runner.py file train.py ARGS`` (``module NAME`` for
``-m NAME``, ``code TEXT`` for ``-c TEXT``), in the same process. This file is passed by
path to the user's own interpreter, which need not have ddp_hpc installed: it imports only
the standard library, and torch only if the script already did.

The script sees what the interpreter gives it: ``__name__ == "__main__"``, ``sys.argv``,
``sys.path[0]``, ``__file__``, its own tracebacks, warnings and exit statuses (the way
coverage.py and pdb run a script). Afterwards, as Python would, the non-daemon threads are
joined and the ``atexit`` functions run; then, if the script left torch.distributed
initialized (the Hugging Face Trainer does), ``gc.collect()`` finalizes any
DistributedDataParallel while the group lives and ``destroy_process_group()`` ends it;
stdout and stderr are flushed, and the interpreter exits with the script's status,
finalizing as usual (open files flushed, ``__del__`` run). A group left to the
interpreter's finalization instead can abort it now and then, when gloo's threads free
work that holds Python objects ("terminate called without an active exception", exit
134). ddp_hpc.startup.distributed's ``end_process_group`` is the same teardown for code that
imports ddp_hpc.

A script that ends with an uncaught exception (KeyboardInterrupt included) is left to the
interpreter after its traceback, as without this runner: a failing rank's peers may still
be inside a collective with it, and ending the group could wait for them. An exception
whose class says it is reported in one line (``one_line_status``: in-job recovery's
``RecoveryError``, the fall-back to a restart in place working, not a crash) prints that
line instead of its traceback and exits with that status, unless the variable its class
names (``one_line_unless``) is set to anything but 0.

Keep this file importable by any Python 3.8+ and free of imports outside the standard
library at module level.
"""

from __future__ import annotations

import sys

import os  # (already loaded by the interpreter's start-up)

#: This file's folder, which the interpreter put first on sys.path (unless -P or -I):
#: nothing may be imported from there, and the script's own folder takes its place.
_OWN_FOLDER = os.path.dirname(os.path.realpath(__file__))

#: The interpreter gives __main__ an empty __annotations__ up to Python 3.13.
_MAIN_HAS_ANNOTATIONS = "__annotations__" in globals()

MODES = ("file", "module", "code")


def _absolute(path: str) -> str:
    """The script's path as the interpreter keeps it: since Python 3.9 joined to the
    working folder if relative, but not normalized (``/w/../x.py`` stays so)."""
    if sys.version_info < (3, 9) or os.path.isabs(path):
        return path
    return os.path.join(os.getcwd(), path)


def _is_runnable_location(path: str) -> bool:
    """A folder or zip file, which the interpreter runs through its ``__main__`` module."""
    import zipfile

    return os.path.isdir(path) or (os.path.isfile(path) and zipfile.is_zipfile(path))


def _script_path0(mode: str, target: str) -> str:
    """What the interpreter would have put first on sys.path for this script."""
    if mode == "file":
        if _is_runnable_location(target):
            return _absolute(target)
        return os.path.dirname(os.path.realpath(target))
    if mode == "module":
        return os.getcwd()
    return ""


def _set_path0(mode: str, target: str) -> None:
    if sys.path and sys.path[0] == _OWN_FOLDER:  # not under -P or -I, which prepend nothing
        sys.path[0] = _script_path0(mode, target)


def _fresh_main():
    """A ``__main__`` module as the interpreter creates it, in place of this runner's."""
    import types
    from importlib.machinery import BuiltinImporter

    main = types.ModuleType("__main__")
    main.__dict__.update({"__builtins__": sys.modules["builtins"], "__loader__": BuiltinImporter})
    if _MAIN_HAS_ANNOTATIONS:
        main.__dict__["__annotations__"] = {}
    sys.modules["__main__"] = main
    return main


def _run_file(path: str, args: list[str]) -> None:
    from importlib.machinery import SourceFileLoader

    sys.argv[:] = [path, *args]  # as typed; __file__ is absolute
    absolute = _absolute(path)
    if _is_runnable_location(absolute):
        import runpy

        _fresh_main()
        runpy._run_module_as_main("__main__", alter_argv=False)  # as the interpreter does
        return
    try:
        with open(absolute, "rb") as source:
            text = source.read()
    except OSError as exc:
        program = getattr(sys, "orig_argv", [sys.executable])[0]
        sys.stderr.write(f"{program}: can't open file {absolute!r}: [Errno {exc.errno}] {exc.strerror}\n")
        raise SystemExit(2) from None
    main = _fresh_main()
    loader = SourceFileLoader("__main__", absolute)
    main.__dict__.update({"__file__": absolute, "__cached__": None, "__loader__": loader})
    exec(compile(text, absolute, "exec", dont_inherit=True), main.__dict__)


def _run_module(name: str, args: list[str]) -> None:
    import runpy

    # As ``python -m``: argv[0] is "-m" while the module is found, then its file.
    sys.argv[:] = ["-m", *args]
    _fresh_main()
    runpy._run_module_as_main(name, alter_argv=True)  # what the interpreter itself calls for -m


def _run_code(text: str, args: list[str]) -> None:
    sys.argv[:] = ["-c", *args]
    main = _fresh_main()
    exec(compile(text, "<string>", "exec", dont_inherit=True), main.__dict__)


RUNNERS = {"file": _run_file, "module": _run_module, "code": _run_code}


def _without_own_frames(tb):
    """The traceback from the script's first frame on, as the interpreter would print it."""
    own = os.path.normcase(os.path.abspath(__file__))
    while tb is not None and os.path.normcase(os.path.abspath(tb.tb_frame.f_code.co_filename)) == own:
        tb = tb.tb_next
    return tb


def _report_uncaught(exc: BaseException) -> None:
    """Print an uncaught exception as the interpreter does (``sys.excepthook``, ``sys.last_*``)."""
    tb = _without_own_frames(exc.__traceback__)
    exc = exc.with_traceback(tb)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_error:  # noqa: BLE001  (the interpreter reports both)
        hook_error.__context__ = None  # the interpreter calls the hook outside any handler
        sys.stderr.write("Error in sys.excepthook:\n")
        hook_tb = _without_own_frames(hook_error.__traceback__)
        sys.__excepthook__(type(hook_error), hook_error.with_traceback(hook_tb), hook_tb)
        sys.stderr.write("\nOriginal exception was:\n")
        sys.__excepthook__(type(exc), exc, tb)


def _one_line_status(exc: BaseException):
    """The exit status of an exception reported in one line (see the module's docstring), or None."""
    status = getattr(type(exc), "one_line_status", None)
    unless = getattr(type(exc), "one_line_unless", None)
    if not isinstance(status, int) or isinstance(status, bool):
        return None
    if isinstance(unless, str) and os.environ.get(unless, "").strip() not in ("", "0"):
        return None
    return status


def _finish_as_python_would() -> None:
    """Join non-daemon threads, then run the atexit functions: the interpreter's first
    steps at exit, done here so that the process group outlives them."""
    import atexit

    threading = sys.modules.get("threading")
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()


def _group_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def end_process_group() -> None:
    """As ddp_hpc.startup.distributed.end_process_group: collect first, so that a
    DistributedDataParallel in a reference cycle is finalized while the group lives."""
    import gc

    dist = sys.modules["torch.distributed"]
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass  # closed or gone: nothing left to write


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in MODES:
        sys.stderr.write(f"usage: python {__file__} {{{','.join(MODES)}}} TARGET [ARGS...]\n")
        raise SystemExit(2)
    mode, target, args = argv[0], argv[1], list(argv[2:])
    _set_path0(mode, target)
    runner_pid = os.getpid()
    code: object = None
    try:
        RUNNERS[mode](target, args)
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt as exc:
        _report_uncaught(exc)
        # Re-raised for the interpreter, which finalizes and then kills itself with
        # SIGINT, as it does for a script's own KeyboardInterrupt; printed once.
        sys.excepthook = _already_reported
        raise
    except BaseException as exc:  # noqa: BLE001  (an uncaught exception: traceback, status 1)
        status = _one_line_status(exc)
        if status is not None:
            sys.stderr.write(f"{exc}\n")
            _flush_std_streams()
            raise SystemExit(status) from None
        _report_uncaught(exc)
        raise SystemExit(1) from None
    if os.getpid() != runner_pid:
        raise SystemExit(code)  # a child the script forked: the group is its parent's to end
    _finish_as_python_would()
    if not _group_initialized():
        raise SystemExit(code)
    try:
        end_process_group()
    except Exception as exc:  # noqa: BLE001  (the script's status stands)
        sys.stderr.write(f"ddp-hpc: warning: ending the process group failed: {exc!r}\n")
    _flush_std_streams()
    raise SystemExit(code)  # the interpreter finalizes as usual, with nothing of gloo's left


def _already_reported(*_: object) -> None:
    """sys.excepthook for an exception the runner has printed already."""


if __name__ == "__main__":
    main(sys.argv[1:])
