"""``ddp-hpc bench --quick`` (``bench loops``): runs end to end and records every figure (none is asserted:
speed targets live in docs/performance.md, not in tests)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import REQUIRE_ALL, ddp_hpc_command, run


@pytest.mark.slow
@pytest.mark.multiproc
# 14 launches, 3-4 minutes of CI's 2 cores (251 s in the 2026-11-25 run, the suite's longest
# test): an acceptance test (docs/test-world.md); the bench's output handling stays in CI below.
@pytest.mark.acceptance
@pytest.mark.timeout(1200)  # about 3 minutes on a quiet 2-core machine, 9 on a loaded one
def test_quick_bench_writes_json_table_and_plot(tmp_path):
    output, plot = tmp_path / "bench.json", tmp_path / "scaling.png"
    # Start-up at 2 ranks only: each size is seven launches (about 30 s of the suite).
    result = run([*ddp_hpc_command(), "bench", "--quick", "--startup-sizes", "2", "--output", str(output),
                  "--plot", str(plot)], timeout=1100)
    assert result.returncode == 0, result.stderr[-3000:]
    for heading in ("== overhead", "== scaling", "== checkpoint stall", "== start-up", "== communication"):
        assert heading in result.stdout
    data = json.loads(output.read_text())

    # Overhead: whole-epoch means, two alternating rounds, every paired ratio, on both models.
    assert [o["model"] for o in data["overhead"]] == ["compute-bound", "communication-bound"]
    for o in data["overhead"]:
        assert len(o["trainer_mean_step_s"]) == len(o["handwritten_mean_step_s"]) == len(o["paired_ratios"]) == 2
        assert o["ratio_of_means"] > 0 and o["paired_ratio_spread"]["min"] <= o["paired_ratio_spread"]["max"]
    # Scaling: both loops at 1 and 2 ranks, on both models.
    assert {(r["model"], r["loop"], r["world_size"]) for r in data["scaling"]} == {
        (m, loop, n) for m in ("compute-bound", "communication-bound") for loop in ("trainer", "handwritten")
        for n in (1, 2)}
    assert all(r["samples_per_s"] > 0 and r["efficiency"] > 0 for r in data["scaling"])
    # Checkpoint stall: three periodic checkpoints each way, the background writes timed.
    stall = data["stall"]
    assert len(stall["sync_blocked_s"]) == len(stall["async_blocked_s"]) == 3
    assert len(stall["async_write_s"]) >= 3 and stall["checkpoint_bytes"] > 30e6
    # Start-up at the sizes asked for, for every launcher installed here (all of them where CI requires it).
    rows = data["startup"]["rows"]
    assert [r["world_size"] for r in rows] == [2]
    assert "ddp-hpc bench --quick --startup-sizes 2" in output.with_suffix(".md").read_text()
    launchers = {"torchrun"} | {name for name, program in (("mpich", "mpiexec.mpich"), ("openmpi", "mpiexec.openmpi"))
                                if shutil.which(program)}
    if REQUIRE_ALL:
        assert launchers == {"torchrun", "mpich", "openmpi"}
    for row in rows:
        for launcher in launchers:
            assert row[f"{launcher}_bare_s"] and row[f"{launcher}_trainer_s"], (launcher, row)
        assert row["torchrun_handwritten_s"] and "ddp_hpc_own_share_s" in row
        assert "ddp_hpc_own_share_in_process_s" in row
    assert {r["comm_hook"] for r in data["communication"]} == {"none", "fp16"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_what_reaches_rank_0_at_start_up_and_in_the_record_does_not_grow_past_64_ranks(monkeypatch):
    """The harness's byte counts (from the real rank_facts/startup_message/build_record):
    flat from 65 to 520 ranks. (No RNG state reaches rank 0 at a checkpoint: each rank
    writes its own file, which tests/test_own_loop.py reads back rank by rank.)"""
    from ddp_hpc.bench.scale import rank0_bytes
    from ddp_hpc.tracking import record

    # Versions (mpiexec, sinfo, qstat) and packages: seconds here, the same at any N.
    monkeypatch.setattr(record, "versions", lambda: {"python": "3", "torch": "2"})
    monkeypatch.setattr(record, "packages", lambda: ["torch==2"])
    small, large, gathered = rank0_bytes(65), rank0_bytes(520), rank0_bytes(64)
    assert small["startup_facts"] == large["startup_facts"] == 8
    assert abs(large["run_record"] - small["run_record"]) < 64
    assert gathered["startup_facts"] > 64 * 1000  # up to 64 ranks every rank's facts still travel
    assert "per_checkpoint_rng" not in large and large["per_rank_rng_file"] > 1000


def test_each_bench_mode_replaces_its_own_keys_of_bench_json_and_keeps_the_others(tmp_path):
    from ddp_hpc.bench.results_file import merge_into
    output = tmp_path / "results" / "bench.json"
    merge_into(output, {"overhead": [1], "machine": {"cpus": 2}})
    merge_into(output, {"scale": {"rows": [256]}})
    merge_into(output, {"overhead": [2]})
    assert json.loads(output.read_text()) == {"overhead": [2], "machine": {"cpus": 2}, "scale": {"rows": [256]}}
    assert [p.name for p in output.parent.iterdir()] == ["bench.json"]  # no temporary left


@pytest.mark.parametrize("case", ["folder", "not-json", "a-list", "parent-is-a-file"])
def test_an_output_that_cannot_be_read_or_written_is_refused_in_one_line_before_any_work(tmp_path, case):
    """Issue 32: a bad ``--output`` used to surface after minutes of measuring, as a traceback."""
    output = {"folder": tmp_path, "not-json": tmp_path / "notes.txt", "a-list": tmp_path / "list.json",
              "parent-is-a-file": tmp_path / "notes.txt" / "bench.json"}[case]
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "list.json").write_text("[1, 2]\n")
    # Refused before torch is imported (the runner imports it): no measurement has started.
    probe = ("import sys\nfrom ddp_hpc.cli import main\ncode = main(sys.argv[1:])\n"
             "print('torch imported' if 'torch' in sys.modules else 'torch not imported', code)")
    result = run([sys.executable, "-c", probe, "bench", "--quick", "--output", str(output)])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ddp-hpc: error: --output {output}"), result.stderr
    assert result.stdout.split() == ["torch", "not", "imported", "2"], (result.stdout, result.stderr)
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


def test_an_empty_output_as_mktemp_leaves_it_counts_as_no_previous_results(tmp_path):
    from ddp_hpc.bench.results_file import check_output, markdown_path, merge_into
    output = tmp_path / "tmp.Xa9Qw2LmZp"
    output.touch()
    check_output(output)
    merge_into(output, {"overhead": [1]})
    assert json.loads(output.read_text()) == {"overhead": [1]}
    # mktemp's name has a "suffix" of its own: the tables go beside it, not to a shared tmp.md.
    assert markdown_path(output) == tmp_path / "tmp.Xa9Qw2LmZp.md"
    assert markdown_path(tmp_path / "bench.json") == tmp_path / "bench.md"


def test_figures_are_not_lost_when_the_output_cannot_be_written_at_the_end(tmp_path):
    from ddp_hpc.bench.results_file import merge_into
    from ddp_hpc.errors import UserError
    output = tmp_path / "bench.json"
    output.write_text("")
    output.unlink()
    output.mkdir()  # taken over by a folder while the bench ran
    with pytest.raises(UserError) as refused:
        merge_into(output, {"overhead": [1.5]})
    message = str(refused.value)
    assert message.startswith(f"could not write the results to {output}") and "\n" not in message
    rescued = Path(message.rsplit("they are in ", 1)[1])
    try:
        assert json.loads(rescued.read_text()) == {"overhead": [1.5]}
    finally:
        rescued.unlink()


def test_the_snapshot_stall_is_held_against_one_copy_of_the_same_shards_and_leaves_nothing(tmp_path, monkeypatch):
    """``bench checkpoints``' snapshot tier (one rank, in-process): each take timed, and the
    copy it is compared with holds the rank's whole sharded state (weights and Adam's two
    moments), not the weights alone; node-local memory is left empty."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from ddp_hpc.bench.snapshot_stall import measure_snapshot_stall

    monkeypatch.setenv("DDP_HPC_SNAPSHOT_DIR", str(tmp_path / "shm"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ctx = SimpleNamespace(torch_device=torch.device("cpu"), world_size=1, rank=0)
        result = measure_snapshot_stall(ctx, megabytes=4, takes=3, folder=tmp_path / "run")
    finally:
        dist.destroy_process_group()
    assert len(result["stall_s"]) == len(result["background_s"]) == 3
    copy = result["copy_baseline"]
    assert "host-to-host" in copy["baseline"]
    weights = 8 * 353 * 353 * 4  # 8 layers of width sqrt(4 MB / 4 bytes / 8)
    assert 3 * weights <= copy["bytes"] < 3 * weights + 1024 <= result["snapshot_bytes"]
    assert result["stall_over_copy"] == sorted(result["stall_s"])[1] / copy["copy_median_s"]  # the median of 3
    assert not any((tmp_path / "shm").rglob("*.pt"))
