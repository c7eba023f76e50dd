"""A step counts only where its collectives finished before their group was aborted.

Over gloo a collective returns to the training thread when it is done, or raises. Over NCCL
it only queues work on the GPU: a survivor's host runs on while the all-reduce of a step
waits for a peer that is gone. In-job recovery then aborts the group (``rank.py``,
``_break_group``), and an aborted NCCL kernel ends early: the stream goes on, and the
optimizer would apply gradients the all-reduce left half summed, on every survivor alike,
so no member would hold a clean state to send. torchft asks every step the same question
before its optimizer step (``Manager.should_commit``); here the optimizer's step pre-hook
asks it: it waits for the current stream (the step's collectives are queued on it by then),
then refuses the step if the group was aborted meanwhile. The abort is marked before it is
made, so a kernel cut short is always seen: it ends after the mark.

The wait is the one host synchronization a step under NCCL recovery adds (a loop that reads
its loss each step makes the same one). It also bounds a collective that never finishes:
the rank's heartbeat aborts a group whose fence waited longer than the collective timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ddp_hpc.engine.recovery.errors import GroupAborted, RecoveryError


class StepFence:
    """Guards ``optimizer.step`` (``attach``) against a group aborted mid-step; the step's
    work is on the current stream of the current ``device_type`` device (``cuda``)."""

    def __init__(self, device_type: str, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.device_type, self.timeout_s, self._clock = device_type, timeout_s, clock
        self._aborted = threading.Event()
        self._waiting_since: float | None = None
        self._passed = False

    def attach(self, optimizer: torch.optim.Optimizer, ignore: Callable[[], bool] = lambda: False) -> Any:
        """Checks every step of ``optimizer`` from now on but those made while ``ignore()`` (a
        Checkpointer's save steps a stateless optimizer at lr 0: not a step of the loop's);
        the handle's ``remove()`` ends that."""
        def check(*_: Any) -> None:
            if not ignore():
                self.pass_or_raise()

        return optimizer.register_step_pre_hook(check)

    def mark_aborted(self) -> None:
        """The group is about to be aborted (called before the abort, on any thread)."""
        self._aborted.set()

    def reset(self) -> None:
        """A new group formed: its steps count again."""
        self._aborted.clear()
        self._passed = False

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def overdue(self) -> bool:
        """The fence has waited longer than the collective timeout (the heartbeat asks)."""
        since = self._waiting_since
        return since is not None and self._clock() - since > self.timeout_s

    def pass_or_raise(self) -> None:
        """Wait until the step's queued work is done; ``GroupAborted`` if the group was
        aborted before it was (the step's all-reduce may have been cut short). A second
        optimizer step in one step, the first applied and this one refused, leaves no whole
        state to go on from in the job: ``RecoveryError`` (a restart in place)."""
        if self._passed and self._aborted.is_set():
            raise RecoveryError("the process group was aborted between two optimizer steps of one step (the first "
                                "applied): the launch restarts the job in place")
        if not self._aborted.is_set():
            self._waiting_since = self._clock()
            try:
                wait_for_stream(self.device_type)
            finally:
                self._waiting_since = None
        self.check()
        self._passed = True

    def step_ended(self) -> None:
        """At the step's end (``step_done``, before it is counted): a step whose optimizer
        step did not run (a gradient scaler skipped it on the inf an abort left) is checked
        here instead; ``GroupAborted`` if the group was aborted before its work was done."""
        passed, self._passed = self._passed, False
        if not passed:
            self.pass_or_raise()
            self._passed = False

    def check(self) -> None:
        """``GroupAborted`` if the group was aborted: what a collective of it gave since may
        be cut short (call it after reading a collective's result on the host)."""
        if self._aborted.is_set():
            raise GroupAborted("the process group was aborted during this step (a peer was lost): the step is not "
                               "applied, the group is formed anew")


def wait_for_stream(device_type: str) -> None:
    """Block until the work queued on the current device's current stream is done (nothing
    on CPU). The wait lets go of the GIL: the heartbeat's thread runs meanwhile."""
    if device_type == "cuda":
        torch.cuda.current_stream().synchronize()
    elif device_type == "xpu":
        torch.xpu.current_stream().synchronize()
