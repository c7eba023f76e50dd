"""A sharded model's snapshots under in-job recovery: starting them (the memory check,
the buddies), the roll-back to the newest step every member holds, a restart's resume
from node memory, and their end (``shards.py`` holds the snapshots themselves)."""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_hpc.contract import SNAPSHOT_EVERY_VAR
from ddp_hpc.engine.recovery import store as keys
from ddp_hpc.engine.group import ProcessGroupView
from ddp_hpc.engine.recovery.errors import RecoveryError
from ddp_hpc.engine.recovery.layout import describe_lost_together, node_bytes
from ddp_hpc.engine.recovery.payload import state_from_tensor, state_to_tensor
from ddp_hpc.engine.recovery.record import ResumeEvent, SnapshotPlan, write_resume, write_snapshot_plan
from ddp_hpc.engine.recovery.shards import (
    KEPT_STEPS,
    Buddies,
    Rollback,
    SnapshotFiles,
    Snapshots,
    SwapLink,
    available_memory_bytes,
    fetch_own,
    gather_json,
    newest_common,
    rebind,
    localized,
    state_bytes,
)
from ddp_hpc.engine.rng import seed_for_step
from ddp_hpc.errors import RefusedOnRank

log = logging.getLogger(__name__)


#: Steps between snapshots of a sharded model when neither the caller nor the launch says.
DEFAULT_SNAPSHOT_EVERY = 1


def snapshot_cadence(given: int | None, env: Mapping[str, str], slot: int) -> int:
    raw = given if given is not None else env.get(SNAPSHOT_EVERY_VAR, DEFAULT_SNAPSHOT_EVERY)
    try:
        every = int(raw)
    except (TypeError, ValueError):
        every = 0
    if every < 1:
        where = "snapshot_every" if given is not None else SNAPSHOT_EVERY_VAR
        raise RefusedOnRank(f"{where} must be a whole number of steps, at least 1, not {raw!r}", slot)
    return every


def memory_refusal(reports: Sequence[Mapping[str, Any]], held: Mapping[str, int], buddies: Buddies,
                   root: Path) -> str | None:
    """Why the snapshots of the ranks would not fit in their nodes' memory (one line), or
    None. ``reports``: each rank's host and the bytes free there; ``held``: what each host's
    memory would hold at its most (``layout.node_bytes``)."""
    for host in dict.fromkeys(report["host"] for report in reports):
        wanted = held[host]
        free = min(report["free"] for report in reports if report["host"] == host)
        if wanted > free:
            copies = "its ranks' shards" if buddies.replicas == 1 else "its ranks' shards and the copies they hold"
            return (f"the snapshots of the ranks on {host} need about {wanted / 2**30:.2f} GiB of node-local memory "
                    f"({KEPT_STEPS} steps of {copies} and the one being written, and each rank's host buffers) and "
                    f"{free / 2**30:.2f} GiB is free under {root.parent}: give each rank more memory (fewer ranks "
                    f"per node, more nodes), or drop --recover")
    return None


#: What a tensor's data takes beyond its bytes in a serialized snapshot (``torch.save``
#: aligns each record; about half the alignment on average), and what each parameter's
#: Adam state adds before the first step made it (two moments' records and key paths, and
#: the step count). Fitted on torch 2.13: the estimate is within 1% of the snapshot
#: serialized after the step (tests/test_sharded_recovery.py compares them).
ALIGN_BYTES = 16


ADAM_ENTRY_BYTES = 770


def snapshot_bytes(state: Any) -> int:
    """What a snapshot of ``state`` will hold, serialized: everything but the tensors'
    data serialized as it will be (each tensor emptied), plus the data's bytes, with the
    optimizer's state estimated as Adam's (two moments as large as the parameters, a step
    count) where no step has made it yet."""
    objects = state.get("objects", {})
    local, paths = localized(state)
    hollow = state_to_tensor({**_emptied(local), "dtensors": paths}).numel()
    total = hollow + state_bytes(state) + ALIGN_BYTES * tensor_count(state)
    optimizer = objects.get("optimizer")
    if optimizer is not None and not optimizer.get("state"):
        params = sum(len(group.get("params", ())) for group in optimizer.get("param_groups", ()))
        total += 2 * state_bytes(objects.get("model", {})) + params * ADAM_ENTRY_BYTES
    return total


