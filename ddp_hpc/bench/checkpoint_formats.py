"""``ddp-hpc bench checkpoints``: the checkpoint formats side by side, in one run.

For each world size (one torchrun launch each), a DDP model of ``megabytes`` of weights, on
the device ddp_hpc chooses for ``--device`` (``cuda:LOCAL_RANK`` with nccl on a CUDA host),
is saved by the public ``Checkpointer`` in four ways: ``file`` (rank 0 writes one file) and
``dcp`` (every rank writes its part), each synchronous and in the background. Per save:
the *stall* (how long ``save()`` kept training waiting) and the *write* time (until the
checkpoint was complete on disk, ``wait()`` included). Next to them, two references measured
in the same run: the disk's own sequential write bandwidth on the same folder (one file of
the same size, written in 64 MB blocks and fsync'd), with each format's write throughput as a
fraction of it; and, on each rank, one copy of the model's bytes into host buffers
(``device_clock.host_copy_baseline``: pinned from a GPU, host-to-host on CPU ranks), with
each stall as a multiple of it. A mode that raises is recorded with its error; the others run.
Then, in the same launch, the in-memory snapshot tier of in-job recovery for a sharded model
(``snapshot_stall.py``): its stall against one copy of the rank's shards to host memory.
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

from ddp_hpc.bench.device_clock import host_copy_baseline, synchronize
from ddp_hpc.bench.snapshot_stall import SNAPSHOT_STALL_TARGET
from ddp_hpc.errors import UserError

MODES = (("file", False), ("file", True), ("dcp", False), ("dcp", True))
#: Issue 39: a background save should hold the loop at most this many times one copy to host memory.
BACKGROUND_STALL_TARGET = 1.2


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


def _save_all_modes(args: argparse.Namespace, ctx, ddp, model) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer

    results = []
    for fmt, background in MODES:
        folder = Path(args.dir) / f"{fmt}-{'background' if background else 'sync'}-{ctx.world_size}"
        stall, write, size, error = [], [], 0, None
        try:
            checkpointer = Checkpointer(folder, {"model": ddp}, keep_last=1, background=background, format=fmt)
            for _ in range(args.saves):
                with torch.no_grad():
                    model[0].weight.add_(1e-3)  # a new state each time
                checkpointer.step += 1
                dist.barrier()
                synchronize(ctx.torch_device)
                started = time.perf_counter()
                checkpointer.save()
                stall.append(time.perf_counter() - started)
                checkpointer.wait()
                write.append(time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001  (recorded: the other modes still run)
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        dist.barrier()
        if ctx.is_rank_zero and folder.exists():
            if not error:
                size = _folder_bytes(folder / "checkpoints")
            shutil.rmtree(folder)
        results.append({"format": fmt, "background": background, "stall_s": stall, "write_s": write,
                        "bytes_on_disk": size, "error": error})
        dist.barrier()
    return results


def _worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from ddp_hpc.startup.distributed import DistributedOptions, process_group

    # A group even for one rank: DDP and the barriers run as at any size.
    with process_group(DistributedOptions(device=args.device, init_single_process=True)) as ctx:
        layers = 8
        width = int(math.sqrt(args.megabytes * 1e6 / 4 / layers))
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(ctx.torch_device)
        ddp = DistributedDataParallel(model, device_ids=ctx.device.ddp_device_ids)
        baseline = host_copy_baseline([p.detach() for p in model.parameters()])
        results = _save_all_modes(args, ctx, ddp, model)
        del ddp, model  # the snapshot's sharded model takes its place in memory
        snapshot = _snapshot_tier(args, ctx)
        if ctx.is_rank_zero:
            Path(args.out).write_text(json.dumps({
                "world_size": ctx.world_size, "device": str(ctx.torch_device), "backend": ctx.backend,
                "state_bytes": baseline["bytes"], "copy_baseline": baseline, "modes": results,
                "snapshot": snapshot}))
        ctx.barrier()


def _snapshot_tier(args: argparse.Namespace, ctx) -> dict[str, Any]:
    """``snapshot_stall``'s figures of this rank, or its error (the disk formats' figures stand)."""
    import gc

    from ddp_hpc.bench.snapshot_stall import measure_snapshot_stall

    gc.collect()
    try:
        return {"error": None, **measure_snapshot_stall(ctx, args.megabytes, args.saves,
                                                         Path(args.dir) / f"snapshots-{ctx.world_size}")}
    except Exception as exc:  # noqa: BLE001  (recorded, as a failed disk mode is)
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}


def run_checkpoint_formats(world_sizes: tuple[int, ...], megabytes: int, output: Path, workdir: Path,
                           saves: int = 2, device: str = "cpu") -> dict[str, Any]:
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
                   "--saves", str(saves), "--dir", str(workdir), "--out", str(out), "--device", device]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise UserError(f"checkpoint bench at {size} ranks failed: {done.stderr.strip().splitlines()[-3:]}")
        result = json.loads(out.read_text())
        baseline = result["copy_baseline"]
        print(f"{size} ranks on {result['device']} ({result['backend']}): {baseline['baseline']}: "
              f"{baseline['copy_median_s'] * 1e3:.2f} ms ({baseline['bytes'] / 1e6:.0f} MB)", flush=True)
        for mode in result["modes"]:
            name = f"{size} ranks  {mode['format']:4} {'background' if mode['background'] else 'sync':10}"
            if mode["error"]:
                print(f"{name}  failed: {mode['error']}", flush=True)
                continue
            mode["mb_per_s"] = mode["bytes_on_disk"] / 1e6 / mode["write_s"][-1]
            mode["fraction_of_disk"] = mode["mb_per_s"] / disk
            mode["stall_over_copy"] = mode["stall_s"][-1] / baseline["copy_median_s"]
            target = f" (target <= {BACKGROUND_STALL_TARGET})" if mode["background"] else ""
            print(f"{name}  stall {', '.join(f'{s:.3f}' for s in mode['stall_s'])} s "
                  f"= {mode['stall_over_copy']:.2f}x the copy{target}  write {', '.join(f'{s:.3f}' for s in mode['write_s'])} s  "
                  f"{mode['bytes_on_disk'] / 1e6:.0f} MB  {mode['mb_per_s']:.0f} MB/s = "
                  f"{mode['fraction_of_disk']:.2f} of the disk", flush=True)
        _print_snapshot(size, result["snapshot"])
        rows.append(result)
    section = {"disk_write_mb_s": disk, "megabytes": megabytes, "saves": saves, "device": device, "runs": rows,
               "background_stall_target_over_copy": BACKGROUND_STALL_TARGET,
               "snapshot_stall_target_over_copy": SNAPSHOT_STALL_TARGET,
               "note": "stall: time save() blocked; write: until complete on disk (wait() included); "
                       "figures of the last save; fraction: write throughput over the disk's sequential bandwidth; "
                       "stall_over_copy: the last save's stall over the median copy_baseline (measured in the "
                       "same launch; its 'baseline' says which copy); snapshot: in-job recovery's snapshot of "
                       "an FSDP2 model of the same weights with Adam's state, its median stall (Snapshots.take) over "
                       "one copy of the same shards to host memory (its own copy_baseline), rank 0's"}
    merge_into(output, {"checkpoint_formats": section})
    return section


def _print_snapshot(size: int, snapshot: dict[str, Any]) -> None:
    name = f"{size} ranks  snapshot (FSDP2 shards + Adam, in memory)"
    if snapshot["error"]:
        print(f"{name}  failed: {snapshot['error']}", flush=True)
        return
    copy = snapshot["copy_baseline"]
    print(f"{name}  stall {', '.join(f'{s:.3f}' for s in snapshot['stall_s'])} s, median {snapshot['stall_over_copy']:.2f}x "
          f"the copy of its shards ({copy['copy_median_s'] * 1e3:.2f} ms, {copy['bytes'] / 1e6:.0f} MB; target <= "
          f"{SNAPSHOT_STALL_TARGET})  background {', '.join(f'{s:.3f}' for s in snapshot['background_s'])} s  "
          f"{snapshot['snapshot_bytes'] / 1e6:.0f} MB per copy", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--megabytes", type=int, default=400)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    _worker(parser.parse_args(argv))


if __name__ == "__main__":
    main()
