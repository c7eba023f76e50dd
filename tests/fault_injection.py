"""Callbacks that break a run on purpose, named in test configs' ``callbacks`` list."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ddp_hpc.builtin_jobs.synthetic import SyntheticJob
from ddp_hpc.training import Callback


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc), deepest last."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and everything below it. torchrun starts each worker in a session of
    its own, so killing torchrun's process group would leave the ranks running."""
    tree = [root, *descendants(root)]  # listed once: once root is dead, its children are re-parented
    for pid in tree:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if os.getpid() in tree:
        os.kill(os.getpid(), signal.SIGKILL)


def launch_root() -> int:
    """The launcher process above this rank (torchrun's agent), or this process."""
    parent = os.getppid()
    return parent if parent > 1 else os.getpid()


class KillLaunchAfterCheckpoint(Callback):
    """SIGKILL the whole launch (the launcher and every rank) right after rank 0 has
    written the checkpoint of ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_checkpoint_saved(self, trainer, path: Path) -> None:
        if trainer.progress.global_step == self.step:
            kill_tree(launch_root())


class _AtStep(Callback):
    """``once``: only where ``marker`` was not written yet (a replacement that redoes the
    step, after a roll-back to a snapshot before it, is not hit again)."""

    def __init__(self, rank: int, step: int, marker: str = "", once: bool = False) -> None:
        self.rank, self.step, self.marker, self.once = rank, step, marker, once

    def hit(self, trainer) -> bool:
        if trainer.ctx.rank != self.rank or trainer.progress.global_step != self.step:
            return False
        if self.once and Path(self.marker).exists():
            return False
        if self.marker:
            Path(self.marker).write_text(repr(time.time()))
        return True


class KillRankAtStep(_AtStep):
    """SIGKILL one rank (as the OOM killer would) right after ``step``."""

    def on_step_end(self, trainer) -> None:
        if self.hit(trainer):
            os.kill(os.getpid(), signal.SIGKILL)


class FreezeRankAtStep(_AtStep):
    """One rank's process stops whole (SIGSTOP: every thread, its heartbeat too) right after ``step``."""

    def on_step_end(self, trainer) -> None:
        if self.hit(trainer):
            os.kill(os.getpid(), signal.SIGSTOP)


class RaiseOnRankAtStep(_AtStep):
    """An exception in one rank's training code."""

    def on_step_end(self, trainer) -> None:
        if self.hit(trainer):
            raise RuntimeError(f"injected failure on rank {self.rank}")


class HangRankAtStep(_AtStep):
    """One rank stops making progress (stuck in user code): its peers wait in a collective."""

    def on_step_end(self, trainer) -> None:
        if self.hit(trainer):
            time.sleep(3600)


class FlipBitOnRankAtStep(_AtStep):
    """Silent data corruption: one bit of one weight flips in one rank's memory after ``step``
    (bit 12 of the first weight: a small change, so training goes on without an error)."""

    def on_step_end(self, trainer) -> None:
        if self.hit(trainer):
            import torch

            with torch.no_grad():
                weight = next(trainer.model.parameters())
                bits = weight.view(-1)[:1].view(torch.int32)
                bits ^= 1 << 12


class KillLaunchDuringCheckpointWrite(Callback):
    """SIGKILL the whole launch in the middle of rank 0's ``nth`` checkpoint write (counted
    in this launch): after the temporary file is written and fsync'd, just before it is
    renamed into place. The rename itself is where the kill lands, whatever number of
    fsyncs a save makes."""

    def __init__(self, nth: int) -> None:
        self.nth = nth

    def on_fit_start(self, trainer) -> None:
        if not trainer.ctx.is_rank_zero:
            return
        from ddp_hpc.engine.checkpoint import files as checkpoint

        real_replace, writes = checkpoint.os.replace, [0]

        def die_before_the_rename(src, dst, *args, **kwargs):
            if Path(dst).name.startswith("step-") and ".tmp-" in Path(src).name:
                writes[0] += 1
                if writes[0] == self.nth:
                    assert Path(src).stat().st_size > 0, "the temporary file must be written"
                    kill_tree(launch_root())
            return real_replace(src, dst, *args, **kwargs)

        checkpoint.os.replace = die_before_the_rename


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening_addresses(pid: int) -> list[str]:
    """IP addresses on which process ``pid`` listens with sockets it opened itself (from
    /proc); sockets inherited from its launcher (MPICH's control port) are the launcher's."""
    import ipaddress

    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    inodes = _socket_inodes(pid) - _socket_inodes(parent)
    addresses = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                # /proc prints each 32-bit word in host (little-endian) order.
                ordered = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                addresses.append(str(ipaddress.ip_address(ordered)))
    return addresses


