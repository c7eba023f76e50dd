"""Logging with the rank in every line's prefix."""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
_HANDLER_NAME = "ddp_hpc"


def configure_logging(rank: int | None, *, verbose: bool = False) -> None:
    """Send ``ddp_hpc`` logs to stderr as ``[rank N]`` lines.

    Rank 0 logs at INFO (DEBUG with ``verbose``); the other ranks at WARNING, so a job's
    output reads like one process's, while every rank's warnings still show with their
    rank. Called again (once the rank is known), it replaces its own handler.
    """
    logger = logging.getLogger("ddp_hpc")
    for handler in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank="?" if rank is None else rank),
                                           datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False
    if verbose:
        logger.setLevel(logging.DEBUG)
    else:
        logger.setLevel(logging.INFO if rank in (0, None) else logging.WARNING)
