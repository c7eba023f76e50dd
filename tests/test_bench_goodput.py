"""``ddp-hpc bench goodput``'s figures, from made-up rank logs (in-process: the harness
itself launches for minutes and is run by hand, docs/performance.md)."""

from __future__ import annotations

import pytest

from ddp_hpc.bench.goodput import ArmLogs, Event, Fault, Step, goodput, parse_line
from ddp_hpc.bench.goodput_run import GoodputPlan
from ddp_hpc.engine.recovery.record import RecoveryEvent
from ddp_hpc.errors import UserError

FIRST, RESTARTED, RECOVERED = (0, 0, 0), (0, 1, 0), (0, 0, 1)


def steps(epoch, numbers, first_end: float, durations=(1.0, 1.2), pids=(100, 101)) -> list[Step]:
    """Both ranks complete ``numbers`` one a second from ``first_end``; rank 1's steps take longer."""
    return [Step(slot, pids[slot], epoch, number, first_end + i - durations[slot], first_end + i)
            for i, number in enumerate(numbers) for slot in (0, 1)]


def restart_logs(stopped: float) -> ArmLogs:
    """Steps 1-10 (ending at 1..10 s, 1.1 s each), rank 0 killed at 10.5 s, the launch sees it at
    11 s; the new attempt's group forms at 15 s, restores step 5 at 16 s, redoes 6-10 (17..21 s)
    and goes on, its steps 0.6 s each."""
    return ArmLogs(
        steps=tuple(steps(FIRST, range(1, 11), 1.0) + steps(RESTARTED, range(6, 16), 17.0, (0.5, 0.7), (200, 201))),
        events=(Event("group", 0, 200, RESTARTED, 0, 14.0), Event("group", 1, 201, RESTARTED, 0, 15.0),
                Event("restored", 0, 200, RESTARTED, 5, 16.0), Event("restored", 1, 201, RESTARTED, 5, 15.5)),
        faults=(Fault(10.5, 0, 100, "kill"),), detections=(11.0,), recoveries=(), started=0.0, stopped=stopped)


def test_a_restart_counts_each_step_once_and_its_cost_splits_into_detect_reform_transfer_redo():
    result = goodput(restart_logs(stopped=26.5))
    # Steps 1-15 count, each once (6-10 in the attempt that redid them), each its ranks' median.
    assert result.counted_steps == 15 and result.completed_steps == 20
    assert result.counted_s == pytest.approx(5 * 1.1 + 10 * 0.6)
    assert result.goodput == pytest.approx((5 * 1.1 + 10 * 0.6) / 26.5)
    (fault,) = result.faults
    assert not fault.recovered_in_job and fault.steps_redone == 5
    assert fault.detect_s == pytest.approx(0.5)      # the launch's line at 11
    assert fault.reform_s == pytest.approx(4.0)      # the last rank's group at 15
    assert fault.transfer_s == pytest.approx(1.0)    # the last rank's restore at 16
    assert fault.redo_s == pytest.approx(5.0)        # steps 6-10 again, until 21
    assert fault.kill_to_next_step_s == pytest.approx(6.5)   # step 6 at 17
    assert fault.kill_to_progress_s == pytest.approx(11.5)   # step 11 at 22
    assert result.median_kill_to_next_step_s == pytest.approx(6.5)


def test_steps_past_the_final_position_are_lost_not_counted():
    # Stopped at 19.5 s, while the new attempt redoes step 8: steps 9 and 10 of the first attempt are lost.
    result = goodput(restart_logs(stopped=19.5))
    assert result.counted_steps == 8 and result.counted_s == pytest.approx(5 * 1.1 + 3 * 0.6)
    assert result.faults[0].kill_to_progress_s is None and result.median_kill_to_progress_s is None


#: The run record of one recovery: the launch saw the loss at 11.3 s.
RECOVERED_AT_11_3 = RecoveryEvent(generation=1, rank=0, host="n0", cause="exit 137 (SIGKILL)", replaced=True,
                                  world_size=2, step=10, detected_at=11.3, group_s=0.2, transfer_s=0.4, recover_s=1.2)


