"""The group and its end: leaving a broken group (gloo's sockets shut down; NCCL's
communicators aborted, see ``fence.py``), and which errors mean a peer is gone."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ddp_hpc.device import NCCL_ERROR_HANDLING_VAR
from ddp_hpc.engine.recovery.errors import GroupAborted, RecoveryError

log = logging.getLogger(__name__)


def is_collective_error(exc: BaseException) -> bool:
    """A collective failed because a peer is gone: torch's ``DistError``s, the plain
    ``RuntimeError`` gloo raises from its transport ("[.../gloo/transport/tcp/pair.cc:553]
    Connection closed by peer"), and a step refused because its group was aborted
    (``GroupAborted``, NCCL). Any other error is the user's and ends the rank as before."""
    return (isinstance(exc, (dist.DistError, GroupAborted))
            or (isinstance(exc, RuntimeError) and "gloo/transport" in str(exc)))


#: The backends whose collectives finish on a device stream: a broken group of theirs is
#: aborted, and each step passes a ``StepFence``.
ABORTED_BACKENDS = {"nccl": "cuda"}


def abort_refusal(backend: str, env: Mapping[str, str]) -> str | None:
    """Why this rank cannot leave a broken ``backend`` group by aborting it (one line), or
    None (and None for a backend that is not aborted)."""
    if backend not in ABORTED_BACKENDS:
        return None
    if not hasattr(dist.ProcessGroup, "abort"):
        return (f"in-job recovery over {backend} aborts a broken group, and this torch ({torch.__version__}) cannot "
                f"(no ProcessGroup.abort; torch 2.9 has it): use a newer torch, or the backend gloo")
    if ABORTED_BACKENDS[backend] == "cuda" and not torch.cuda.is_available():
        return (f"in-job recovery over {backend} needs a CUDA device and this torch ({torch.__version__}) sees none: "
                f"give the backend gloo, or run on the GPU nodes")
    handling = env.get(NCCL_ERROR_HANDLING_VAR, "").strip()
    if handling != "0":
        said = f"{NCCL_ERROR_HANDLING_VAR}={handling}" if handling else f"{NCCL_ERROR_HANDLING_VAR} unset (torch's 3)"
        return (f"{said} lets NCCL's watchdog end this rank when a peer is lost: under --recover the launch sets it "
                f"to 0; leave it so")
    return None


def abort_group(group: dist.ProcessGroup, slot: int) -> None:
    """Abort ``group``'s communicators (the heartbeat's thread may call it while the
    training thread waits on the group): its kernels end and its collectives fail."""
    try:
        group.abort()
    except RuntimeError as exc:  # already destroyed: nothing of it is left to end
        log.warning("rank %d: aborting the broken group: %s", slot, str(exc).splitlines()[0] if str(exc) else exc)


def socket_fds() -> set[int]:
    """This process's open sockets (Linux; elsewhere none are known and a recovery waits
    for the collective timeout)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    fds = set()
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except OSError:
            continue
    return fds


class GroupAbort:
    """``InJobRecovery``'s part that leaves a broken group: its sockets shut down (gloo) or its
    communicators aborted (NCCL). Its attributes are ``InJobRecovery``'s (rank.py)."""

    def _break_group(self, older_than: int | None = None) -> None:
        """Shut the current group's connections down, so that every collective of it fails
        at once, on this rank and on each peer waiting for it.

        A survivor whose ring neighbours are alive would otherwise wait out the collective
        timeout: ``destroy_process_group`` does not close gloo's connections while anything
        (DDP, a failed work) still holds the group, and nothing can interrupt a wait from
        outside. torchft runs its groups in a subprocess it can kill for the same reason
        (``ProcessGroupBaby``); here the sockets the group opened are shut down instead.
        An NCCL group is aborted (its communicators, torch's ``ProcessGroup.abort``, as
        torchft leaves one), its fence marked first (``fence.py``).
        ``older_than``: only a group of an older generation (the heartbeat's view).
        """
        with self._lock:
            if older_than is not None and self.generation >= older_than:
                return
            if self._fence is not None:
                if self._group is not None and not self._fence.aborted:
                    self._fence.mark_aborted()
                    # On a thread of its own: an abort may take seconds, and the heartbeat
                    # that calls this must go on beating meanwhile.
                    self._aborting = threading.Thread(target=abort_group, args=(self._group, self.slot), daemon=True,
                                                      name="ddp_hpc-group-abort")
                    self._aborting.start()
                return
            for fd in self._group_fds:
                try:
                    sock = socket.socket(fileno=os.dup(fd))
                except OSError:
                    continue
                try:
                    # Not the listening socket: gloo's listener thread aborts the process on a failed accept.
                    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                finally:
                    sock.close()
            self._group_fds = set()

    def _leave_group(self) -> None:
        self._break_group()
        with self._lock:
            self._group, aborting, self._aborting = None, self._aborting, None
        if aborting is not None:  # one abort at a time: torch's below aborts the group too
            aborting.join(self.collective_timeout.total_seconds())
            if aborting.is_alive():
                raise RecoveryError(f"rank {self.slot}: aborting the broken group did not end within the collective "
                                    f"timeout ({self.collective_timeout.total_seconds():g} s); the launch restarts "
                                    "the job in place")
        if dist.is_initialized():
            # The group's destructor joins gloo's worker threads, and one that an op of the
            # broken group still holds (seen with rank 0 lost) keeps it until the collective
            # timeout: the last reference is dropped on a thread of its own, so this rank
            # goes on to the next group at once.
            held = [dist.group.WORLD]
            if self._fence is not None:
                # An aborted NCCL group is let go without a shutdown: that joins its watchdog,
                # which may sleep a minute dumping its trace after a peer's error.
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
            threading.Thread(target=held.clear, daemon=True, name="ddp_hpc-broken-group-release").start()
