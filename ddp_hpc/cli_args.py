"""What every verb's parser shares: the parser that reports a bad argument in one line,
argument types, the device and console flags, one write per output line. Each verb's
parser lives beside its code (``bench/verb.py``, ``launch/verb.py``, ``staging/verb.py``,
``schedulers/cluster/verbs.py``); ``cli.py`` puts them together."""

from __future__ import annotations

import argparse
from typing import NoReturn

from ddp_hpc.contract import BACKEND_VAR, CONSOLE_RANKS_VAR, DEVICE_VAR, HOST_SUFFIX_VAR, ExitStatus


def write_line(stream, text: str) -> None:
    """One write per line: several ranks share the launcher's output, and print() under
    unbuffered output writes the newline separately, so lines of two ranks could merge."""
    stream.write(text + "\n")
    stream.flush()


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitStatus.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def add_device_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("device and backend")
    group.add_argument("--device", help=f"auto, xpu, cuda or cpu (default: ${DEVICE_VAR}, else auto)")
    group.add_argument("--backend", help=f"auto, nccl, xccl, ccl or gloo (default: ${BACKEND_VAR}, else auto)")
    group.add_argument("--host-suffix", default=None,
                       help="suffix for rank 0's host name, e.g. a high-speed network's (default: "
                            f"${HOST_SUFFIX_VAR})")


def add_console_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--console-ranks", default=None, metavar="RANKS",
                        help="ranks whose INFO lines reach the console: 0 (default), 0,3, 0-3, all or none; "
                             f"every rank's warnings and errors always do (default: ${CONSOLE_RANKS_VAR})")
