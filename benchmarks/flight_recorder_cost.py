"""What torch's flight recorder (``TORCH_FR_BUFFER_SIZE=64``, which ``ddp-hpc train`` and
``ddp-hpc run`` set so that the watchdog can name the collective each rank is at) costs a
collective, and what one dump of it (a heartbeat's ``collectives.position()``) costs.

    python benchmarks/flight_recorder_cost.py --calls 2000 --repeats 3

Starts 2 gloo ranks under torchrun twice, without and with the recorder; each times
``--calls`` all_reduces of one float (the case where a per-collective cost shows most), best
of ``--repeats``, and rank 0 prints microseconds per call and per dump.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def worker(calls: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from ddp_hpc.engine.collectives import position

    dist.init_process_group("gloo")
    tensor = torch.ones(1)
    for _ in range(200):
        dist.all_reduce(tensor)
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(tensor)
        times.append((time.perf_counter() - started) / calls * 1e6)
    started = time.perf_counter()
    for _ in range(1000):
        found = position()
    dump_us = (time.perf_counter() - started) / 1000 * 1e6
    if dist.get_rank() == 0:
        size = os.environ.get("TORCH_FR_BUFFER_SIZE", "0")
        print(f"TORCH_FR_BUFFER_SIZE={size}: all_reduce(1 float) {min(times):.1f} us per call (best of {repeats}: "
              f"{', '.join(f'{t:.1f}' for t in times)}); position() {dump_us:.1f} us -> {found}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.calls, args.repeats)
        return
    for size in ("0", "64"):
        env = {**os.environ, "TORCH_FR_BUFFER_SIZE": size, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        __file__, "--worker", "--calls", str(args.calls), "--repeats", str(args.repeats)],
                       env=env, check=True)


if __name__ == "__main__":
    main()