class RecordListeningSockets(Callback):
    """Each rank writes the addresses it listens on once the job is running."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_start(self, trainer) -> None:
        path = Path(self.folder) / f"rank{trainer.ctx.rank}.txt"
        path.write_text("\n".join(listening_addresses(os.getpid())))


class KillLaunchAtStep(Callback):
    """SIGKILL the whole launch (launcher, every rank and their helper processes) when rank 0
    reaches ``step``, between checkpoints: whatever was logged after the last one is cut off."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer) -> None:
        if trainer.ctx.is_rank_zero and trainer.progress.global_step == self.step:
            kill_tree(launch_root())


class KillRankOnceAtStep(_AtStep):
    """SIGKILL one rank right after ``step``, on the first attempt only: ``marker`` records
    that it happened, so a restarted job that passes the step again runs on."""

    def on_step_end(self, trainer) -> None:
        if self.marker and Path(self.marker).exists():
            return
        if self.hit(trainer):
            os.kill(os.getpid(), signal.SIGKILL)


class RaiseInBuildDatasets(SyntheticJob):
    """The synthetic job, whose ``build_datasets`` raises on one rank (a data file missing
    on one node, a bug in a loader): after the process group formed, before training."""

    def __init__(self, fail_rank: int = 1, marker: str = "", **params) -> None:
        super().__init__(**params)
        self.fail_rank, self.marker = fail_rank, marker

    def build_datasets(self):
        from ddp_hpc.environment import resolve_env

        if resolve_env().rank == self.fail_rank:
            if self.marker:
                Path(self.marker).write_text(repr(time.time()))
            raise RuntimeError(f"injected failure in build_datasets on rank {self.fail_rank}")
        return super().build_datasets()


class KillLaunchDuringAsyncWrite(Callback):
    """SIGKILL the whole launch inside rank 0's background write of the ``nth`` asynchronous
    checkpoint: the temporary file is complete and fsync'd but not yet renamed, and training
    has gone on past the checkpoint's step. ``marker`` records where the kill landed."""

    def __init__(self, nth: int, marker: str) -> None:
        self.nth, self.marker = nth, marker

    def on_fit_start(self, trainer) -> None:
        if not trainer.ctx.is_rank_zero:
            return
        import json
        import threading

        from ddp_hpc.engine.checkpoint import files as checkpoint

        real_fsync, writes = checkpoint.os.fsync, [0]

        def fsync_then_die(fd: int) -> None:
            real_fsync(fd)
            name = os.readlink(f"/proc/self/fd/{fd}")
            if ".tmp-" not in Path(name).name or not Path(name).name.startswith(".step-"):
                return  # a folder, or a last.pt/best.pt link
            writes[0] += 1
            if writes[0] != self.nth:
                return
            saved_step = int(Path(name).name[len(".step-"):len(".step-") + 8])
            deadline = time.monotonic() + 30
            while trainer.progress.global_step <= saved_step and time.monotonic() < deadline:
                time.sleep(0.01)  # training goes on while this write is in flight
            Path(self.marker).write_text(json.dumps({
                "thread": threading.current_thread().name, "main_thread": threading.current_thread()
                is threading.main_thread(), "temporary": name, "temporary_bytes": os.fstat(fd).st_size,
                "checkpoint_step": saved_step, "training_step_at_kill": trainer.progress.global_step}))
            kill_tree(launch_root())

        checkpoint.os.fsync = fsync_then_die


class CapCpuOfRank(Callback):
    """At the start of training, ``rank`` moves into the cgroup v1 ``cpu`` group ``cgroup``
    (made by the test), which gets ``quota_us`` of CPU time every ``period_us``."""

    def __init__(self, rank: int, cgroup: str, quota_us: int, period_us: int) -> None:
        self.rank, self.cgroup, self.quota_us, self.period_us = rank, Path(cgroup), quota_us, period_us

    def on_fit_start(self, trainer) -> None:
        if trainer.ctx.rank != self.rank:
            return
        (self.cgroup / "cpu.cfs_period_us").write_text(str(self.period_us))
        (self.cgroup / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))


class RecordProcess(Callback):
    """Each rank appends a line to ``folder``/rank-<N>.jsonl when training starts and when
    it ends: its pid, whether it replaced a lost rank (in-job recovery), the checkpoint it
    resumed from."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def _write(self, trainer, event: str) -> None:
        import json

        self.folder.mkdir(parents=True, exist_ok=True)
        line = {"event": event, "pid": os.getpid(), "time": time.time(), "joining": trainer.joining,
                "resumed_from": str(trainer.state.resumed_from) if trainer.state.resumed_from else None}
        with open(self.folder / f"rank-{trainer.ctx.rank}.jsonl", "a") as handle:
            handle.write(json.dumps(line) + "\n")

    def on_fit_start(self, trainer) -> None:
        self._write(trainer, "start")

    def on_fit_end(self, trainer, summary) -> None:
        self._write(trainer, "end")
