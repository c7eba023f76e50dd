"""Run a loop script (argv[1], e.g. examples/resumable_loop.py) with a fault from the
environment, injected at the Checkpointer's per-step call, for tests/test_own_loop.py:

- FAULT_KILL_RANK + FAULT_AT_STEP: that rank SIGKILLs itself right after step N, once per
  FAULT_MARKER file (a restarted run goes through).
- FAULT_SIGNAL_AT_STEP: rank FAULT_SIGNAL_RANK (default 0) sends itself SIGUSR2 right after
  step N, once per FAULT_MARKER.
- Every rank prints what ``restore`` restored ("rank R: restored PATH at step N").
- RECORD_RESTORED=FOLDER: after a restore that loaded a checkpoint, every rank saves what
  its model and optimizer then hold to FOLDER/restored-W-R.pt (W: the world size).
- RECORD_IDS=FOLDER: every rank appends "epoch id" for each sample its sampler hands out
  (num_workers=0: fetched just before it is trained) to FOLDER/rank-R.txt.
- CHECKPOINT_FORMAT, CHECKPOINT_EVERY: the Checkpointer's ``format`` and ``every_n_steps``.
- FAULT_KILLS=N (with FAULT_SEED, FAULT_LOG): in each of the first N attempts of a launch
  with restarts (TORCHELASTIC_RESTART_COUNT), one rank SIGKILLs itself at a step drawn
  from FAULT_SEED: two kills in three land inside a dcp save, just after the first item of
  the rank's shard file is written and flushed (the file exists, partly written, and the
  checkpoint's metadata does not); the third right after a step. Each kill appends to
  FAULT_LOG what it saw: the shard's size, the same file's size in the newest complete
  checkpoint, whether metadata existed, and the newest complete step.
- FAULT_STEP_SLEEP=S: every step takes S seconds longer (a job that outlasts its walltime).
- FAULT_DEADLINE_MARGIN=S: the StopAgreement's margin before $DDP_HPC_DEADLINE (default 60 s,
  longer than a 1-minute test job).
- FAULT_SAVE_KILLS=K + FAULT_SAVE_KILL_LOG=FILE: checkpoints are saved in the background, and
  K times rank 0 SIGKILLs itself while the background writer is writing one: kill k (counted
  by FILE's lines) during the save of step 10 * (k + 2), after a random number of the file's
  bytes reached the checkpoint's temporary file. Each kill appends "STEP TEMPORARY WRITTEN
  SIZE" to FILE first. With FAULT_SAVE_KILL_SYNC=1 the saves stay synchronous and the kill
  lands in rank 0's training thread, in the middle of the write, while the other ranks wait
  for it in the next step's collective.
"""

from __future__ import annotations

import io
import json
import os
import random
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
from ddp_hpc.engine.sampler import ResumableSampler
from ddp_hpc.engine.stop_agreement import StopAgreement


