"""Per-rank log files in the run folder and the console filter (ddp_hpc.logs): the filter's
syntax and handler levels in-process, and one real MPICH launch with ``--console-ranks 1``
(the per-rank files under torchrun: tests/test_consistency.py)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from conftest import REPO, ddp_hpc_command, run
from ddp_hpc.contract import CONSOLE_RANKS_VAR
from ddp_hpc.errors import UserError
from ddp_hpc.logs import ConsoleFilter, configure_logging, rank_log_path


def test_console_filter_syntax():
    assert ConsoleFilter.parse("0-2,5").ranks == frozenset({0, 1, 2, 5})
    assert ConsoleFilter.parse("all").shows_all(7) and not ConsoleFilter.parse("none").shows_all(0)
    assert ConsoleFilter.from_environment(None, {}) == ConsoleFilter(frozenset({0}))
    assert ConsoleFilter.from_environment(None, {CONSOLE_RANKS_VAR: "3"}).ranks == frozenset({3})
    assert ConsoleFilter.from_environment("1", {CONSOLE_RANKS_VAR: "3"}).ranks == frozenset({1})
    with pytest.raises(UserError, match=r"--console-ranks 'first': expected ranks like 0 or 0,3 or 0-3"):
        ConsoleFilter.parse("first")
    with pytest.raises(UserError, match=r"DDP_HPC_CONSOLE_RANKS '3-1'"):
        ConsoleFilter.from_environment(None, {CONSOLE_RANKS_VAR: "3-1"})


@pytest.fixture
def restore_ddp_hpc_logger():
    logger = logging.getLogger("ddp_hpc")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for handler in logger.handlers:
        if handler not in saved[0]:
            handler.close()
    logger.handlers[:], logger.level, logger.propagate = saved


def test_a_filtered_rank_logs_everything_to_its_file_and_warnings_to_the_console(tmp_path, capsys,
                                                                                 restore_ddp_hpc_logger):
    path = rank_log_path(tmp_path / "run", 3)
    assert path == tmp_path / "run" / "logs" / "rank-00003.log"
    configure_logging(3, log_file=path)
    assert not path.exists(), "the file appears with the first line, not before"
    log = logging.getLogger("ddp_hpc.test")
    log.info("an info line")
    log.warning("a warning")
    console = capsys.readouterr().err
    assert "an info line" not in console and "[rank 3] WARNING ddp_hpc.test: a warning" in console
    text = path.read_text()
    assert "[rank 3] INFO ddp_hpc.test: an info line" in text and "[rank 3] WARNING" in text
    configure_logging(3, console=ConsoleFilter.parse("all"), log_file=path)  # again: appends, replaces handlers
    log.info("second")
    assert "second" in capsys.readouterr().err
    assert path.read_text().count("\n") == 3


@pytest.mark.mpi
@pytest.mark.multiproc
def test_console_shows_the_chosen_rank_and_every_rank_writes_its_file_under_mpich(tmp_path, mpich):
    result = run([mpich, "-n", "2", *ddp_hpc_command(), "train", str(REPO / "configs" / "synthetic.yaml"),
                  "job.params.samples=256", "job.params.val_samples=0", "training.epochs=1",
                  "logging.progress=never", "logging.plot=false", f"logging.run_dir={tmp_path}", "logging.name=r",
                  "--console-ranks", "1"],
                 timeout=180)
    assert result.returncode == 0, result.stderr
    assert re.search(r"\[rank 1\] INFO ddp_hpc\.training\.run_on_rank: rank 1 of 2 on host", result.stderr), result.stderr
    assert not re.search(r"\[rank 0\] INFO", result.stderr), result.stderr
    for rank in (0, 1):
        text = rank_log_path(Path(tmp_path) / "r", rank).read_text()
        assert re.search(rf"\[rank {rank}\] INFO ddp_hpc\.training\.run_on_rank: rank {rank} of 2 on host", text), text
        assert f"[rank {1 - rank}]" not in text
    # Rank 0's own lines (the start and the epoch lines) are in its file, not on the console.
    assert "epoch 1/1" in rank_log_path(Path(tmp_path) / "r", 0).read_text()
