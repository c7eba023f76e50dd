"""How every process group of a rank is initialised: the one ``init_process_group`` call.

``process_group()`` decides it once per rank (the device bound, the network checked, gloo's
interface picked) and starts the group through the rendezvous, or hands it to a starter such
as in-job recovery, which forms its groups (one per recovery) on the launch's store with the
same settings. A loop of one's own that starts with ``InJobRecovery`` gets them from
``for_this_rank``, the same checks without a ``process_group()``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddp_hpc.device import DEVICE_ID_BACKENDS, select_device
from ddp_hpc.environment import resolve_env
from ddp_hpc.environment.netcheck import NetworkPlan, check_network, gloo_interface


@dataclass(frozen=True)
class GroupStart:
    """The backend, collective timeout, bound device and network plan of this rank's groups."""

    backend: str
    timeout: timedelta
    #: ``init_process_group``'s ``device_id`` (the bound device, for the backends that take one).
    device_id: Any = None
    network: NetworkPlan = field(default_factory=NetworkPlan)

    def init(self, store: dist.Store, rank: int, world_size: int) -> None:
        """``init_process_group`` on ``store``, gloo on the planned interface."""
        with gloo_interface(self.network):
            dist.init_process_group(backend=self.backend, store=store, rank=rank, world_size=world_size,
                                    timeout=self.timeout, device_id=self.device_id)

    def gloo_group(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        """A gloo group outside the default one (in-job recovery's snapshot swaps), on the
        planned interface: handed to gloo as a device, not through the environment, so that
        a thread may make it while the training thread forms groups of its own."""
        if self.network.gloo_ifname is None:  # none planned, or the user's own GLOO_SOCKET_IFNAME
            return dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(interface=self.network.gloo_ifname)]
        options._timeout = self.timeout
        return dist.ProcessGroupGloo(store, rank, world_size, options)

    @classmethod
    def for_this_rank(cls, backend: str, timeout: timedelta, environ: Mapping[str, str] | None = None) -> GroupStart:
        """What ``process_group()`` would decide: the job's names checked across nodes,
        gloo's interface picked for a host suffix (``DDP_HPC_HOST_SUFFIX``). Over gloo the
        group is on no particular device (the loop binds its own); a backend that needs
        one (nccl, xccl) binds this rank's, ``LOCAL_RANK``'s, as ``process_group()`` does,
        with its refusals (more ranks on the node than devices)."""
        environ = os.environ if environ is None else environ
        dist_env = resolve_env(environ)
        device_id = None
        if backend in DEVICE_ID_BACKENDS:
            device_id = bound_device(backend, "auto", dist_env.local_rank, dist_env.local_world_size, environ)
        return cls(backend, timeout, device_id, check_network(dist_env, backend, host_suffix=None, environ=environ))

    def for_local_rank(self, local_rank: int, local_world_size: int,
                       environ: Mapping[str, str] | None = None) -> GroupStart:
        """The same start for the rank that took another local rank's place (a warm spare,
        decided before it knew its place): the device of that local rank, bound."""
        if self.device_id is None:
            return self
        environ = os.environ if environ is None else environ
        device_id = bound_device(self.backend, self.device_id.type, local_rank, local_world_size, environ)
        return replace(self, device_id=device_id)


def bound_device(backend: str, device: str, local_rank: int, local_world_size: int,
                 environ: Mapping[str, str]) -> Any:
    """The device ``select_device`` gives ``local_rank``, made current (its refusals too)."""
    choice = select_device(device, backend, local_rank=local_rank, local_world_size=local_world_size, env=environ)
    choice.activate()
    return choice.init_device_id