def _emptied(tree: Any) -> Any:
    """``tree`` with each tensor replaced by an empty one of its dtype."""
    if isinstance(tree, torch.Tensor):
        return torch.empty(0, dtype=tree.dtype)
    if isinstance(tree, Mapping):
        return {k: _emptied(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_emptied(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_emptied(v) for v in tree)
    return tree


def tensor_count(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return 1
    if isinstance(tree, Mapping):
        return sum(tensor_count(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_count(v) for v in tree)
    return 0


def _from_buddies(rollback: Rollback | None) -> tuple[int, ...]:
    return tuple(slot for slot, source in sorted(rollback.sources.items()) if source != slot) if rollback else ()


def rollback_fields(rollback: Rollback | None) -> dict[str, Any]:
    if rollback is None:
        return {}
    return {"snapshot_step": rollback.step, "redone_steps": rollback.redone, "from_buddies": _from_buddies(rollback)}


class SnapshotKeeping:
    """``InJobRecovery``'s part that keeps a sharded model's snapshots and rolls back to them.
    Its attributes are ``InJobRecovery``'s (rank.py)."""

    def _start_snapshots(self, checked: bool) -> None:
        """Buddies on other hosts, room on each node for its ranks' copies (said, else
        refused on every rank alike, before the first step), and the group copies travel on.
        ``checked``: a replacement, whose group passed the checks at its start (its group's
        collectives come in the state transfer)."""
        world = dist.get_world_size()
        distance = self._snapshot_distance
        if distance is None:  # the next host's rank in the same place; one host: the next rank
            distance = self._local_world_size if 0 < self._local_world_size < world else 1
        buddies = Buddies(world_size=world, distance=distance, replicas=self._snapshot_replicas)
        files = SnapshotFiles(self._snapshot_root)
        if checked:
            self._snapshots = Snapshots(self.snapshot_every, buddies, files, self._state)
            return
        mine = {"host": socket.gethostname(), "payload": snapshot_bytes(self._state()),
                "free": available_memory_bytes(files.root)}
        everyone = gather_json(mine, self._check_group)
        hosts = [one["host"] for one in everyone]
        payloads = [one["payload"] for one in everyone]
        held = node_bytes(hosts, payloads, buddies)
        at_most = node_bytes(hosts, payloads, buddies, steps=KEPT_STEPS + 1)
        why = buddies.refusal(hosts) or memory_refusal(everyone, at_most, buddies, files.root)
        if why is not None:
            self.close()
            raise RefusedOnRank(why, self.slot)
        if len(set(hosts)) == 1 and world > 1 and self.slot == 0:
            log.warning("rank %d: every rank runs on %s: the snapshots survive a lost rank, not a lost host",
                        self.slot, hosts[0])
        self._snapshots = Snapshots(self.snapshot_every, buddies, files, self._state)
        self._attach_snapshots()
        if self.slot == 0:
            assert self._store is not None
            keys.publish_snapshots(self._store, world, buddies.distance, buddies.replicas, str(files.root))
            self._say_snapshot_memory(hosts, payloads, held, buddies, files)

    def _say_snapshot_memory(self, hosts: list[str], payloads: list[int], held: dict[str, int], buddies: Buddies,
                             files: SnapshotFiles) -> None:
        """rank 0's line on what the snapshots take of its node's memory, and the plan in the record."""
        here = hosts[0]
        ranks_here = hosts.count(here)
        slots = buddies.slots_on_host(hosts, here)
        in_files = KEPT_STEPS * sum(payloads[slot] for slot in slots)
        log.info("snapshots of the sharded state every %d step(s) in %s, each also held %d rank(s) away: about %.1f "
                 "MiB of node-local memory per rank (%.1f MiB of files: %d steps of the %d slots whose copies %s "
                 "keeps; %.1f MiB of host buffers)", self.snapshot_every, files.root, buddies.distance,
                 held[here] / ranks_here / 2**20, in_files / ranks_here / 2**20, KEPT_STEPS, len(slots), here,
                 (held[here] - in_files) / ranks_here / 2**20)
        if self.run_dir is not None:
            write_snapshot_plan(self.run_dir, SnapshotPlan(
                every=self.snapshot_every, replicas=buddies.replicas, distance=buddies.distance,
                kept_steps=KEPT_STEPS, folder=str(files.root),
                bytes_per_rank={str(rank): held[host] // hosts.count(host) for rank, host in enumerate(hosts)},
                snapshot_bytes={str(rank): payload for rank, payload in enumerate(payloads)},
                node_bytes=held,
                file_bytes={one: KEPT_STEPS * sum(payloads[slot] for slot in buddies.slots_on_host(hosts, one))
                            for one in dict.fromkeys(hosts)}))

    def _attach_snapshots(self) -> None:
        """The swaps of the group formed last meet under its generation's prefix."""
        assert self._snapshots is not None and self._address is not None
        self._snapshots.attach(SwapLink(address=self._address, prefix=f"{keys.group_prefix(self.generation)}snapshots-{self._restarts}/",
                                        rank=dist.get_rank(), world_size=dist.get_world_size(),
                                        group_start=self._settings()))

    def _kept_slots(self) -> list[int]:
        assert self._snapshots is not None
        return [self.slot, *self._snapshots.buddies.held_by(self.slot)]

    def _roll_back(self) -> Rollback:
        """Every member goes back to the newest snapshot every shard has: its own copy, or
        (a replacement) the lost rank's from a buddy. A survivor cleared what the broken step
        left first (``_recover``)."""
        snapshots, model = self._snapshots, self._model
        assert snapshots is not None and model is not None
        rebind(model)
        self._attach_snapshots()
        rollback = self._load_newest_snapshot()
        if rollback is None:
            cause = self._no_rollback_cause()
            if dist.get_rank() == 0 and self._store is not None:  # the launch gives up at the survivors' exits
                keys.give_up(self._store, cause)
            raise RecoveryError(f"rank {self.slot}: {cause}; the launch restarts the job in place from the newest "
                                "checkpoint")
        return rollback

    def _no_rollback_cause(self) -> str:
        """Why no snapshot step is held for every shard (one clause, the same on every member):
        a rank lost with every buddy that held its copies (their nodes' memory with them), or
        a loss before any copy was kept."""
        snapshots = self._snapshots
        assert snapshots is not None
        held = gather_json(sorted(int(slot) for slot in snapshots.files.holdings(self._kept_slots())),
                           self._check_group)
        kept = {slot for slots in held for slot in slots}
        missing = [slot for slot in range(dist.get_world_size()) if slot not in kept]
        if not kept:
            return "no snapshot was kept yet (the loss came before the first one)"
        if missing:
            gone = snapshots.buddies.gone_together(missing) or [(missing[0], snapshots.buddies.holders(missing[0]))]
            return describe_lost_together(gone)
        return "the shards' copies are of different steps, none held for every shard"

    def _load_newest_snapshot(self) -> Rollback | None:
        """Load the newest snapshot step every shard has, whoever holds it; its rollback."""
        rollback = self._newest_snapshot()
        if rollback is not None:
            self._load_snapshot(rollback)
        return rollback

    def _newest_snapshot(self) -> Rollback | None:
        """The newest snapshot step every shard has (the same on every member), loading nothing."""
        snapshots = self._snapshots
        assert snapshots is not None
        held = snapshots.files.holdings(self._kept_slots())
        reports = gather_json({"held": {str(slot): steps for slot, steps in held.items()}, "step": self.step},
                              self._check_group)
        rollback = newest_common([report["held"] for report in reports])
        if rollback is None:
            return None
        return dataclasses.replace(rollback, redone=max(report["step"] for report in reports) - rollback.step)

    def _load_snapshot(self, rollback: Rollback) -> None:
        snapshots = self._snapshots
        assert snapshots is not None
        self._load(state_from_tensor(fetch_own(rollback, snapshots.files, ProcessGroupView.current().device,
                                               self._check_group)), shrunk=False)
        self._drop_snapshots_after(rollback.step)

    def _drop_snapshots_after(self, step: int) -> None:
        """The kept snapshots of steps after ``step``: they are done again."""
        assert self._snapshots is not None
        for slot in self._kept_slots():
            self._snapshots.files.drop_after(slot, step)

    def _resume_from_memory(self) -> None:
        """A restart in place: the newest snapshot the nodes kept, where it is newer than
        the checkpoint the loop restored (an older one is not loaded: the checkpoint's state
        stands, and the snapshots after its step are dropped, since those steps are done
        again); which one it was goes to the log and the record."""
        from_disk = self.step
        rollback = self._newest_snapshot() if self._snapshots is not None else None
        memory = rollback is not None and rollback.step > from_disk
        if rollback is not None and not memory:  # older than the disk's: the disk's state stands
            log.info("rank %d: the node-local snapshot (step %d) is not newer than the checkpoint", self.slot,
                     rollback.step)
            self._drop_snapshots_after(from_disk)
        if memory:
            assert rollback is not None and self.seed is not None
            self._load_snapshot(rollback)
            self.step = rollback.step
            seed_for_step(self.seed, self.step)
            if self._stop_agreement is not None:
                self._stop_agreement.continue_at(self.step)
        event = ResumeEvent(restart=self._restarts, tier="memory" if memory else "disk", step=self.step,
                            checkpoint_step=from_disk, from_buddies=_from_buddies(rollback) if memory else ())
        if dist.get_rank() == 0:
            log.warning("restarted in place (restart %d) from the %s at step %d", event.restart,
                        "node-local snapshot" if memory else "checkpoint on disk", event.step)
            if self.run_dir is not None:
                write_resume(self.run_dir, event)

    def _end_snapshots(self) -> None:
        """Training ended on this rank: its node-local copies are not needed any more."""
        if self._snapshots is not None:
            try:  # every rank's last swap is done before any removes what it wrote
                self._snapshots.barrier()
            except RuntimeError as exc:  # a rank lost at the very end: its copies stay for a restart
                log.warning("rank %d: the snapshots stay in %s (%s)", self.slot, self._snapshots.files.root,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                return
            self._snapshots.files.remove(self._kept_slots())
