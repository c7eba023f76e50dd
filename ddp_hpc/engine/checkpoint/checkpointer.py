"""Checkpoints for any training loop: save a dict of objects at a cadence, restore the newest.

    checkpointer = Checkpointer("runs/mine", {"model": model, "optimizer": optimizer,
                                              "sampler": sampler}, every_n_steps=50)
    checkpointer.restore()          # the newest readable checkpoint, if any
    ...                             # after each optimizer step, on every rank:
    checkpointer.step_done()        # counts the step, saves at the cadence

The cadence is the Checkpointer's alone: ``every_n_steps`` and ``every_n_epochs``, applied
by ``step_done`` (or ``save_due``, for a loop whose step does more bookkeeping after the
count) and ``epoch_done``; a step that ends an epoch (``step_done(epoch_ends=True)``) has
its save put off to ``epoch_done``, so that the epoch's checkpoint holds its end (validation,
the next epoch's start) and is written once. ``StopAgreement`` saves a stop's checkpoint
through ``save_step``, under the same rule.

Each object is anything with ``state_dict()``/``load_state_dict()`` (model, optimizer, LR
scheduler, grad scaler, ``ResumableSampler``); ``extras`` is a dict of plain data the
checkpoint carries too. Every rank's RNG streams are saved and restored, so a resumed run
continues bit-identically. Where the files go and how they are written is the *format*:
``SingleFileFormat`` (one ``torch.save`` file that rank 0 writes, atomically, optionally
in the background, the newest ``keep_last`` kept; each rank's RNG in a small file of its
own; a sharded (FSDP2) model and its optimizer gathered whole into it, ``engine/sharding.py``)
or ``format="dcp"``: ``ShardedFormat``, a folder that every rank writes its part of,
in parallel (torch.distributed.checkpoint; the one for FSDP2 models too large to gather on
one rank); the formats are ``formats.py``. Others plug in through ``CheckpointFormat``. A sharded model whose root is not
sharded, or whose optimizer steps other tensors than its parameters, is refused in one line
(``RefusedOnRank``) when the Checkpointer is made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_hpc.contract import CHECKPOINTS_DIR
from ddp_hpc.engine import sharding
from ddp_hpc.engine.checkpoint import files as files
from ddp_hpc.engine.checkpoint.background_writer import WriteRecord
from ddp_hpc.engine.checkpoint.formats import (RESERVED, Accept, CheckpointFormat, Loaded, Upgrade,
                                               is_sharded_optimizer, make_format, sharded_owners, sharded_refusal,
                                               state_of)
from ddp_hpc.engine.group import Collectives, ProcessGroupView
from ddp_hpc.engine.rng import capture_rng, restore_rng
from ddp_hpc.engine.sampler import ResumableSampler
from ddp_hpc.errors import RefusedOnRank

log = logging.getLogger(__name__)

class Checkpointer:
    """Saves ``objects`` (and ``extras``) into ``folder``/checkpoints at a step cadence and
    restores the newest readable checkpoint. Every rank makes every call.

    An object may be None (an LR scheduler not in use): the checkpoint then holds None
    under its name, and restoring leaves it alone. ``on_written`` hears, on rank 0, of
    each checkpoint once it is complete (a background write: at the next save or
    ``wait``). A ``ResumableSampler`` among the objects puts its place in the epoch into
    the checkpoint's ``progress`` next to the step.
    """

    def __init__(self, folder: str | Path, objects: Mapping[str, Any], *, every_n_steps: int = 0,
                 every_n_epochs: int = 0, keep_last: int = 3, background: bool = False,
                 extras: dict[str, Any] | None = None, format: str | CheckpointFormat = "file",
                 group: Collectives | None = None, on_written: Callable[[WriteRecord], None] | None = None,
                 on_saving: Callable[[], None] | None = None) -> None:
        clash = sorted(set(objects) & {*RESERVED, "per_rank"})
        if clash:
            raise ValueError(f"Checkpointer: object name(s) {', '.join(clash)} are reserved")
        for name, obj in objects.items():
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"Checkpointer: {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict")
        if every_n_steps < 0 or every_n_epochs < 0 or keep_last < 1:
            raise ValueError(f"Checkpointer: every_n_steps={every_n_steps} and every_n_epochs={every_n_epochs} "
                             f"must be >= 0 and keep_last={keep_last} >= 1")
        self.directory = Path(folder) / CHECKPOINTS_DIR
        self.objects = dict(objects)
        self.extras: dict[str, Any] = extras if extras is not None else {}
        #: Plain data of this rank's own (its streams' base seed under InJobRecovery, say):
        #: saved in the rank's own part of each checkpoint beside its RNG streams, restored
        #: into this dict where the checkpoint has a part of this rank's.
        self.rank_extras: dict[str, Any] = {}
        #: Called with the step's batches by ``step_done`` once the step is counted and the
        #: samplers advanced, before the cadence's save (in-job recovery's part of a step).
        self.step_listeners: list[Callable[[int], None]] = []
        self.every_n_steps, self.every_n_epochs, self.keep_last = every_n_steps, every_n_epochs, keep_last
        self.format: CheckpointFormat = (make_format(format, background=background) if isinstance(format, str)
                                         else format)
        self.group: Collectives = group or ProcessGroupView.current()
        if (why := sharded_refusal(self.objects)) is not None:
            # The same on every rank, which exits 2. Its group ends first: left to the
            # interpreter's exit, a live gloo group's threads can abort the process (SIGABRT),
            # which reads as a lost rank.
            if dist.is_initialized():
                dist.destroy_process_group()
            raise RefusedOnRank(f"Checkpointer: {why}", self.group.rank)
        self.on_written = on_written
        #: Called on every rank before a save begins (a loop's watchdog beat, say).
        self.on_saving = on_saving
        #: True while ``save`` runs (a part that watches the optimizer's steps tells a save's from the loop's).
        self.saving = False
        #: Optimizer steps taken in all (restored by ``restore``).
        self.step = 0
        #: Seconds the latest save kept training waiting (the stop agreement's deadline uses it).
        self.last_save_s = 0.0
        #: The checkpoint ``restore`` loaded (its path and own data: progress, world size, ...).
        self.resumed: Loaded | None = None
        self._saved_step: int | None = None
        #: The step just counted ends an epoch: its save waits for ``epoch_done``.
        self._epoch_ends = False
        #: A save put off to ``epoch_done``: None, or whether it is to be waited for.
        self._owed: bool | None = None
        self._saved_path: Path | None = None
        self._sampler = next((obj for obj in self.objects.values() if isinstance(obj, ResumableSampler)), None)

    def restore(self, path: str | Path | None = None, *, accept: Accept | None = None,
                upgrade: Upgrade | None = None, quiet: bool = False) -> Path | None:
        """Load the newest readable checkpoint (or the one at ``path``) into the objects,
        the extras and this rank's RNG streams; the path it came from, or None (nothing
        saved yet: a fresh start). ``accept(path, data)`` may refuse it before anything is
        loaded (raise); ``upgrade(path, data)``, called before it, returns a checkpoint of
        an older layout in this one. ``quiet``: rank 0 logs no "resuming from" line (the
        caller logs its own)."""
        if path is None:
            if self.group.is_rank_zero:
                for name in files.remove_stale_temporaries(self.directory):
                    log.info("removed %s, left by a checkpoint write that was interrupted", name)
            self.group.barrier()  # no rank reads while rank 0 tidies
        loaded = self.format.restore(self.group, self.directory, self.objects,
                                     path=Path(path) if path is not None else None, accept=accept,
                                     upgrade=upgrade)
        if loaded is None:
            return None
        state, mine = loaded.state, loaded.mine
        self.extras.update(state.get("extras") or {})
        self.step = self._saved_step = int(state["step"])
        self._saved_path = loaded.path
        self.resumed = loaded
        self.rank_extras.update(mine.get("rank_extras") or {})
        # A sharded model's buffers are each rank's own; the model state held one rank's.
        sharding.load_own_buffers(self.objects, mine.get("buffers") or {})
        if "rng" in mine:
            restore_rng(mine["rng"])
        elif self.group.is_rank_zero:
            log.warning("checkpoint %s was written by %s ranks, this run has %d: the RNG streams start afresh",
                        loaded.path, state.get("world_size"), self.group.world_size)
        if self.group.is_rank_zero and not quiet:
            log.info("resuming from %s (step %d)", loaded.path, self.step)
        return loaded.path

    def step_done(self, batches: int = 1, *, epoch_ends: bool = False, save: bool = True) -> Path | None:
        """After an optimizer step: count it (and ``batches`` batches for the samplers among
        the objects), then ``save_due``; the checkpoint's path, or None. ``epoch_ends``:
        this step is its epoch's last (its save waits for ``epoch_done``). ``save=False``:
        only count; the loop calls ``save_due`` once its own bookkeeping of the step (state
        the checkpoint holds) is done. The ``step_listeners`` are called between the count
        and the save."""
        self.step += 1
        self._epoch_ends = epoch_ends
        for obj in self.objects.values():
            advance = getattr(obj, "advance", None)
            if callable(advance):
                advance(batches)
        for listener in self.step_listeners:
            listener(batches)
        return self.save_due() if save else None

    def save_due(self) -> Path | None:
        """The step cadence: save this step if ``every_n_steps`` divides it (see ``save_step``)."""
        if self.every_n_steps and self.step % self.every_n_steps == 0:
            return self.save_step()
        return None

    def save_step(self, *, wait: bool = False) -> Path | None:
        """This step's checkpoint: saved now, or, when the step ends an epoch, by
        ``epoch_done`` (the path then; None now). ``wait`` as in ``save``."""
        if self._epoch_ends:
            self._owed = bool(self._owed) or wait
            return None
        return self.save(wait=wait)

    def epoch_done(self, epoch: int, *, save: bool = False, best: bool = False) -> Path | None:
        """At the end of epoch ``epoch`` (counted from 1), once its own work (validation,
        the next epoch's start) is in the objects: save if the epoch cadence
        (``every_n_epochs``) asks for it, a save of its last step was put off to here,
        ``save`` (training ends here, say) or ``best`` (see ``save``); the path, or None."""
        owed, self._owed, self._epoch_ends = self._owed, None, False
        due = (owed is not None or save or best
               or bool(self.every_n_epochs and epoch % self.every_n_epochs == 0))
        return self.save(wait=bool(owed), best=best) if due else None

    def progress(self) -> dict[str, int]:
        """Where training stands: the step, and the sampler's place in the epoch if there is one."""
        return {**(self._sampler.progress() if self._sampler is not None else {}), "global_step": self.step}

    def bookkeeping(self) -> dict[str, Any]:
        """Where this Checkpointer stands, as plain data (in-job recovery hands it to a
        replacement with ``continue_from``): the step, the step saved last and its path, the extras."""
        return {"step": self.step, "saved_step": self._saved_step,
                "saved_path": str(self._saved_path) if self._saved_path is not None else None,
                "extras": dict(self.extras)}

    def continue_from(self, bookkeeping: Mapping[str, Any]) -> None:
        """Stand where ``bookkeeping`` (another rank's) says, with the objects loaded as they
        were there: every rank then saves at the same steps (a save is a collective)."""
        self.step = int(bookkeeping["step"])
        self._saved_step = bookkeeping["saved_step"]
        self._saved_path = Path(bookkeeping["saved_path"]) if bookkeeping["saved_path"] is not None else None
        self.extras.clear()
        self.extras.update(bookkeeping["extras"])
        self._epoch_ends, self._owed = False, None  # the step is done again, and says so again

    def save(self, *, wait: bool = False, best: bool = False) -> Path:
        """Save now (unless this step is saved already). In the background, training waits
        only for the previous write and a copy to host memory; ``wait``: return once the
        file is on disk (see ``wait``). ``best``: also point ``best.pt`` at it."""
        if self._saved_step == self.step and self._saved_path is not None:
            if wait:
                self.wait()
            return self._saved_path
        if self.on_saving is not None:
            self.on_saving()
        started = time.perf_counter()
        shared = {"format": files.FORMAT_VERSION, "step": self.step, "extras": dict(self.extras),
                  "progress": self.progress()}
        self.saving = True
        try:
            self._saved_path = self.format.save(self.group, self.directory, self.step, self.objects, shared,
                                                {"rng": capture_rng(), "rank_extras": dict(self.rank_extras),
                                                 "buffers": sharding.own_buffers(self.objects)},
                                                keep_last=self.keep_last, best=best)
        finally:
            self.saving = False
        self._saved_step = self.step
        self.last_save_s = time.perf_counter() - started
        self._report(self.format.finished())
        if wait:
            self.wait()
        return self._saved_path

    def prestage(self, names: Iterable[str] | None = None) -> None:
        """Ahead of the first background save (after the first step, once the optimizer has
        state): let the format allocate what saves of this shape need, in the background.
        ``names``: the objects worth it (default: all). ZeRO's sharded optimizer state,
        which needs a collective to gather, is left out."""
        chosen = self.objects if names is None else {name: self.objects.get(name) for name in names}
        gathered = sharded_owners(self.objects)
        states = {name: state_of(obj) for name, obj in chosen.items()
                  if obj is not None and not is_sharded_optimizer(obj) and name not in gathered}
        self.format.prestage(self.group, states)

    def wait(self, *, together: bool = True) -> None:
        """Block until the last checkpoint is on disk on every rank's behalf (a background
        write finished); call it before the process exits. ``together``: then wait for
        every rank (a barrier); not on an error path, where another rank may be gone."""
        started = time.perf_counter()
        self._report(self.format.wait())
        if together:
            self.group.barrier()
        self.last_save_s = max(self.last_save_s, time.perf_counter() - started)

    def _report(self, records: list[WriteRecord]) -> None:
        for record in records:
            log.debug("checkpoint %s written in %.3fs (training blocked %.3fs)", record.path, record.write_s,
                      record.snapshot_s)
            if self.on_written is not None:
                self.on_written(record)