def test_an_in_job_recovery_takes_its_phases_from_the_record_and_redoes_a_step_one_rank_had_finished():
    first = steps(FIRST, range(1, 11), 1.0) + [Step(1, 101, FIRST, 11, 10.0, 11.1)]  # rank 1 one step ahead
    logs = ArmLogs(steps=tuple(first + steps(RECOVERED, range(11, 14), 12.5, (0.5, 0.7), (300, 101))),
                   events=(Event("group", 0, 300, RECOVERED, 1, 11.45),), faults=(Fault(11.2, 0, 100, "kill"),),
                   detections=(), recoveries=(RECOVERED_AT_11_3,), started=0.0, stopped=15.0)
    result = goodput(logs)
    (fault,) = result.faults
    assert fault.recovered_in_job and fault.steps_redone == 1
    assert (fault.detect_s, fault.reform_s, fault.transfer_s) == pytest.approx((0.1, 0.2, 0.2))
    assert fault.redo_s == pytest.approx(12.5 - 11.7)
    assert fault.kill_to_next_step_s == pytest.approx(1.3) and fault.kill_to_progress_s == pytest.approx(2.3)
    assert result.counted_steps == 13 and result.counted_s == pytest.approx(10 * 1.1 + 3 * 0.6)  # 11 as redone


def test_a_fault_without_a_new_group_before_the_stop_has_no_figures():
    logs = ArmLogs(steps=tuple(steps(FIRST, range(1, 5), 1.0)), events=(), faults=(Fault(4.5, 1, 101, "hang"),),
                   detections=(), recoveries=(), started=0.0, stopped=9.0)
    (fault,) = goodput(logs).faults
    assert fault.kill_to_next_step_s is None and fault.detect_s is None and fault.steps_redone == 0


def test_log_lines_are_parsed_and_one_without_every_field_is_skipped():
    assert parse_line(2, "step 7 1 3 2 40 1.5 2.5") == Step(2, 7, (1, 3, 2), 40, 1.5, 2.5)
    assert parse_line(0, "restored 7 1 3 30 9.0") == Event("restored", 0, 7, (1, 3, 0), 30, 9.0)
    assert parse_line(0, "group 7 1 0 2 9.5") == Event("group", 0, 7, (1, 0, 2), 2, 9.5)
    assert parse_line(0, "step 7 1 3 2 40 1.5") is None


def test_every_arm_sees_the_same_seeded_fault_schedule_and_bad_plans_are_refused():
    plan = GoodputPlan(duration_s=300, interval_s=30, world_size=4, fault="mixed", seed=3)
    assert plan.schedule() == GoodputPlan(duration_s=300, interval_s=30, world_size=4, fault="mixed",
                                          seed=3).schedule()
    assert len(plan.schedule()) == 9  # at 30, 60, ... 270 s; none at the stop and {kind for _, kind in plan.schedule()} <= {"kill", "hang"}
    assert plan.schedule() != GoodputPlan(duration_s=300, interval_s=30, world_size=4, fault="mixed",
                                          seed=4).schedule()
    with pytest.raises(UserError, match="bench goodput --arms"):
        GoodputPlan(arms=("in-job", "elastic"))
    with pytest.raises(UserError, match="bench goodput --ranks"):
        GoodputPlan(world_size=1)


def test_the_recoveries_the_benchmark_reads_are_those_the_ranks_wrote(tmp_path):
    """The goodput harness reads each recovery back from the run record as the recovering
    rank 0 wrote it (``engine/recovery/record.py``), in generation order."""
    from dataclasses import replace

    from ddp_hpc.engine.recovery.record import read_recoveries, write_recovery

    later = replace(RECOVERED_AT_11_3, generation=12, detected_at=40.0)
    for event in (later, RECOVERED_AT_11_3):
        write_recovery(tmp_path, event)
    assert read_recoveries(tmp_path) == [RECOVERED_AT_11_3, later]


def test_a_sharded_recovery_shows_the_snapshot_it_rolled_back_to_from_the_record():
    """The FSDP2 arm's faults carry the record's roll back (snapshot step, steps redone, the
    shards a buddy gave) and its time to recover, and the table prints them."""
    from dataclasses import replace

    from ddp_hpc.bench.goodput_run import format_table

    record = replace(RECOVERED_AT_11_3, step=9, snapshot_step=9, redone_steps=1, from_buddies=(0,))
    first = steps(FIRST, range(1, 11), 1.0)
    logs = ArmLogs(steps=tuple(first + steps(RECOVERED, range(10, 14), 12.5, (0.5, 0.7), (300, 101))),
                   events=(), faults=(Fault(11.2, 0, 100, "kill"),), detections=(), recoveries=(record,),
                   started=0.0, stopped=15.0)
    (fault,) = goodput(logs).faults
    assert (fault.snapshot_step, fault.record_redone_steps, fault.from_buddies) == (9, 1, (0,))
    assert fault.recover_s == pytest.approx(1.2) and fault.steps_redone == 1
    unsharded = goodput(replace(logs, recoveries=(RECOVERED_AT_11_3,))).faults[0]
    assert unsharded.snapshot_step is None and unsharded.record_redone_steps is None
    run = {"arm": "fsdp2-in-job", "round": 0, "result": goodput(logs).to_json()}
    section = {"plan": {"world_size": 2, "fault": "kill", "interval_s": 30, "duration_s": 15,
                        "checkpoint_every": 50}, "runs": [run], "summary": {"arms": {}}}
    assert "snapshot of step 9, 1 redone, shards of rank 0 from a buddy, recovered in 1.20 s" in format_table(section)


