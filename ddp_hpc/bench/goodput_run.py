"""``ddp-hpc bench goodput``: in-job recovery against restart in place and a requeue, side by side.

Each arm runs the same loop (``bench/goodput_loop.py``: the same steps, a checkpoint every
``checkpoint_every`` steps) on ``world_size`` ranks for ``duration_s`` under a different launch:

- ``in-job``:  ``ddp-hpc launch --recover`` (a lost rank is replaced by a new process, the
  others stay up);
- ``in-job-spare``: the same with ``--warm-spare`` (the replacement is a process waiting
  with torch imported);
- ``restart``: ``ddp-hpc launch --max-restarts`` (every rank is ended and started again, and
  resumes from the newest checkpoint);
- ``requeue``: ``ddp-hpc launch --max-restarts 0`` in a loop (the launch ends; a new one
  resumes from the checkpoint, as a requeued job does, without the scheduler's queue wait).
- ``fsdp2-in-job``, ``fsdp2-in-job-spare``, ``fsdp2-restart``: the arms of the same names
  after the prefix, with the model sharded by
  FSDP2 (the loop's ``--fsdp2``: dcp checkpoints; under ``--recover`` a snapshot of every
  rank's shards every step, in node-local memory and a buddy's): a lost rank's shards come
  back from a buddy's copy, or every rank restarts from the newest checkpoint on disk.

Faults come at a fixed rate: the k-th is due ``k * interval_s`` after training started
(every rank completed a step; the start-up before it counts in the wall time all the
same), and is sent once every rank has completed a step since the previous fault (a fault
lands in training, not in a recovery). With ``step_work_s`` each step ends with that much
of the loop's own work between the optimizer step and ``step_done`` (logging, metrics: a
pause), so that faults land in every part of a step, that window included. Which rank, and whether it is killed (SIGKILL) or frozen
(SIGSTOP, found by ``--hang-timeout``), come from one seeded schedule, the same for every
arm. The arms alternate round by round (a, b, c, a, b, c, ...). ``bench/goodput.py``
computes the figures from the ranks' logs.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddp_hpc.bench.goodput import ArmLogs, Event, Fault, Goodput, Step, goodput, parse_line, timeline
from ddp_hpc.contract import SNAPSHOT_DIR_VAR, atomic_write
from ddp_hpc.engine.recovery.record import read_recoveries
from ddp_hpc.errors import UserError

#: The arms of a model sharded by FSDP2: the DDP arm of the same name after the prefix.
SHARDED_ARMS = ("fsdp2-in-job", "fsdp2-in-job-spare", "fsdp2-restart")
SHARDED_PREFIX = "fsdp2-"
ARMS = ("in-job", "in-job-spare", "restart", "requeue", *SHARDED_ARMS)
DEFAULT_ARMS = ("in-job", "in-job-spare", "restart", "requeue")
FAULT_KINDS = ("kill", "hang", "mixed")
#: Restarts or recoveries a launch may use: more than any run here has faults.
ENOUGH = 1000
#: The launch's line when a rank fails and it ends the others (launch/supervisor.py).
DETECTED = re.compile(r"process \d+ of \d+ \(pid \d+\) exited with status")
#: Seconds the launch has to end after the harness stops it, before its processes are killed.
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class GoodputPlan:
    arms: tuple[str, ...] = DEFAULT_ARMS
    duration_s: float = 300.0
    interval_s: float = 30.0
    world_size: int = 4
    fault: str = "kill"
    seed: int = 0
    rounds: int = 1
    checkpoint_every: int = 50
    hang_timeout_s: float = 5.0
    step_work_s: float = 0.0

    def __post_init__(self) -> None:
        unknown = [arm for arm in self.arms if arm not in ARMS]
        if unknown or not self.arms or len(set(self.arms)) != len(self.arms):
            raise UserError(f"bench goodput --arms {','.join(self.arms)!r}: give some of {', '.join(ARMS)}, each once")
        if self.fault not in FAULT_KINDS:
            raise UserError(f"bench goodput --fault {self.fault!r}: one of {', '.join(FAULT_KINDS)}")
        if self.world_size < 2:
            raise UserError(f"bench goodput --ranks {self.world_size}: at least 2 (a fault needs a survivor)")
        if self.duration_s <= 0 or self.interval_s <= 0 or self.hang_timeout_s <= 0:
            raise UserError("bench goodput: --minutes, --interval and --hang-timeout must be > 0")
        if self.step_work_s < 0:
            raise UserError(f"bench goodput --step-work {self.step_work_s:g}: seconds, at least 0")
        if self.rounds < 1 or self.checkpoint_every < 1:
            raise UserError("bench goodput: --rounds and --checkpoint-every must be >= 1")

    def schedule(self) -> list[tuple[int, str]]:
        """(rank slot, fault kind) of each fault due in one arm's run: the same for every arm."""
        chooser = random.Random(self.seed)
        count = math.ceil(self.duration_s / self.interval_s) - 1  # none due at the stop
        kinds = ["kill", "hang"] if self.fault == "mixed" else [self.fault]
        return [(chooser.randrange(self.world_size), chooser.choice(kinds)) for _ in range(count)]


