"""The launch's side of in-job recovery (``ddp-hpc launch --recover N``, one node).

The supervisor owns every rank's process, so it knows which rank was lost and can start
it again while the others stay up. ``Recoverer`` starts each attempt's ranks (as
``LocalRanks`` does) around a store it serves itself (``engine/recovery/store.py``): the
store outlives any rank. When a rank ends with a failure, or its heartbeat stands still
or its process is stopped (``launch/proc_state.py``; a replacement frozen before its first
heartbeat too) for the hang timeout (it is killed first), and recoveries are left and every rank runs
``InJobRecovery``, it publishes the next group's ``Plan`` and starts a replacement in the
lost rank's place (or, with ``shrink``, lets the survivors go on alone). Otherwise the
supervisor ends the attempt and the restart policy decides, as without recovery.

With ``warm_spare`` one more process of the command runs beside the ranks: it imports torch,
runs the script up to ``InJobRecovery`` and waits there (``RECOVERY_SPARE_VAR``). A lost
rank's place goes to it, so the replacement starts neither Python nor torch. A spare starts
once every rank is ready, and the next once the new group completed its first step: its
start-up takes CPU that the ranks' start or a recovery would wait for.

A stop signal (SIGUSR2, SIGTERM) that reaches the launch while a replacement starts goes
to the others at once and is held for the replacement until it has started
``InJobRecovery`` (a signal it cannot handle yet would end it, and the stop with it).

Under a launcher that ends every task when one fails (mpiexec, srun), the same ``Recoverer``
runs in each node's supervisor (``launch/node.py``, ``ddp-hpc launch --node-supervisor``):
``store_address`` is then the outer launch's store (a client, not a server), the ranks are
``ranks.nproc`` of ``ranks.world_size`` from ``ranks.node_rank * ranks.nproc`` on (a *slot*
is a rank's place in the whole launch; the children are this node's, in slot order), and
a stop the outer launch asks for through the store reaches ``on_stop``.

torch is imported only here, inside functions (the launch side never imports it at start-up).
"""

from __future__ import annotations

import hashlib
import logging
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_hpc.contract import (RECOVERY_GENERATION_VAR, RECOVERY_SHRINK_VAR, RECOVERY_SPARE_VAR, RECOVERY_STORE_VAR,
                              RECOVERY_WAIT_VAR, ExitStatus)
from ddp_hpc.device import NCCL_ERROR_HANDLING_VAR, NCCL_MONITORING_VAR
from ddp_hpc.engine.recovery.layout import Buddies, describe_lost_together, steps_held
from ddp_hpc.errors import UserError
from ddp_hpc.launch.attempts import start_all
from ddp_hpc.launch.local import LocalRanks
from ddp_hpc.launch.proc_state import is_stopped

#: Set to 0 for ranks that recover in the job, unless the user set them: the survivors abort
#: a broken NCCL group themselves, and torch's watchdog and monitor must not end them (or a
#: replacement) first (torch's ``_abort_process_group`` asks for error handling off).
RECOVERY_NCCL_SETTINGS = (NCCL_ERROR_HANDLING_VAR, NCCL_MONITORING_VAR)

log = logging.getLogger(__name__)

#: How often the heartbeats are read.
WATCH_S = 0.25


@dataclass(frozen=True)
class RecoveryLimits:
    """``max_recoveries`` in one attempt; ``wait_s``: how long ranks wait for the next
    group; ``shrink``: go on without the lost rank instead of replacing it; ``hang_s``: a
    rank whose heartbeat stands still this long is frozen, and is ended and recovered;
    ``warm_spare``: keep a spare process waiting to replace a lost rank."""

    max_recoveries: int
    wait_s: float = 120.0
    shrink: bool = False
    hang_s: float = 10.0
    warm_spare: bool = False

    def __post_init__(self) -> None:
        if self.max_recoveries < 0:
            raise UserError(f"--recover {self.max_recoveries} must be >= 0")
        if self.wait_s <= 0 or self.hang_s <= 0:
            raise UserError("--recovery-wait and --hang-timeout must be > 0 seconds")
        if self.warm_spare and self.shrink:
            raise UserError("--warm-spare replaces a lost rank, --shrink goes on without it: give one of them")


def describe_cause(status: int) -> str:
    if status > 128:
        try:
            return f"exit {status} ({signal.Signals(status - 128).name})"
        except ValueError:
            pass
    return f"exit {status}"


