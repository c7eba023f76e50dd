"""Logging with the rank in every line's prefix: a console filter, and one file per rank.

Only the program that owns the process configures logging (the CLI, or ``train`` when the
CLI asks it to with ``TrainOptions.configure_logs``); library code only logs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ddp_hpc.contract import CONSOLE_RANKS_VAR, RANK_LOG_DIR
from ddp_hpc.errors import UserError

_FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
_HANDLER_NAME = "ddp_hpc"
_FILE_HANDLER_NAME = "ddp_hpc.rank_file"


def rank_log_path(run_folder: Path, rank: int) -> Path:
    """``RUN/logs/rank-00003.log``: every log line of rank 3 (INFO and above, DEBUG with -v)."""
    return run_folder / RANK_LOG_DIR / f"rank-{rank:05d}.log"


class _RankFileHandler(logging.FileHandler):
    """Appends (a restart adds to the same file); the folder and file appear with the first
    line, so a run that stops on bad input before logging anything leaves nothing behind."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, mode="a", encoding="utf-8", delay=True)

    def _open(self) -> TextIO:
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


@dataclass(frozen=True)
class ConsoleFilter:
    """The ranks whose INFO lines reach the console (None: all); every rank's warnings and
    errors always do. Like torchrun's ``--local-ranks-filter``, but over global ranks and
    without hiding anyone's errors."""

    ranks: frozenset[int] | None = frozenset({0})

    @classmethod
    def parse(cls, text: str, what: str = "--console-ranks") -> ConsoleFilter:
        """``0`` (the default), ``0,3,5``, ``0-3``, ``all``, or ``none`` (warnings only)."""
        value = text.strip().lower()
        if value == "all":
            return cls(None)
        if value == "none":
            return cls(frozenset())
        ranks: set[int] = set()
        try:
            for part in value.split(","):
                first, _, last = part.strip().partition("-")
                low, high = int(first), int(last) if last else int(first)
                if low < 0 or high < low:
                    raise ValueError
                ranks.update(range(low, high + 1))
        except ValueError:
            raise UserError(f"{what} {text!r}: expected ranks like 0 or 0,3 or 0-3, 'all' or 'none'") \
                from None
        return cls(frozenset(ranks))

    @classmethod
    def from_environment(cls, flag: str | None, environ: Mapping[str, str]) -> ConsoleFilter:
        """The flag, else ``$DDP_HPC_CONSOLE_RANKS``, else rank 0."""
        if flag is not None:
            return cls.parse(flag)
        if environ.get(CONSOLE_RANKS_VAR, "").strip():
            return cls.parse(environ[CONSOLE_RANKS_VAR], CONSOLE_RANKS_VAR)
        return cls()

    def shows_all(self, rank: int | None) -> bool:
        return rank is None or self.ranks is None or rank in self.ranks


def configure_logging(rank: int | None, *, verbose: bool = False, console: ConsoleFilter = ConsoleFilter(),
                      log_file: Path | None = None) -> None:
    """Send ``ddp_hpc`` logs to stderr as ``[rank N]`` lines, and to ``log_file`` if given.

    On the console, the ranks of ``console`` (rank 0 by default) log at INFO (DEBUG with
    ``verbose``) and every other rank at WARNING, so a job's output reads like one
    process's while every rank's warnings still show with their rank. The file gets all of
    this rank's lines. Called again (once the rank or the run folder is known), it replaces
    its own handlers.
    """
    logger = logging.getLogger("ddp_hpc")
    for handler in [h for h in logger.handlers if h.get_name() in (_HANDLER_NAME, _FILE_HANDLER_NAME)]:
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(_FORMAT.format(rank="?" if rank is None else rank), datefmt="%H:%M:%S")
    detail = logging.DEBUG if verbose else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    handler.setLevel(detail if console.shows_all(rank) else logging.WARNING)
    logger.addHandler(handler)
    if log_file is not None:
        to_file = _RankFileHandler(log_file)
        to_file.set_name(_FILE_HANDLER_NAME)
        to_file.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), datefmt="%Y-%m-%d %H:%M:%S"))
        to_file.setLevel(detail)
        logger.addHandler(to_file)
    logger.propagate = False
    # Without a file, ranks that show only warnings need not format INFO lines at all.
    logger.setLevel(detail if log_file is not None or console.shows_all(rank) else logging.WARNING)