class LogFollower:
    """Reads the ranks' log files as they grow (whole lines only)."""

    def __init__(self, folder: Path, world_size: int) -> None:
        self.paths = [folder / f"rank-{slot}.log" for slot in range(world_size)]
        self._offsets = [0] * world_size
        self._partial = [""] * world_size
        self.steps: list[Step] = []
        self.events: list[Event] = []

    def poll(self) -> None:
        for slot, path in enumerate(self.paths):
            try:
                with open(path) as handle:
                    handle.seek(self._offsets[slot])
                    text = handle.read()
                    self._offsets[slot] = handle.tell()
            except FileNotFoundError:
                continue
            *lines, self._partial[slot] = (self._partial[slot] + text).split("\n")
            for line in lines:
                parsed = parse_line(slot, line)
                if isinstance(parsed, Step):
                    self.steps.append(parsed)
                elif parsed is not None:
                    self.events.append(parsed)

    def training_since(self, moment: float, slots: int) -> dict[int, Step] | None:
        """Each rank's latest step, if every rank completed one after ``moment``."""
        latest: dict[int, Step] = {}
        for step in reversed(self.steps):
            if step.ended <= moment:
                continue
            if step.slot not in latest:
                latest[step.slot] = step
            if len(latest) == slots:
                return latest
        return None


