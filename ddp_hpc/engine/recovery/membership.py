"""Forming a group: the launch's plans, a warm spare's wait for a place, the members'
meeting on the store and the start of each group (``InJobRecovery``'s part that knows who
is in the job)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from ddp_hpc.contract import RECOVERY_WAIT_VAR
from ddp_hpc.engine.recovery import store as keys
from ddp_hpc.engine.recovery.errors import RecoveryError, Superseded
from ddp_hpc.errors import RefusedOnRank, UserError
from ddp_hpc.startup.group_start import GroupStart
from ddp_hpc.engine.recovery.group_abort import socket_fds

log = logging.getLogger(__name__)


def spare_places(env: Mapping[str, str], slot: int) -> dict[str, str]:
    """``RANK`` and ``LOCAL_RANK`` of a warm spare that takes ``slot``: it started with its
    node's first rank's (``env``), so the node's slots start at ``RANK - LOCAL_RANK``."""
    first_here = int(env.get("RANK", "0")) - int(env.get("LOCAL_RANK", "0"))
    return {"RANK": str(slot), "LOCAL_RANK": str(slot - first_here)}


class Membership:
    """``InJobRecovery``'s part that forms each group: the launch's plans, a warm spare's wait
    for a place, the members' meeting on the store. Its attributes are ``InJobRecovery``'s (rank.py)."""

    def _plan(self, generation: int) -> keys.Plan:
        assert self._store is not None
        try:
            plan = keys.wait_plan(self._store, generation, self.wait_s)
        except (dist.DistStoreError, RuntimeError) as exc:
            raise RecoveryError(f"rank {self.slot}: no new group from the launch within {self.wait_s:g} s "
                                f"({RECOVERY_WAIT_VAR}); the launch restarts the job in place") from exc
        if plan.gave_up:
            raise RecoveryError(f"rank {self.slot}: the launch gave up in-job recovery after losing rank {plan.lost} "
                                f"({plan.cause}); it restarts the job in place")
        return plan

    def _wait_as_spare(self, spare: str) -> int:
        """A warm spare (``ddp-hpc launch --warm-spare``): torch is imported and the script
        has run up to here; wait, as long as the launch lives, for the slot of a lost rank."""
        assert self._store is not None
        key = keys.spare_key(spare)
        while True:
            try:
                self._store.wait([key], timedelta(seconds=self.wait_s))
            except dist.DistStoreError:
                if not self._store.check([key]):  # no loss yet (a launch that is gone raises here)
                    continue
            return int(self._store.get(key))

    def _form(self, generation: int, plan: keys.Plan | None) -> None:
        assert self._store is not None
        if plan is None:
            rank, world_size = self.slot, self._launch_world_size
        elif self.slot not in plan.ranks:
            raise RecoveryError(f"rank {self.slot} is not in group {generation}")
        else:
            rank, world_size = plan.ranks[self.slot], plan.world_size
            self._await_members(plan)
        settings = self._settings()
        before = socket_fds()
        try:
            settings.init(dist.PrefixStore(keys.group_prefix(generation), self._store), rank, world_size)
        except BaseException:  # a group that failed to form leaves its sockets to be shut down too
            with self._lock:
                self._group_fds = socket_fds() - before if self._fence is None else set()
            raise
        # The group (its sockets, or itself for an abort) and its generation change together:
        # the heartbeat, which breaks groups older than the newest plan, never takes the new
        # group for the old.
        with self._lock:
            self._group_fds = socket_fds() - before if self._fence is None else set()
            self._group = dist.group.WORLD
            if self._fence is not None:
                self._fence.reset()
            self.generation = generation
            self._slots = tuple(sorted(plan.ranks, key=plan.ranks.__getitem__)) if plan is not None else self._slots

    def _settings(self) -> GroupStart:
        """The start-up every group of this rank shares (decided on the first group: a warm
        spare's place in the job is known only then)."""
        if self._group_start is None:
            try:
                self._group_start = GroupStart.for_this_rank(self.backend, self.collective_timeout, self._environ)
            except UserError as exc:  # no device for this rank: the same on every start, no loss
                raise RefusedOnRank(str(exc), self.slot) from None
        return self._group_start

    def _await_members(self, plan: keys.Plan) -> None:
        """Every member of ``plan`` has come to form it, before any connects: a member that
        died starting (a replacement) would otherwise hold the others in torch's rendezvous
        for the collective timeout. The last to come says so in the store; so does the
        launch when it publishes a newer plan (it saw that death), which ends the wait."""
        assert self._store is not None
        joined = keys.joined_key(plan.generation)
        if int(self._store.add(joined, 1)) == plan.world_size:
            self._store.set(keys.formed_key(plan.generation), "1")
        try:
            self._store.wait([keys.formed_key(plan.generation)], timedelta(seconds=self.wait_s))
        except (dist.DistStoreError, RuntimeError) as exc:
            raise RecoveryError(f"rank {self.slot}: group {plan.generation} did not gather its {plan.world_size} "
                                f"members within {self.wait_s:g} s ({RECOVERY_WAIT_VAR})") from exc
        if int(self._store.add(joined, 0)) < plan.world_size:
            raise Superseded(f"group {plan.generation} lost a member before it formed")

    def _form_newest(self, plan: keys.Plan) -> keys.Plan:
        """Form the group of ``plan``, or of the newest plan where the launch published a
        newer one meanwhile or one comes while this one forms; the plan formed."""
        assert self._store is not None
        while True:
            latest = int(self._store.get(keys.LATEST_KEY))
            if latest > plan.generation:  # another rank was lost meanwhile: join the newest group
                plan = self._plan(latest)
            try:
                self._form(plan.generation, plan)
                return plan
            except RecoveryError:
                raise
            except RuntimeError as exc:  # Superseded; gloo's failed connect to a member that died
                self._failed(plan, exc)
            plan = self._plan(plan.generation + 1)

    def _failed(self, plan: keys.Plan, exc: BaseException) -> None:
        log.warning("rank %d: group %d failed before training went on (%s): waiting for the next plan", self.slot,
                    plan.generation, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        self._leave_group()

    def _absorbed(self, plan: keys.Plan) -> list[keys.Plan]:
        """The plans before ``plan`` whose groups completed no step (each a lost rank this
        recovery recovers from too), oldest first: back to the last group that did."""
        assert self._store is not None
        found = []
        for generation in range(plan.generation - 1, 0, -1):
            if self._store.check([keys.recovered_key(generation)]):
                break
            older = keys.read_plan(self._store, generation)
            if older is None:  # drawn by another node supervisor, not published yet: none of ours
                continue
            if older.gave_up:
                break
            found.append(older)
        return found[::-1]
