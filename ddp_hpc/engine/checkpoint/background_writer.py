"""Asynchronous checkpoints (``checkpoint.async: true``): training waits for a copy only.

Rank 0 copies the checkpoint state to host memory (the *snapshot*: the only time training
is blocked), then one background thread writes the same single-file ``torch.save`` file
that a synchronous save writes, through the same atomic path
(:func:`ddp_hpc.engine.checkpoint.files.write_checkpoint`): a hidden temporary file, fsync,
rename, then ``last.pt``/``best.pt`` re-pointed, then pruning. So every guarantee of the
synchronous path holds: a kill during the background write leaves the previous
checkpoint as the newest readable one, and ``last.pt`` only ever names a complete file.

At most one write is in flight: the next checkpoint first waits for the previous write,
then refills the previous snapshot's host tensors in place (one copy of the checkpoint
state stays allocated in rank 0's host memory, as torch's own checkpoint staging does).
The Trainer has those host tensors allocated in the background after the first step
(``prestage``), so that even the first checkpoint's stall is a copy, not an allocation.
The Trainer waits for the last write before ``fit`` returns (or raises), so the process
does not exit with a write half done.

Why not ``torch.distributed.checkpoint.async_save``: it writes a *directory* of per-rank
shard files plus a ``.metadata`` file, loaded with ``dcp.load`` into a pre-built state
dict. ddp_hpc's checkpoints are single files loaded with ``torch.load(weights_only=True)``
(resume, ``last.pt``/``best.pt`` links, ``keep_last`` pruning, and users' own tools read
them), the state is replicated (DDP: rank 0 holds all of it), and DCP's async path also
needs a process group of its own for its collective planning. The part of it that fits,
staging into (pinned) host memory and writing from a thread, is what this module does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddp_hpc.engine.checkpoint.host_copy import allocate_like, snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteRecord:
    """One finished background write."""

    path: Path
    snapshot_s: float   # training was blocked this long (the copy to host memory)
    write_s: float      # the background write took this long


@dataclass(frozen=True)
class SubmitTiming:
    """Where the training thread's time went in one ``submit``."""

    waited_s: float     # for the previous write to finish (checkpoints faster than writes)
    snapshot_s: float   # copying the state to host memory


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed; raised on the training thread at the next wait."""


class AsyncCheckpointWriter:
    """One background writer thread at a time; ``wait`` joins it and re-raises its error."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._finished: list[WriteRecord] = []
        self._path: Path | None = None
        self._host_buffers: dict[tuple, torch.Tensor] = {}  # reused snapshot tensors
        self._staged = False
        #: The last ``submit``'s timing (the benchmark reports it).
        self.last_submit: SubmitTiming | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def staged(self) -> bool:
        """Whether host buffers were asked for (``prestage``) or made by a snapshot."""
        return self._staged or bool(self._host_buffers)

    def prestage(self, state: Mapping[str, Any]) -> None:
        """Allocate the host buffers for checkpoints of ``state``'s shape in the background
        (``state`` is only read for shapes and dtypes). The next ``submit`` waits for it."""
        if self._thread is not None or self.staged:
            return
        self._staged = True
        self._thread = threading.Thread(target=self._allocate, args=(dict(state),),
                                        name="ddp_hpc-checkpoint-staging")
        self._thread.start()

    def _allocate(self, state: dict[str, Any]) -> None:
        try:
            allocate_like(state, self._host_buffers)
        except Exception as exc:  # noqa: BLE001 - the first snapshot then allocates, as without it
            log.warning("could not allocate host memory for checkpoints ahead of time: %s: %s",
                        type(exc).__name__, exc)

    def submit(self, state: Mapping[str, Any], path: Path,
               write: Callable[[dict[str, Any]], Path]) -> list[WriteRecord]:
        """Wait for the previous write, snapshot ``state``, start ``write(snapshot)`` in the
        background. Returns the writes that finished since the last call."""
        started = time.perf_counter()
        finished = self.wait()
        copy_started = time.perf_counter()
        copied = snapshot(dict(state), self._host_buffers)
        snapshot_s = time.perf_counter() - copy_started
        self.last_submit = SubmitTiming(copy_started - started, snapshot_s)
        self._path = path
        self._thread = threading.Thread(target=self._run, args=(write, copied, snapshot_s),
                                        name="ddp_hpc-checkpoint-writer")
        self._thread.start()
        return finished

    def _run(self, write: Callable[[dict[str, Any]], Path], state: dict[str, Any], snapshot_s: float) -> None:
        started = time.perf_counter()
        try:
            written = write(state)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc
            return
        self._finished.append(WriteRecord(written, snapshot_s, time.perf_counter() - started))
        log.debug("background checkpoint write of %s done in %.3fs", written, time.perf_counter() - started)

    def wait(self) -> list[WriteRecord]:
        """Block until no write is in flight; the writes finished since the last call."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointWriteError(f"background write of checkpoint {self._path} failed: "
                                       f"{type(error).__name__}: {error}") from error
        finished, self._finished = self._finished, []
        return finished
