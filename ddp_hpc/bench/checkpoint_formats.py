"""``ddp-hpc bench --checkpoints``: the checkpoint formats side by side, in one run.

For each world size (one torchrun launch each), a DDP model of ``megabytes`` of weights is
saved by the public ``Checkpointer`` in four ways: ``file`` (rank 0 writes one file) and
``dcp`` (every rank writes its part), each synchronous and in the background. Per save:
the *stall* (how long ``save()`` kept training waiting) and the *write* time (until the
checkpoint was complete on disk, ``wait()`` included). Next to them, the disk's own
sequential write bandwidth, measured in the same run on the same folder (one file of the
same size, written in 64 MB blocks and fsync'd), and each format's write throughput as a
fraction of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = (("file", False), ("file", True), ("dcp", False), ("dcp", True))


def _folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path``, each inode once (``last.pt`` is a hard link)."""
    sizes = {(s.st_dev, s.st_ino): s.st_size for s in (p.stat() for p in path.rglob("*") if p.is_file())}
    return sum(sizes.values())


def disk_write_mb_s(folder: Path, megabytes: int) -> float:
    """Sequential write bandwidth of ``folder``'s file system: ``megabytes`` in 64 MB blocks, fsync'd."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 << 20)
    path = folder / "disk-bandwidth.bin"
    started = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(math.ceil(megabytes * 1e6 / len(block))):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - started
    written = path.stat().st_size
    path.unlink()
    return written / 1e6 / elapsed


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from ddp_hpc.engine.checkpointer import Checkpointer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layers = 8
    width = int(math.sqrt(args.megabytes * 1e6 / 4 / layers))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    ddp = DistributedDataParallel(model)
    results = []
    for fmt, background in MODES:
        folder = Path(args.dir) / f"{fmt}-{'background' if background else 'sync'}-{dist.get_world_size()}"
        checkpointer = Checkpointer(folder, {"model": ddp}, keep_last=1, background=background, format=fmt)
        stall, write, size = [], [], 0
        for _ in range(args.saves):
            with torch.no_grad():
                model[0].weight.add_(1e-3)  # a new state each time
            checkpointer.step += 1
            dist.barrier()
            started = time.perf_counter()
            checkpointer.save()
            stall.append(time.perf_counter() - started)
            checkpointer.wait()
            write.append(time.perf_counter() - started)
        dist.barrier()
        if rank == 0:
            size = _folder_bytes(folder / "checkpoints")
            shutil.rmtree(folder)
        results.append({"format": fmt, "background": background, "stall_s": stall, "write_s": write,
                        "bytes_on_disk": size})
        dist.barrier()
    if rank == 0:
        state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        Path(args.out).write_text(json.dumps({"world_size": dist.get_world_size(), "state_bytes": state_bytes,
                                              "modes": results}))
    dist.barrier()
    del ddp
    dist.destroy_process_group()


def run_checkpoint_formats(world_sizes: tuple[int, ...], megabytes: int, output: Path, workdir: Path,
                           saves: int = 2) -> dict[str, Any]:
    """Measure every format at every world size; merged into ``output`` as ``checkpoint_formats``."""
    from ddp_hpc.bench.results_file import check_output, merge_into

    check_output(output)
    workdir.mkdir(parents=True, exist_ok=True)
    disk = disk_write_mb_s(workdir, megabytes)
    print(f"disk sequential write: {disk:.0f} MB/s ({workdir})", flush=True)
    rows = []
    for size in world_sizes:
        out = workdir / f"formats-{size}.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={size}",
                   "-m", "ddp_hpc.bench.checkpoint_formats", "--worker", "--megabytes", str(megabytes),
                   "--saves", str(saves), "--dir", str(workdir), "--out", str(out)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"checkpoint bench at {size} ranks failed:\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
        for mode in result["modes"]:
            last_write = mode["write_s"][-1]
            mode["mb_per_s"] = mode["bytes_on_disk"] / 1e6 / last_write
            mode["fraction_of_disk"] = mode["mb_per_s"] / disk
            print(f"{size} ranks  {mode['format']:4} {'background' if mode['background'] else 'sync':10}  "
                  f"stall {', '.join(f'{s:.3f}' for s in mode['stall_s'])} s  "
                  f"write {', '.join(f'{s:.3f}' for s in mode['write_s'])} s  "
                  f"{mode['bytes_on_disk'] / 1e6:.0f} MB  {mode['mb_per_s']:.0f} MB/s = "
                  f"{mode['fraction_of_disk']:.2f} of the disk", flush=True)
        rows.append(result)
    section = {"disk_write_mb_s": disk, "megabytes": megabytes, "saves": saves, "runs": rows,
               "note": "stall: time save() blocked; write: until complete on disk (wait() included); "
                       "figures of the last save; fraction: write throughput over the disk's sequential bandwidth"}
    merge_into(output, {"checkpoint_formats": section})
    return section


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--megabytes", type=int, default=400)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    _worker(parser.parse_args(argv))


if __name__ == "__main__":
    main()
