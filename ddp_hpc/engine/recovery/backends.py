"""Which process-group backends in-job recovery runs over (torch-free: the launch asks too,
before any rank starts)."""

from __future__ import annotations

from ddp_hpc.contract import BACKEND_VAR

#: The backends whose broken group a survivor can leave without exiting (gloo: its sockets
#: shut down). NCCL needs its communicator aborted with error handling that spares the
#: survivors, XCCL/oneCCL likewise: not built yet, so refused before training starts.
RECOVERABLE_BACKENDS = ("gloo",)


def backend_refusal(backend: str) -> str | None:
    """Why in-job recovery cannot run over ``backend`` (one line), or None."""
    if backend in RECOVERABLE_BACKENDS:
        return None
    return (f"in-job recovery runs over gloo only for now, not {backend}: a broken {backend} group cannot be "
            f"left without ending the process yet; give the backend gloo (DDP over gloo also works with ranks "
            f"on cuda, e.g. {BACKEND_VAR}=gloo), or drop --recover and restart in place (--max-restarts)")