def _once(marker: str) -> bool:
    try:
        Path(marker).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def _kill_logged(record: dict) -> None:
    from ddp_hpc.engine.checkpoint.dcp_read import newest_complete

    folder = Path(os.environ.get("RUN_DIR", "runs/resumable_loop")) / "checkpoints"
    found = newest_complete(folder, report=False)
    record["newest_complete_step"] = int(found[0].name.split("-")[1]) if found else None
    if found and "shard" in record:
        record["complete_shard_bytes"] = (found[0] / Path(record["shard"]).name).stat().st_size
    with open(os.environ["FAULT_LOG"], "a") as log:
        log.write(json.dumps(record) + "\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _inject_random_kills(kills: int, seed: int) -> None:
    import torch.distributed.checkpoint.filesystem as dcp_files

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= kills:
        return
    chooser = random.Random(seed * 1000 + attempt)
    plan = {"attempt": attempt, "rank": attempt % 2, "mode": "mid-write" if attempt % 3 != 2 else "after-step",
            "steps_ahead": chooser.randint(1, 3)}
    state: dict = {"target": None}
    real_restore, real_step_done = Checkpointer.restore, Checkpointer.step_done
    real_write_item = dcp_files._write_item

    def restore(self):
        path = real_restore(self)
        state["target"] = self.step + plan["steps_ahead"]
        state["checkpointer"] = self
        return path

    def step_done(self, batches: int = 1):
        path = real_step_done(self, batches)
        if plan["mode"] == "after-step" and dist.get_rank() == plan["rank"] and self.step == state["target"]:
            _kill_logged({**plan, "step": self.step})
        return path

    def write_item(transforms, stream, data, write_item, storage_key, *args, **kwargs):
        result = real_write_item(transforms, stream, data, write_item, storage_key, *args, **kwargs)
        checkpointer = state.get("checkpointer")
        if plan["mode"] == "mid-write" and checkpointer is not None and checkpointer.step == state["target"] \
                and dist.get_rank() == plan["rank"]:
            stream.flush()
            shard = Path(stream.name)
            _kill_logged({**plan, "step": checkpointer.step, "shard": str(shard), "shard_bytes": shard.stat().st_size,
                          "metadata_exists": (shard.parent / ".metadata").exists()})
        return result

    Checkpointer.restore, Checkpointer.step_done = restore, step_done
    dcp_files._write_item = write_item


def _inject_checkpointer_options() -> None:
    fmt, every = os.environ.get("CHECKPOINT_FORMAT"), os.environ.get("CHECKPOINT_EVERY")
    background = os.environ.get("CHECKPOINT_BACKGROUND") == "1"
    if not (fmt or every or background):
        return
    real_init = Checkpointer.__init__

    def init(self, folder, objects, **kwargs):
        if fmt:
            kwargs["format"] = fmt
        if every:
            kwargs["every_n_steps"] = int(every)
        if background:
            kwargs["background"] = True
        real_init(self, folder, objects, **kwargs)

    Checkpointer.__init__ = init


def _inject() -> None:
    _inject_checkpointer_options()
    if os.environ.get("FAULT_KILLS"):
        _inject_random_kills(int(os.environ["FAULT_KILLS"]), int(os.environ.get("FAULT_SEED", "0")))
    real_step_done = Checkpointer.step_done
    kill_rank, at_step = os.environ.get("FAULT_KILL_RANK"), os.environ.get("FAULT_AT_STEP")
    signal_step, marker = os.environ.get("FAULT_SIGNAL_AT_STEP"), os.environ.get("FAULT_MARKER", "")
    signal_rank = int(os.environ.get("FAULT_SIGNAL_RANK", "0"))

    sleep_s = float(os.environ.get("FAULT_STEP_SLEEP", "0"))

    def step_done(self, batches: int = 1):
        if sleep_s:
            time.sleep(sleep_s)
        path = real_step_done(self, batches)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if kill_rank is not None and rank == int(kill_rank) and self.step == int(at_step) and _once(marker):
            os.kill(os.getpid(), signal.SIGKILL)
        if signal_step is not None and rank == signal_rank and self.step == int(signal_step) and _once(marker):
            os.kill(os.getpid(), signal.SIGUSR2)
        return path

    Checkpointer.step_done = step_done

    real_restore = Checkpointer.restore

    restored_folder = os.environ.get("RECORD_RESTORED")

    def restore(self):
        path = real_restore(self)
        # One write with its newline: the ranks share the launcher's stderr, and print() writes
        # the newline separately, so two ranks' lines could merge.
        print(f"rank {self.group.rank}: restored {path} at step {self.step}\n", end="", file=sys.stderr, flush=True)
        if restored_folder and path is not None:
            model = self.objects["model"]
            held = {"model": getattr(model, "module", model).state_dict(),
                    "optimizer": self.objects["optimizer"].state_dict()}
            torch.save(held, Path(restored_folder) / f"restored-{self.group.world_size}-{self.group.rank}.pt")
        return path

    Checkpointer.restore = restore

    margin = os.environ.get("FAULT_DEADLINE_MARGIN")
    if margin is not None:
        real_stop_init = StopAgreement.__init__

        def stop_init(self, *args, **kwargs):
            kwargs["margin_s"] = float(margin)
            real_stop_init(self, *args, **kwargs)

        StopAgreement.__init__ = stop_init

    if os.environ.get("FAULT_SAVE_KILLS"):
        _kill_during_background_saves(int(os.environ["FAULT_SAVE_KILLS"]), Path(os.environ["FAULT_SAVE_KILL_LOG"]),
                                      sync=os.environ.get("FAULT_SAVE_KILL_SYNC") == "1")

    folder = os.environ.get("RECORD_IDS")
    if folder:
        real_iter = ResumableSampler.__iter__

        def recording_iter(self):
            with open(Path(folder) / f"rank-{self.rank}.txt", "a") as out:
                for index in real_iter(self):
                    out.write(f"{self.epoch} {index}\n")
                    out.flush()
                    yield index

        ResumableSampler.__iter__ = recording_iter


def _kill_during_background_saves(kills: int, kill_log: Path, *, sync: bool = False) -> None:
    real_init, real_save = Checkpointer.__init__, torch.save

    def init(self, *args, **kwargs):
        kwargs["background"] = True
        real_init(self, *args, **kwargs)

    def save(obj, f, *args, **kwargs):
        done = len(kill_log.read_text().splitlines()) if kill_log.exists() else 0
        writer = threading.current_thread() is threading.main_thread() if sync else \
            threading.current_thread() is not threading.main_thread()
        due = (writer and isinstance(obj, dict) and "model" in obj
               and done < kills and obj.get("step") == 10 * (done + 2))
        if not due:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        written = random.SystemRandom().randrange(1, len(data))
        f.write(data[:written])
        f.flush()
        temporary = os.readlink(f"/proc/self/fd/{f.fileno()}")
        with open(kill_log, "a") as out:
            out.write(f"{obj['step']} {temporary} {os.path.getsize(temporary)} {len(data)}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    if not sync:
        Checkpointer.__init__ = init
    torch.save = save


if __name__ == "__main__":
    _inject()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
