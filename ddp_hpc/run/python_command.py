"""Recognise a Python command line, so that ``ddp-hpc run`` can run it through
``script_runner.py`` (which ends the process group in order after the script).

Pure: no process is started and nothing is read but the argument list. A command this
does not understand (an interactive session, ``-i``, ``-x``, a script on stdin, an
unknown option) is left alone and exec'd as it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: ``python``, ``python3``, ``python3.12``, ``python3.13t`` (also a venv's ``.../bin/python``).
INTERPRETER_NAME = re.compile(r"python(\d+(\.\d+t?)?)?")
#: Interpreter options without a value, which stay in front of the runner.
FLAGS = frozenset("bBdEIOPqRsSuv")
#: Options whose value follows, glued (``-Wignore``) or as the next argument.
VALUED = frozenset("WX")
#: The long option the interpreter takes with a value; other long options are left alone.
LONG_VALUED = ("--check-hash-based-pycs",)
RUNNER = Path(__file__).with_name("script_runner.py")


@dataclass(frozen=True)
class PythonCommand:
    """``INTERPRETER [OPTIONS] (SCRIPT | -m MODULE | -c CODE) [ARGS...]``, taken apart."""

    interpreter: str
    #: Interpreter options as typed (``-u``, ``-W``, ``ignore``, ``-X``, ``dev``, ...).
    options: tuple[str, ...]
    #: ``file``, ``module`` or ``code``: script_runner.py's modes.
    mode: str
    target: str
    args: tuple[str, ...]

    def through_runner(self, runner: Path = RUNNER) -> tuple[str, ...]:
        """The same command, with the runner in the interpreter's hands."""
        return (self.interpreter, *self.options, str(runner), self.mode, self.target, *self.args)


def parse_python_command(argv: Sequence[str]) -> PythonCommand | None:
    """The Python command in ``argv``, or None where it is not one this runner can run."""
    if not argv or not INTERPRETER_NAME.fullmatch(Path(argv[0]).name):
        return None
    options: list[str] = []
    index = 1
    while index < len(argv):
        arg = argv[index]
        if arg in LONG_VALUED:
            if index + 1 >= len(argv):
                return None
            options += argv[index:index + 2]
            index += 2
            continue
        if not arg.startswith("-") or arg == "-" or arg.startswith("--"):
            break
        # A cluster of short options: flags, then at most one option that takes a value.
        for position, letter in enumerate(arg[1:], start=1):
            rest = arg[position + 1:]
            if letter in FLAGS:
                continue
            if letter in ("m", "c"):
                if rest:
                    value, after = rest, index + 1
                elif index + 1 < len(argv):
                    value, after = argv[index + 1], index + 2
                else:
                    return None
                if arg[:position] != "-":
                    options.append(arg[:position])
                return PythonCommand(argv[0], tuple(options), "module" if letter == "m" else "code", value,
                                     tuple(argv[after:]))
            if letter in VALUED:
                if not rest:
                    if index + 1 >= len(argv):
                        return None
                    options += [arg, argv[index + 1]]
                    index += 1
                else:
                    options.append(arg)
                break
            return None  # -i, -x, -h, -V and anything unknown: exec as typed
        else:
            options.append(arg)
        index += 1
    if index >= len(argv) or argv[index] == "-" or argv[index].startswith("--"):
        return None  # no script (an interactive session), stdin, or --help/--version/--
    return PythonCommand(argv[0], tuple(options), "file", argv[index], tuple(argv[index + 1:]))


def runner_argv(command: Sequence[str]) -> tuple[str, ...]:
    """What ``ddp-hpc run`` execs: a Python command through the runner, anything else as is."""
    python = parse_python_command(command)
    return python.through_runner() if python else tuple(command)