def test_the_fsdp2_arms_run_the_sharded_loop_and_are_compared_with_each_other_only(tmp_path):
    from ddp_hpc.bench.goodput_run import _launch_argv, summarize

    plan = GoodputPlan(arms=("in-job", "restart", "fsdp2-in-job", "fsdp2-restart"))
    argv = {arm: _launch_argv(arm, plan, tmp_path) for arm in plan.arms}
    assert "--fsdp2" in argv["fsdp2-in-job"] and "--recover" in argv["fsdp2-in-job"]
    assert "--fsdp2" in argv["fsdp2-restart"] and "--recover" not in argv["fsdp2-restart"]
    assert "--fsdp2" not in argv["in-job"] + argv["restart"]

    def run(arm: str, to_next: float) -> dict:
        fault = {"kill_to_next_step_s": to_next, "kill_to_progress_s": to_next}
        return {"arm": arm, "result": {"counted_s": 9.0, "wall_s": 10.0, "faults": [fault]}}

    speedups = summarize([run("in-job", 1.0), run("restart", 6.0), run("fsdp2-in-job", 2.0),
                          run("fsdp2-restart", 20.0)])["speedups"]
    assert speedups == {"in-job vs restart, kill->next step": 6.0, "in-job vs restart, kill->progress": 6.0,
                        "fsdp2-in-job vs fsdp2-restart, kill->next step": 10.0,
                        "fsdp2-in-job vs fsdp2-restart, kill->progress": 10.0}


def test_an_in_job_recovery_without_its_record_has_no_transfer_not_the_first_restore():
    """A recovery that broke before rank 0 wrote its record (the new group's first step
    completed, then a rank failed again): the attempt's restore at start-up, before the fault,
    is not its transfer."""
    logs = ArmLogs(steps=tuple(steps(FIRST, range(1, 11), 1.0) + steps(RECOVERED, range(10, 12), 12.5)),
                   events=(Event("restored", 0, 100, FIRST, 0, 0.5), Event("group", 0, 300, RECOVERED, 1, 11.5)),
                   faults=(Fault(10.5, 0, 100, "kill"),), detections=(), recoveries=(), started=0.0, stopped=14.0)
    (fault,) = goodput(logs).faults
    assert fault.recovered_in_job and fault.transfer_s is None and fault.kill_to_next_step_s == pytest.approx(2.0)


def test_the_timeline_shows_the_redone_steps_and_the_figure_marks_the_fault(tmp_path):
    from ddp_hpc.bench.goodput import timeline
    from ddp_hpc.bench.goodput_run import plot

    logs = restart_logs(stopped=26.5)
    line = timeline(logs)
    # Steps 1-10 at 1..10 s, then the restart's 6-15 at 17..26 s: the step goes back at the fault.
    assert line["steps"][:10] == [[float(i), i] for i in range(1, 11)]
    assert line["steps"][10:] == [[float(17 + i), 6 + i] for i in range(10)]
    assert line["faults"] == [[10.5, "kill", 0]]
    pytest.importorskip("matplotlib")
    section = {"runs": [{"arm": "restart", "round": 0, "timeline": line, "result": goodput(logs).to_json()}]}
    figure = tmp_path / "goodput.png"
    assert plot(section, figure) and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_old_bench_spelling_still_runs_its_mode_with_one_line_naming_the_new(tmp_path):
    from conftest import ddp_hpc_command, run

    output = tmp_path / "b.json"
    old = run([*ddp_hpc_command(), "bench", "--checkpoints", "--checkpoint-saves", "0", "--output", str(output)])
    new = run([*ddp_hpc_command(), "bench", "checkpoints", "--saves", "0", "--output", str(output)])
    refusal = "ddp-hpc: error: bench checkpoints --saves 0: give at least 1"
    assert (new.returncode, new.stderr.strip().splitlines()) == (2, [refusal]), new.stderr
    warning, error = old.stderr.strip().splitlines()
    assert old.returncode == 2 and error == refusal, old.stderr
    assert warning.endswith("ddp-hpc bench --checkpoints is now ddp-hpc bench checkpoints (the same figures; the old "
                            "spelling still works)"), warning