class Launch:
    """One ``ddp-hpc launch`` of the loop in its own session; its output is kept, and the
    moments of its "exited with status" lines are noted."""

    def __init__(self, argv: list[str], env: dict[str, str], output: Path) -> None:
        self.started = time.time()
        self.process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
        self.detections: list[float] = []
        self._output = output.open("a")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if DETECTED.search(line):
                self.detections.append(time.time())
            self._output.write(f"{time.time():.3f} {line}")
        self._output.flush()

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM (the launch passes it to the ranks: nothing restarts after a stop), then
        SIGKILL to everything in its session (a frozen rank included)."""
        if self.running():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._reader.join(timeout=5)
        self._output.close()


def is_in_job(arm: str) -> bool:
    return arm.removeprefix(SHARDED_PREFIX).startswith("in-job")


def is_sharded(arm: str) -> bool:
    return arm in SHARDED_ARMS


def _launch_argv(arm: str, plan: GoodputPlan, run_dir: Path) -> list[str]:
    in_job = ["--recover", str(ENOUGH), "--max-restarts", str(ENOUGH), "--hang-timeout", f"{plan.hang_timeout_s:g}"]
    flags = {"in-job": in_job, "in-job-spare": [*in_job, "--warm-spare"],
             "restart": ["--max-restarts", str(ENOUGH)],
             "requeue": ["--max-restarts", "0"]}[arm.removeprefix(SHARDED_PREFIX)]
    sharded = ["--fsdp2", "--snapshot-every", "1"] if is_sharded(arm) else []
    return [sys.executable, "-m", "ddp_hpc", "launch", "--nproc", str(plan.world_size), *flags, "--",
            sys.executable, "-m", "ddp_hpc.bench.goodput_loop", "--run-dir", str(run_dir),
            "--checkpoint-every", str(plan.checkpoint_every), "--hang-timeout", f"{plan.hang_timeout_s:g}",
            "--step-work", f"{plan.step_work_s:g}", *sharded]


def _environment(launch_index: int, run_dir: Path) -> dict[str, str]:
    env = {**os.environ, "GOODPUT_LAUNCH": str(launch_index), "OMP_NUM_THREADS": "1",
           # The launch's snapshot folder under one of the arm's own: removed after the arm
           # even where the launch, stopped, could not remove it.
           SNAPSHOT_DIR_VAR: str(_snapshot_folder(run_dir))}
    # The ranks are started as `ddp-hpc run`: the one of this Python.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_arm(arm: str, plan: GoodputPlan, run_dir: Path, progress) -> ArmLogs:
    """One arm for ``plan.duration_s``, with the plan's faults; what its ranks and launches left."""
    run_dir.mkdir(parents=True)
    follower = LogFollower(run_dir / "steps", plan.world_size)
    schedule = plan.schedule()
    output = run_dir / "launch-output.txt"
    launches = [Launch(_launch_argv(arm, plan, run_dir), _environment(0, run_dir), output)]
    started = launches[0].started
    stop_at = started + plan.duration_s
    faults: list[Fault] = []
    training: float | None = None
    while time.time() < stop_at:
        time.sleep(0.1)
        follower.poll()
        if not launches[-1].running():
            if arm != "requeue":
                raise UserError(f"goodput arm {arm}: the launch ended early (exit {launches[-1].process.returncode}); "
                                f"see {output}")
            launches.append(Launch(_launch_argv(arm, plan, run_dir), _environment(len(launches), run_dir), output))
            progress(f"{arm}: launch {len(launches) - 1} started (requeue)")
            continue
        if training is None:
            training = time.time() if follower.training_since(0.0, plan.world_size) else None
            continue
        due = training + (len(faults) + 1) * plan.interval_s
        if time.time() < due or len(faults) >= len(schedule):
            continue
        live = follower.training_since(faults[-1].at if faults else 0.0, plan.world_size)
        if live is None:
            continue
        slot, kind = schedule[len(faults)]
        at = time.time()
        try:
            os.kill(live[slot].pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        except ProcessLookupError:
            continue  # it ended meanwhile (another failure): try again with the next lines
        faults.append(Fault(at, slot, live[slot].pid, kind))
        progress(f"{arm}: {kind} of rank {slot} (pid {live[slot].pid}) at {at - started:.1f} s, step "
                 f"{live[slot].step}")
    stopped = time.time()
    for launch in launches:
        launch.stop()
    follower.poll()
    return ArmLogs(steps=tuple(follower.steps), events=tuple(follower.events), faults=tuple(faults),
                   detections=tuple(t for launch in launches for t in launch.detections),
                   recoveries=tuple(read_recoveries(run_dir)), started=started, stopped=stopped)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(section: dict[str, Any]) -> str:
    plan = section["plan"]
    lines = ["", f"== goodput ({plan['world_size']} ranks, a {plan['fault']} every {plan['interval_s']:g} s, "
                 f"{plan['duration_s']:g} s per arm, checkpoint every {plan['checkpoint_every']} steps"
                 f"{', ' + format(plan['step_work_s'], 'g') + ' s of work after each step' if plan.get('step_work_s') else ''}) =="]
    lines.append(f"{'arm':<8} {'round':>5} {'goodput':>8} {'faults':>6} {'median kill->next step':>23} "
                 f"{'median kill->progress':>22} {'steps counted/completed':>24}")
    for run in section["runs"]:
        r = run["result"]
        lines.append(f"{run['arm']:<8} {run['round']:>5} {r['goodput']:>8.3f} {len(r['faults']):>6} "
                     f"{_fmt(r['median_kill_to_next_step_s']):>21} s {_fmt(r['median_kill_to_progress_s']):>20} s "
                     f"{r['counted_steps']:>11}/{r['completed_steps']}")
    lines.append("per fault (s): detect, re-form, transfer (a sharded model: the roll back to a snapshot), redo "
                 "(steps), kill->next step, kill->progress")
    for run in section["runs"]:
        for index, f in enumerate(run["result"]["faults"]):
            lines.append(f"  {run['arm']:<8} r{run['round']} #{index + 1:<2} {f['kind']:<4} rank {f['slot']}  "
                         f"{_fmt(f['detect_s'])}  {_fmt(f['reform_s'])}  {_fmt(f['transfer_s'])}  "
                         f"{_fmt(f['redo_s'])} ({f['steps_redone']})  {_fmt(f['kill_to_next_step_s'])}  "
                         f"{_fmt(f['kill_to_progress_s'])}" + _rollback(f) + _note(run["arm"], f))
    summary = section["summary"]
    for arm, figures in summary["arms"].items():
        lines.append(f"{arm:<8} all rounds: goodput {figures['goodput']:.3f}, median kill->next step "
                     f"{_fmt(figures['median_kill_to_next_step_s'])} s, kill->progress "
                     f"{_fmt(figures['median_kill_to_progress_s'])} s over {figures['faults']} faults")
    for name, value in summary.get("speedups", {}).items():
        lines.append(f"{name}: {value:.1f}x")
    return "\n".join(lines)


def format_markdown(section: dict[str, Any]) -> str:
    """The same figures as markdown tables (docs/performance.md)."""
    out = ["| arm | goodput | faults | median kill -> next step (s) | median kill -> progress (s) | "
           "steps counted / completed | wall (s) |", "|---|---|---|---|---|---|---|"]
    for run in section["runs"]:
        r = run["result"]
        out.append(f"| {run['arm']} | **{r['goodput']:.3f}** | {len(r['faults'])} | "
                   f"**{_fmt(r['median_kill_to_next_step_s'])}** | {_fmt(r['median_kill_to_progress_s'])} | "
                   f"{r['counted_steps']} / {r['completed_steps']} | {r['wall_s']:.0f} |")
    out += ["", "| arm | # | rank | detect | re-form | transfer | redo (steps) | kill -> next step | "
                "kill -> progress |", "|---|---|---|---|---|---|---|---|---|"]
    for run in section["runs"]:
        for index, f in enumerate(run["result"]["faults"]):
            out.append(f"| {run['arm']} | {index + 1} | {f['slot']} | {_fmt(f['detect_s'])} | {_fmt(f['reform_s'])} | "
                       f"{_fmt(f['transfer_s'])} | {_fmt(f['redo_s'])} ({f['steps_redone']}) | "
                       f"{_fmt(f['kill_to_next_step_s'])} | {_fmt(f['kill_to_progress_s'])}{_rollback(f)}"
                       f"{_note(run['arm'], f)} |")
    return "\n".join(out) + "\n"


def _rollback(fault: dict[str, Any]) -> str:
    """A sharded recovery's record: the snapshot it rolled back to, the steps redone, the
    shards a buddy gave, the launch's detection to the first step after it."""
    if fault.get("snapshot_step") is None:
        return ""
    buddies = ",".join(map(str, fault["from_buddies"])) or "none"
    return (f"  [snapshot of step {fault['snapshot_step']}, {fault['record_redone_steps']} redone, shards of rank "
            f"{buddies} from a buddy, recovered in {_fmt(fault['recover_s'])} s]")


def _note(arm: str, fault: dict[str, Any]) -> str:
    if fault["kill_to_next_step_s"] is None:
        return "  [no step completed after it before the next fault or the stop]"
    if is_in_job(arm) and not fault["recovered_in_job"]:
        return "  [restarted in place: not recovered in the job]"
    return ""


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm over its rounds: goodput (counted time over wall time, summed), the median
    over every fault; and how many times faster each in-job arm is than each other arm of
    the same model (DDP or sharded)."""
    arms: dict[str, Any] = {}
    for arm in dict.fromkeys(run["arm"] for run in runs):
        results = [run["result"] for run in runs if run["arm"] == arm]
        faults = [f for r in results for f in r["faults"]]
        to_next = [f["kill_to_next_step_s"] for f in faults if f["kill_to_next_step_s"] is not None]
        to_progress = [f["kill_to_progress_s"] for f in faults if f["kill_to_progress_s"] is not None]
        arms[arm] = {"goodput": sum(r["counted_s"] for r in results) / sum(r["wall_s"] for r in results),
                     "faults": len(faults), "unrecovered": len(faults) - len(to_next),
                     "median_kill_to_next_step_s": statistics.median(to_next) if to_next else None,
                     "median_kill_to_progress_s": statistics.median(to_progress) if to_progress else None}
    speedups = {}
    for fast in (arm for arm in arms if is_in_job(arm)):
        for arm, figures in arms.items():
            if is_in_job(arm) or is_sharded(arm) != is_sharded(fast):  # a sharded arm against a sharded one
                continue
            for key, label in (("median_kill_to_next_step_s", "next step"), ("median_kill_to_progress_s", "progress")):
                if arms[fast][key] and figures[key]:
                    speedups[f"{fast} vs {arm}, kill->{label}"] = figures[key] / arms[fast][key]
    return {"arms": arms, "speedups": speedups}


def run_goodput(plan: GoodputPlan, output: Path, workdir: Path, plot_path: Path | None = None) -> dict[str, Any]:
    """Every arm, alternating round by round; merged into ``output`` as ``goodput`` (as
    ``goodput_fsdp2`` where every arm is sharded). The
    ranks' logs and each launch's output stay in ``workdir`` (checkpoints and snapshots are removed)."""
    from ddp_hpc.bench.results_file import check_output, merge_into
    from ddp_hpc.bench.runner import machine_info

    check_output(output)

    def progress(message: str) -> None:
        print(f"bench: {message}", file=sys.stderr, flush=True)

    machine = machine_info()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = []
    for round_index in range(plan.rounds):
        for arm in plan.arms:
            run_dir = workdir / f"{stamp}-{arm}-{round_index}"
            progress(f"{arm} round {round_index}: {plan.duration_s:g} s in {run_dir}")
            logs = run_arm(arm, plan, run_dir, progress)
            result: Goodput = goodput(logs)
            _remove_saved_state(run_dir)
            runs.append({"arm": arm, "round": round_index, "run_dir": str(run_dir),
                         "load_average_after": os.getloadavg(), "result": result.to_json(),
                         "timeline": timeline(logs)})
            progress(f"{arm} round {round_index}: goodput {result.goodput:.3f}, {len(result.faults)} faults, median "
                     f"kill->next step {_fmt(result.median_kill_to_next_step_s)} s")
    section = {"command": "ddp-hpc bench goodput", "plan": asdict(plan), "machine": machine,
               "load_average_at_end": os.getloadavg(), "runs": runs, "summary": summarize(runs),
               "note": "goodput: time of the steps that count (not redone; each the median over the ranks of its "
                       "own duration, checkpoint saves excluded) over the arm's wall time; per fault: detect, "
                       "re-form, transfer, redo measured from the ranks' logs and the launch (bench/goodput.py)"}
    # Sharded arms alone keep the DDP arms' figures (and the reverse): a key of their own.
    # Each arm's steps over time (thousands of points) go beside the tables, not into the results file.
    timelines = workdir / f"{stamp}-timelines.json"
    atomic_write(timelines, json.dumps([{"arm": r["arm"], "round": r["round"], **r["timeline"]} for r in runs]))
    section = {**section, "timelines": str(timelines),
               "runs": [{key: value for key, value in r.items() if key != "timeline"} for r in runs]}
    merge_into(output, {"goodput_fsdp2" if all(map(is_sharded, plan.arms)) else "goodput": section})
    section = {**section, "runs": runs}
    tables = workdir / f"{stamp}.md"
    tables.write_text(format_markdown(section))
    print(format_table(section))
    drawn = plot_path is not None and plot(section, plot_path)
    print(f"\nresults: {output}, tables in {tables} (the ranks' logs beside it)"
          + (f", figure {plot_path}" if drawn else ", no figure (matplotlib is not installed)" if plot_path else ""))
    return section


def plot(section: dict[str, Any], path: Path) -> bool:
    """Each arm's steps over time, one panel per arm and round, its faults marked (a kill red,
    a hang orange); False where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = section["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.2 * len(runs) + 0.6), sharex=True, squeeze=False)
    colours = {"kill": "C3", "hang": "C1"}
    for ax, run in zip(axes[:, 0], runs):
        steps = run["timeline"]["steps"]
        ax.plot([at for at, _ in steps], [step for _, step in steps], ".", markersize=2, color="C0")
        for at, kind, slot in run["timeline"]["faults"]:
            ax.axvline(at, color=colours.get(kind, "grey"), linewidth=0.8, linestyle="--")
        result = run["result"]
        ax.set_title(f"{run['arm']} (round {run['round']}): goodput {result['goodput']:.3f}, "
                     f"{len(result['faults'])} faults", fontsize=9, loc="left")
        ax.set_ylabel("step")
    axes[-1, 0].set_xlabel("seconds since the arm's launch (dashed: a fault; red kill, orange hang)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda file: fig.savefig(file, dpi=110, format=path.suffix.lstrip(".") or "png"), durable=False)
    plt.close(fig)
    return True


def _snapshot_folder(run_dir: Path) -> Path:
    base = os.environ.get(SNAPSHOT_DIR_VAR) or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    return Path(base) / f"ddp_hpc-goodput-{os.getpid()}-{run_dir.name}"


def _remove_saved_state(run_dir: Path) -> None:
    """The arm's checkpoints, and the snapshots its stopped ranks left in node-local memory."""
    import shutil

    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    shutil.rmtree(_snapshot_folder(run_dir), ignore_errors=True)
