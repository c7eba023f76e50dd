"""Silent data corruption (ddp_hpc.engine.consistency): the hash sees every flipped bit, the
odd rank is named, and a bit flipped in rank 1's weights ends a real 3-rank torchrun job
naming rank 1, its host and the step (and the per-rank log files of that launch)."""

from __future__ import annotations

import re
import socket
import sys

import pytest
import torch

from conftest import REPO, ddp_hpc_command, run
from ddp_hpc.engine.consistency import WeightsCheck, find_divergence, weights_hash


def test_every_single_bit_flip_changes_the_hash():
    torch.manual_seed(0)
    parameters = [torch.randn(7, 5), torch.randn(5).to(torch.bfloat16), torch.randn(3, dtype=torch.float64)]
    reference = weights_hash(parameters)
    assert weights_hash([p.clone() for p in parameters]) == reference
    for index, parameter in enumerate(parameters):
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[parameter.element_size()]
        for bit in range(8 * parameter.element_size()):
            flipped = [p.clone() for p in parameters]
            flipped[index].view(-1)[-1:].view(ints).bitwise_xor_(torch.tensor(1, dtype=ints) << bit)
            assert weights_hash(flipped) != reference, (index, bit)
    # The same values in another parameter order are another model.
    assert weights_hash([parameters[1], parameters[0], parameters[2]]) != reference


def test_the_odd_rank_is_named_and_a_tie_is_said_to_be_one():
    hosts = ["h1", "h1", "h2", "h2"]
    assert find_divergence([5, 5, 5, 5], hosts, 8) is None
    divergence = find_divergence([5, 5, 9, 5], hosts, 8)
    assert (divergence.odd_ranks, divergence.hosts, divergence.majority) == ((2,), ("h2",), True)
    assert divergence.describe().startswith("silent data corruption: rank 2 (host h2) hold(s) weights that differ "
                                            "from every other rank's at step 8")
    tie = find_divergence([5, 9], ["h1", "h2"], 4)
    assert not tie.majority and tie.odd_ranks == (0, 1)
    assert "no copy has a majority: rank 0 (host h1), rank 1 (host h2)" in tie.describe()


def test_check_is_due_every_n_steps():
    check = WeightsCheck(every=4)
    assert [s for s in range(13) if check.due(s)] == [4, 8, 12]
    with pytest.raises(ValueError):
        WeightsCheck(every=0)


@pytest.mark.multiproc
@pytest.mark.reliability
def test_bit_flipped_in_rank_1_ends_the_job_naming_rank_host_and_step(tmp_path):
    flip_step, every = 5, 4
    callbacks = (f"callbacks=[{{target: 'fault_injection:FlipBitOnRankAtStep', "
                 f"params: {{rank: 1, step: {flip_step}}}}}]")
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                  "--no-python", *ddp_hpc_command(), "train", str(REPO / "configs" / "synthetic.yaml"),
                  "job.params.samples=960", "job.params.val_samples=0", "job.params.input_dim=16",
                  "job.params.hidden=32", "job.params.depth=1", "training.batch_size=8", "training.epochs=1",
                  "logging.progress=never", "checkpoint.every_n_epochs=null", callbacks,
                  f"distributed.weights_check_every={every}", f"logging.run_dir={tmp_path}"],
                 env={"PYTHONPATH": str(REPO / "tests")}, timeout=240)
    assert result.returncode != 0, result.stderr
    found = re.findall(r"silent data corruption: rank (\d+) \(host (\S+)\) hold\(s\) weights that differ from every "
                       r"other rank's at step (\d+)", result.stderr)
    assert found, result.stderr[-3000:]
    for rank, host, step in found:
        assert rank == "1" and host == socket.gethostname()
        assert flip_step < int(step) <= flip_step + every
    assert "done:" not in result.stdout
    # Every rank's log file in the run folder has its own lines, the error included.
    files = sorted(tmp_path.glob("*/logs/rank-*.log"))
    assert [f.name for f in files] == ["rank-00000.log", "rank-00001.log", "rank-00002.log"]
    for rank, path in enumerate(files):
        text = path.read_text()
        assert re.search(rf"\[rank {rank}\] INFO ddp_hpc\.training\.run_on_rank: rank {rank} of 3 on host", text), text
        assert re.search(rf"\[rank {rank}\] ERROR .*silent data corruption: rank 1 ", text), text
    # The console shows rank 0's INFO lines and the other ranks' errors only.
    assert "[rank 0] INFO" in result.stderr and "[rank 2] INFO" not in result.stderr
    assert "[rank 2] ERROR" in result.stderr
