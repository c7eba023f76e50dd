"""``ddp-hpc bench --quick``: runs end to end and records every figure (none is asserted:
speed targets live in docs/performance.md, not in tests)."""

from __future__ import annotations

import json

import pytest

from conftest import ddp_hpc_command, run


@pytest.mark.slow
@pytest.mark.multiproc
def test_quick_bench_writes_json_table_and_plot(tmp_path):
    output, plot = tmp_path / "bench.json", tmp_path / "scaling.png"
    result = run([*ddp_hpc_command(), "bench", "--quick", "--output", str(output), "--plot", str(plot)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for heading in ("== overhead", "== scaling", "== start-up", "== communication"):
        assert heading in result.stdout
    data = json.loads(output.read_text())
    assert data["overhead"]["ratio_of_medians"] > 0
    assert len(data["overhead"]["trainer_step_s"]) == len(data["overhead"]["handwritten_step_s"]) == 1
    assert {(r["model"], r["world_size"]) for r in data["scaling"]} == {
        ("compute-bound", 1), ("compute-bound", 2), ("communication-bound", 1), ("communication-bound", 2)}
    assert all(r["samples_per_s"] > 0 for r in data["scaling"])
    assert data["startup"]["bare_first_all_reduce_s"] and data["startup"]["trainer_first_step_s"]
    assert {r["comm_hook"] for r in data["communication"]} == {"none", "fp16"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
