"""Checkpoint state copied to host memory, into buffers kept from one save to the next.

A background save lets training go on once the state is copied to host memory (the
*snapshot*); a thread then writes the copy. Both background formats copy through here: the
single file (``background_writer``) and the sharded one (``dcp_format``'s stager).

- Each tensor is copied into a host buffer kept under its place in the nested state (its key
  path), refilled in place while its shape and dtype (and a DTensor's layout) stay the same:
  after the first save, a save allocates nothing (allocation and its page faults were most
  of the time training waited). Refilling is only safe once the previous copy's write is
  done: the callers wait for it first.
- From a CUDA tensor the buffer is pinned and the copy is ``copy_(non_blocking=True)``;
  torch's CUDA semantics: such a device-to-host copy may still be running when ``copy_``
  returns, so ``snapshot`` synchronizes each source device's current stream (the stream the
  copies were queued on, after the kernels that last wrote the tensors) once, at the end.
- A DTensor (an FSDP2 shard) stays a DTensor: its local shard is copied, and the buffer is
  wrapped with the same spec, as torch's own staging does (``_create_cpu_state_dict``).
  ``DTensor.from_local`` would not do: it moves a host tensor to the mesh's device.
- Anything else is deep-copied (plain values: the training thread may change them later).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


def dtensor_class() -> type | None:
    """torch's DTensor class, or None where this torch has no distributed support."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support holds no DTensors
        return None
    return DTensor


def _empty_host(like: torch.Tensor, *, zeroed: bool = False) -> torch.Tensor:
    make = torch.zeros if zeroed else torch.empty
    return make(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.device.type == "cuda")


def _fits(held: torch.Tensor | None, tensor: torch.Tensor, dtensor: type | None) -> bool:
    if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
        return False
    if dtensor is not None and isinstance(tensor, dtensor):
        return (isinstance(held, dtensor) and held.placements == tensor.placements
                and held.device_mesh == tensor.device_mesh and held.to_local().shape == tensor.to_local().shape)
    return dtensor is None or not isinstance(held, dtensor)


def _host_buffer(tensor: torch.Tensor, dtensor: type | None, *, zeroed: bool = False) -> torch.Tensor:
    """A host tensor to copy ``tensor`` into: for a DTensor, a DTensor whose local shard
    lives in host memory (the mesh and placements its own)."""
    if dtensor is not None and isinstance(tensor, dtensor):
        return dtensor(_empty_host(tensor.to_local(), zeroed=zeroed), tensor._spec, requires_grad=False)
    return _empty_host(tensor, zeroed=zeroed)


def _copy(value: Any, cache: dict[tuple, torch.Tensor] | None, key: tuple, dtensor: type | None,
          pending: set[torch.device]) -> Any:
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        held = cache.get(key) if cache is not None else None
        if not _fits(held, tensor, dtensor):
            held = _host_buffer(tensor, dtensor)
            if cache is not None:
                cache[key] = held
        is_dtensor = dtensor is not None and isinstance(tensor, dtensor)
        source = tensor.to_local() if is_dtensor else tensor
        target = held.to_local() if is_dtensor else held
        non_blocking = source.device.type == "cuda"
        target.copy_(source, non_blocking=non_blocking)
        if non_blocking:
            pending.add(source.device)
        return held
    if isinstance(value, Mapping):
        return {k: _copy(item, cache, (*key, k), dtensor, pending) for k, item in value.items()}
    if isinstance(value, list):
        return [_copy(item, cache, (*key, i), dtensor, pending) for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_copy(item, cache, (*key, i), dtensor, pending) for i, item in enumerate(value))
    return copy.deepcopy(value)


@torch.no_grad()
def snapshot(value: Any, cache: dict[tuple, torch.Tensor] | None = None, key: tuple = ()) -> Any:
    """A deep copy of ``value`` whose tensors live in host memory and share nothing with
    the live training state (on CPU ``tensor.cpu()`` would alias: always copy), complete
    when it returns. With ``cache``, the previous snapshot's buffers are refilled in place
    where they fit (see the module's docstring)."""
    copied, pending = _copy_all(value, cache, key)
    for device in pending:
        torch.cuda.current_stream(device).synchronize()
    return copied


def _copy_all(value: Any, cache: dict[tuple, torch.Tensor] | None, key: tuple) -> tuple[Any, set[torch.device]]:
    pending: set[torch.device] = set()
    return _copy(value, cache, key, dtensor_class(), pending), pending


@dataclass(frozen=True)
class Copying:
    """A snapshot whose device-to-host copies may still run (``snapshot_on_side_streams``):
    ``copied`` is complete once ``wait()`` returns."""

    copied: Any
    done: tuple[Any, ...]

    def wait(self) -> Any:
        for event in self.done:
            event.synchronize()
        return self.copied


@torch.no_grad()
def snapshot_on_side_streams(value: Any, cache: dict[tuple, torch.Tensor],
                             streams: dict[torch.device, Any], key: tuple = ()) -> Copying:
    """``snapshot``, with the copies from a GPU queued on a side stream of that device
    (``streams``, one kept per device) instead of waited for: the caller goes on at once.

    torch's CUDA semantics make that safe: the side stream first waits for the work queued
    so far on the current stream (what last wrote the tensors), and the current stream then
    waits for the copies (an event) before anything queued after, such as the next
    optimizer step writing the same tensors in place; neither wait holds the CPU. The host
    buffers are complete once ``wait()`` returns (the events synchronized). Without a GPU
    this is ``snapshot``: copied when it returns."""
    if not torch.cuda.is_available():
        return Copying(snapshot(value, cache, key), ())
    # The rank's device (a rank's tensors live on one): its copies go on its side stream; a
    # tensor on another device is copied on that device's current stream, waited for alike.
    device = torch.device("cuda", torch.cuda.current_device())
    side = streams.get(device)
    if side is None:
        side = streams[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        copied, pending = _copy_all(value, cache, key)
    done = []
    for used in pending:
        event = torch.cuda.Event()
        event.record(side if used == device else torch.cuda.current_stream(used))
        torch.cuda.current_stream(used).wait_event(event)
        done.append(event)
    return Copying(copied, tuple(done))


@torch.no_grad()
def allocate_like(value: Any, cache: dict[tuple, torch.Tensor], key: tuple = ()) -> None:
    """Host buffers for ``value``'s tensors in ``cache``, under the keys ``snapshot`` uses,
    touched so that their pages exist: what the first snapshot would otherwise allocate
    while training waits."""
    dtensor = dtensor_class()

    def allocate(item: Any, place: tuple) -> None:
        if isinstance(item, torch.Tensor):
            if not _fits(cache.get(place), item, dtensor):
                cache[place] = _host_buffer(item, dtensor, zeroed=True)
        elif isinstance(item, Mapping):
            for k, sub in item.items():
                allocate(sub, (*place, k))
        elif isinstance(item, (list, tuple)):
            for i, sub in enumerate(item):
                allocate(sub, (*place, i))

    allocate(value, key)