class Recoverer:
    """Starts ``ranks`` (``start``, the supervisor's ``StartAttempt``) and recovers a lost
    one in place (``on_failure``, ``watch``)."""

    def __init__(self, ranks: LocalRanks, limits: RecoveryLimits, store_address: str | None = None,
                 outer_attempt: int = 0) -> None:
        self.ranks, self.limits, self.store_address = ranks, limits, store_address
        #: A node supervisor's: its outer launch's attempt (``$DDP_HPC_RESTART_COUNT``), added to its own (0).
        self.outer_attempt = outer_attempt
        #: The first slot of this node's ranks.
        self.offset = ranks.node_rank * ranks.nproc
        #: Called with the stop signal the outer launch asked for through the store (a node supervisor's).
        self.on_stop: Callable[[int], None] | None = None
        self.used = 0
        self._store: Any = None
        self._run_id = ""
        self._attempt = 0
        self.generation = 0
        #: slot -> rank in the current group; index in the supervisor's children == slot.
        self.members: dict[int, int] = {}
        self._causes: dict[int, str] = {}
        #: Children whose process is a replacement (or the warm spare) put in place after a loss.
        self._replacements: set[int] = set()
        #: Slots lost since the last group that completed a step (lost together, for the buddy check).
        self._lost: set[int] = set()
        self._beats: dict[int, tuple[int, float]] = {}
        #: pid -> when it was first seen stopped (SIGSTOP, a debugger), heartbeat or not.
        self._stopped: dict[int, float] = {}
        self._next_watch = 0.0
        self._spare: subprocess.Popen | None = None
        self._spares = 0
        #: Replacements that have not started InJobRecovery yet, and the stop signal held for them.
        self._starting: set[int] = set()
        self._held: dict[int, int] = {}

    def start(self, attempt: int, extra_env: Mapping[str, str] | None = None) -> list[subprocess.Popen]:
        """Attempt ``attempt``'s ranks (an ``Attempts``, launch/attempts.py; ``extra_env``: none
        here, where a node supervisor's outer launch puts the store's address in its own environment)."""
        from ddp_hpc.engine.recovery.store import LaunchStore

        self.close()
        if self._store is not None:
            self._store.close()  # the last attempt's: its ranks are gone
        if self.store_address is None:
            self._store = LaunchStore()
            self._run_id = uuid.uuid4().hex[:12]
        else:  # one run id for every node's ranks
            self._store = LaunchStore(address=self.store_address)
            self._run_id = hashlib.sha256(self.store_address.encode()).hexdigest()[:12]
        self._attempt = self.outer_attempt + attempt
        self.generation, self.used = 0, 0
        self.members = {slot: slot for slot in range(self.ranks.world_size)}
        self._causes.clear()
        self._replacements.clear()
        self._lost.clear()
        self._beats.clear()
        self._stopped.clear()
        self._starting.clear()
        self._held.clear()
        return start_all([(self.ranks.command, self._environment(index)) for index in range(self.ranks.nproc)])

    def _where(self) -> str:
        """Which node supervisor speaks, where there are several."""
        return f"node {self.ranks.node_rank} of {self.ranks.num_nodes}: " if self.ranks.num_nodes > 1 else ""

    def _slot(self, index: int) -> int:
        """The slot of this node's child ``index``."""
        return self.offset + index

    def close(self) -> None:
        """The attempt ended: so does the spare (it waits in the store, idle)."""
        if self._spare is not None and self._spare.poll() is None:
            self._spare.kill()
            self._spare.wait()
        self._spare = None

    def _start_spare(self) -> None:
        if not self.limits.warm_spare:
            return
        self._spares += 1
        # Some rank's torchrun variables (`ddp-hpc run` needs them): InJobRecovery sets RANK once it has a slot.
        env = {**self._environment(0), RECOVERY_SPARE_VAR: self._spare_id()}
        env.pop(RECOVERY_GENERATION_VAR, None)
        self._spare = start_all([(self.ranks.command, env)])[0]

    def _spare_id(self) -> str:
        """This node's newest spare, named apart from the other nodes' ones."""
        return f"{self.ranks.node_rank}.{self._spares}" if self.ranks.num_nodes > 1 else str(self._spares)

    def _environment(self, index: int) -> dict[str, str]:
        port = int(self._store.address.rpartition(":")[2])
        env = self.ranks.environment(index, self._attempt, port, self._run_id)
        env.update({RECOVERY_STORE_VAR: self._store.address, RECOVERY_WAIT_VAR: f"{self.limits.wait_s:g}",
                    # The launch serves the store: a script that calls init_process_group itself connects to it.
                    "TORCHELASTIC_USE_AGENT_STORE": "True"})
        for name in RECOVERY_NCCL_SETTINGS:
            if name not in self.ranks.base_env:
                env[name] = "0"
        if self.generation:
            env[RECOVERY_GENERATION_VAR] = str(self.generation)
        if self.limits.shrink:
            env[RECOVERY_SHRINK_VAR] = "1"
        return env

    def on_failure(self, index: int, status: int, children: list[subprocess.Popen]) -> bool:
        """This node's rank ``index`` ended with ``status``: True when the job recovers in
        place (its replacement is in ``children[index]``, or the others go on without it)."""
        from ddp_hpc.engine.recovery.store import Plan

        slot = self._slot(index)
        cause = self._causes.pop(index, describe_cause(status))
        self.used = self._store.generations()  # every node's recoveries of this attempt
        if status == ExitStatus.USAGE:
            log.error("rank %d exited %d (the mistake it reported in one line, the same on every rank): no in-job "
                      "recovery is spent on it", slot, status)
            return self._give_up(slot, cause)
        given_up = self._store.given_up()
        if given_up is not None:  # the ranks found they cannot recover: this exit is one of theirs
            log.error("%s: restarting in place from the newest checkpoint, no in-job recovery spent on rank %d's exit "
                      "(%s)", given_up, slot, cause)
            return self._give_up(slot, given_up)
        gone = self._shards_gone(index, children)
        if gone is not None:
            log.error("%s: restarting in place from the newest checkpoint", gone)
            return self._give_up(slot, gone)
        if self.used >= self.limits.max_recoveries:
            log.error("rank %d lost (%s) and no in-job recovery is left (--recover %d): restarting in place",
                      slot, cause, self.limits.max_recoveries)
            return self._give_up(slot, cause)
        # A replacement still starting (this one, or another's) is not ready yet, and need not be.
        starting = {self._slot(i) for i in self._starting} | {slot}
        not_ready = self._store.not_ready([s for s in self.members if s not in starting])
        if not_ready:
            log.error("rank %d lost (%s); rank(s) %s do not run InJobRecovery: restarting in place", slot, cause,
                      ", ".join(map(str, not_ready)))
            return self._give_up(slot, cause)
        survivors = [s for s in sorted(self.members) if s != slot]
        if self.limits.shrink and not survivors:
            return False
        self.generation = self.used = self._store.next_generation()
        if self.limits.shrink:
            self.members = {s: rank for rank, s in enumerate(survivors)}
        plan = Plan(generation=self.generation, world_size=len(self.members), ranks=dict(self.members), lost=slot,
                    host=socket.gethostname(), cause=cause, detected_at=time.time(), replaced=not self.limits.shrink,
                    replacement=index in self._replacements)
        self._lost.add(slot)
        if not self.limits.shrink:
            self._replacements.add(index)
        self._store.forget(slot)
        self._store.publish(plan)
        self._beats.pop(index, None)
        if self.limits.shrink:
            log.warning("rank %d lost (%s): the %d others go on without it (recovery %d of %d)", slot, cause,
                        len(self.members), self.used, self.limits.max_recoveries)
        elif self._spare is not None and self._spare.poll() is None:
            self._starting.add(index)  # it is ready once it joined the new group: a stop is held till then
            self._store.assign(self._spare_id(), slot)
            children[index], self._spare = self._spare, None
            log.warning("%srank %d lost (%s): the warm spare (pid %d) takes its place, the others stay up "
                        "(recovery %d of %d)", self._where(), slot, cause, children[index].pid, self.used,
                        self.limits.max_recoveries)
        else:
            self._starting.add(index)  # before it starts: a stop that comes meanwhile is held for it
            children[index] = start_all([(self.ranks.command, self._environment(index))])[0]
            log.warning("%srank %d lost (%s): replacement started (pid %d), the others stay up (recovery %d of %d)",
                        self._where(), slot, cause, children[index].pid, self.used, self.limits.max_recoveries)
        return True

    def _shards_gone(self, index: int, children: Sequence[subprocess.Popen]) -> str | None:
        """Why a sharded model's lost shards cannot come back (one line), or None: a rank and
        every buddy holding its copies lost together (the ones lost since the last group
        that completed a step, and any child ended meanwhile), and no copy of its shards in
        this node's memory. Asked only where every rank runs on this node (else the copies
        on other nodes are not seen here: the ranks' roll-back finds out)."""
        if self.ranks.num_nodes != 1:
            return None
        layout = self._store.snapshot_layout()
        if layout is None:  # not a sharded model
            return None
        if self.generation and self._store.recovered(self.generation):
            self._lost.clear()
        ended = {self._slot(i) for i, child in enumerate(children)
                 if i != index and child.poll() is not None and child.returncode not in (0, ExitStatus.REQUEUE)}
        buddies = Buddies(world_size=layout["world_size"], distance=layout["distance"], replicas=layout["replicas"])
        together = buddies.gone_together(self._lost | ended | {self._slot(index)})
        folder = Path(layout["folder"]) / socket.gethostname()
        gone = [(slot, holders) for slot, holders in together if not steps_held(folder, slot)]
        return describe_lost_together(gone) if gone else None

    def _give_up(self, slot: int, cause: str) -> bool:
        """The last plan: none. Every survivor waiting for a plan, or in a collective that
        the loss broke (its heartbeat sees ``latest`` rise), ends at once instead of waiting
        out the launch's stop and kill."""
        from ddp_hpc.engine.recovery.store import Plan

        self._store.publish(Plan(generation=self._store.next_generation(), world_size=0, ranks={}, lost=slot,
                                 host=socket.gethostname(), cause=cause, detected_at=time.time(), replaced=False,
                                 gave_up=True))
        return False

    def forward(self, signum: int, children: list[subprocess.Popen]) -> None:
        """The stop goes to every running rank; to a replacement that has not started
        ``InJobRecovery`` yet once it has (``deliver``)."""
        for index, child in enumerate(children):
            if index in self._starting and not self._store.ready(self._slot(index)):
                self._held[index] = signum
            elif child.returncode is None:
                send(child, signum)
        self.deliver(children)

    def forward_stop(self, signum: int, children: Sequence[subprocess.Popen]) -> None:
        self.forward(signum, list(children))

    def read_status(self, attempt: int, status: int) -> int:
        return status

    def describe(self) -> str:
        return self.ranks.describe()

    def deliver(self, children: list[subprocess.Popen]) -> None:
        for index in sorted(self._held):
            child = children[index]
            if child.returncode is not None:
                del self._held[index]
            elif self._store.ready(self._slot(index)):
                log.warning("passing %s on to rank %d's replacement (pid %d), up now", signal.Signals(
                    self._held[index]).name, self._slot(index), child.pid)
                send(child, self._held.pop(index))
                self._starting.discard(index)

    def watch(self, children: list[subprocess.Popen]) -> None:
        """Kill a rank whose heartbeat stood still for ``hang_s``, or that was stopped that long
        (``_end_stopped``): it is then recovered as a lost rank."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + WATCH_S
        if self.on_stop is not None:
            signum = self._store.stop_requested()
            if signum is not None:
                self.on_stop(signum)
                return
        if self.limits.warm_spare and (self._spare is None or self._spare.poll() is not None) \
                and (self.generation == 0 or self._store.recovered(self.generation)) \
                and self._store.all_ready(self.members):
            self._start_spare()
        running = [index for index, child in enumerate(children)
                   if self._slot(index) in self.members and child.returncode is None]
        missing = set(self._store.not_ready([self._slot(index) for index in running]))
        watched = [index for index in running if self._slot(index) not in missing]
        counters = self._store.beats_of([self._slot(index) for index in watched])  # a few requests, not one a rank
        ended: set[int] = set()
        for index in watched:
            child, slot = children[index], self._slot(index)
            self._starting.discard(index)
            beats = counters[slot]
            last = self._beats.get(index)
            if last is None or last[0] != beats:
                self._beats[index] = (beats, now)
            elif now - last[1] >= self.limits.hang_s:
                self._causes[index] = f"frozen: no heartbeat for {self.limits.hang_s:g} s"
                log.error("rank %d (pid %d) sent no heartbeat for %g s: ending it", slot, child.pid,
                          self.limits.hang_s)
                child.kill()
                self._beats.pop(index, None)
                ended.add(index)
        self._end_stopped([index for index in running if index not in ended], missing, children, now)

    def _end_stopped(self, running: list[int], starting: set[int], children: list[subprocess.Popen],
                     now: float) -> None:
        """Kill a child stopped (``/proc``'s state) for ``hang_s``, heartbeat or not: a
        replacement or warm spare frozen before its first beat (``starting``: the slots not
        ready yet) sends none, as one still importing torch, and would hold the survivors
        for the whole recovery wait."""
        pids = {children[index].pid for index in running}
        for pid in [pid for pid in self._stopped if pid not in pids]:
            del self._stopped[pid]
        for index in running:
            child, slot = children[index], self._slot(index)
            if not is_stopped(child.pid):
                self._stopped.pop(child.pid, None)
                continue
            if now - self._stopped.setdefault(child.pid, now) < self.limits.hang_s:
                continue
            self._causes[index] = ("frozen (stopped) before its first heartbeat" if slot in starting
                                   else f"frozen (stopped) for {self.limits.hang_s:g} s")
            log.error("rank %d (pid %d) stopped for %g s (%s): ending it", slot, child.pid, self.limits.hang_s,
                      self._causes[index])
            child.kill()
            del self._stopped[child.pid]
            self._beats.pop(index, None)


def send(child: subprocess.Popen, signum: int) -> None:
    try:
        child.send_signal(signum)
    except ProcessLookupError:
        pass
