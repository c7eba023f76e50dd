"""Issue 12: experiment trackers that survive a kill and resume, progress lines in batch
logs, the run record and the training curves."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env, ddp_hpc_command, require_module
from ddp_hpc.config import load_config
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.startup.distributed import process_group
from ddp_hpc.errors import UserError
from ddp_hpc.tracking import registry
from ddp_hpc.tracking.csv_tracker import read_points
from ddp_hpc.tracking.hub import row_metrics
from ddp_hpc.tracking.progress import ProgressLines, ProgressShape
from ddp_hpc.tracking.record import without_secrets
from ddp_hpc.engine.checkpoint.files import load_checkpoint
from ddp_hpc.training.job import create_job
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.trainer import Trainer

SMALL = ["job.name=synthetic", "job.params.samples=256", "job.params.val_samples=64", "job.params.input_dim=8",
         "job.params.hidden=16", "job.params.depth=1", "training.optimizer=sgd", "training.lr=0.05",
         "training.batch_size=16", "logging.progress=never", "logging.plot=false"]


def launch(tmp_path: Path, nproc: int, config: str, overrides: list[str], *, name: str,
           env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``ddp-hpc train`` on ``nproc`` torchrun ranks, stderr a pipe (not a terminal)."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "ddp_hpc", "train", str(REPO / "configs" / config),
            f"logging.run_dir={tmp_path / 'runs'}", f"logging.name={name}", *overrides]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env=clean_env({"PYTHONPATH": str(REPO / "tests"), **(env or {})}),
                          start_new_session=True)


def fit_in_process(tmp_path: Path, overrides: list[str]) -> dict:
    config = load_config(None, [f"logging.run_dir={tmp_path}", "logging.name=r", *SMALL, *overrides])
    with process_group(environ={}) as ctx:
        return Trainer(create_job(config.job.name, config.job.params), config, ctx, RunFolder(tmp_path / "r")).fit()


# ----- config -------------------------------------------------------------------------------

def test_trackers_default_to_none_and_refuse_unknown_names():
    assert load_config(None).logging.trackers == []
    with pytest.raises(ConfigError, match=r"logging.trackers\[0\]"):
        load_config(None, ["logging.trackers=[neptune]"])
    with pytest.raises(ConfigError, match="twice"):
        load_config(None, ["logging.trackers=[csv,csv]"])


def test_a_tracker_that_is_not_installed_is_one_line_and_exit_2(monkeypatch, capsys):
    from ddp_hpc import cli

    real = registry.importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    config = load_config(None, ["logging.trackers=[csv,wandb]"])  # loading a config checks no package
    with pytest.raises(UserError, match=r"'wandb' package is not installed: pip install 'ddp_hpc\[wandb\]'"):
        registry.check_installed(config.logging.trackers, config.logging.mlflow.tracking_uri)
    # From the command line: exit 2 with one line, before any process group or file.
    code = cli._run(cli.parse(["train", str(REPO / "configs" / "digits.yaml"), "logging.trackers=[wandb]"]))
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "not installed" in err


# ----- a tracker that fails ---------------------------------------------------------------------

def test_a_tracker_that_fails_to_start_is_a_warning_and_training_goes_on(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ddp_hpc"):
        summary = fit_in_process(tmp_path, ["training.epochs=1", "logging.trackers=[mlflow,csv]",
                                            "logging.mlflow.tracking_uri=nosuchscheme://nowhere",
                                            "logging.log_every_n_steps=2"])
    assert summary.epochs_completed == 1
    warnings = [r.getMessage() for r in caplog.records if "tracker mlflow did not start" in r.getMessage()]
    assert len(warnings) == 1
    # The other tracker still logged every second step.
    steps = sorted(s for s, k, _ in read_points(tmp_path / "r" / "tracking" / "metrics.csv") if k == "train/loss")
    assert steps == list(range(2, 17, 2))


# ----- progress lines -------------------------------------------------------------------------

def test_progress_line_says_where_training_stands():
    now = [100.0]
    lines = ProgressLines(ProgressShape(epochs=3, steps_per_epoch=10, total_steps=30, samples_per_step=64),
                          every_s=30, start_step=10, clock=lambda: now[0])
    assert not lines.due()
    now[0] = 130.0
    assert lines.due()
    # 5 steps in 30 s: 1/6 step/s, 64 samples per step; 5 steps left in the epoch, 15 in the run.
    assert lines.line(epoch=1, global_step=15, loss=0.25) == (
        "epoch 2/3  step 5/10 (run 15/30)  11 samples/s  loss 0.2500  ETA epoch 0:00:30, run 0:01:30")


def test_a_log_that_is_not_a_terminal_gets_progress_lines_between_epoch_lines(tmp_path):
    result = subprocess.run(
        [*ddp_hpc_command(), "train", str(REPO / "configs" / "synthetic.yaml"), *SMALL,
         f"logging.run_dir={tmp_path / 'runs'}", "logging.name=p", "training.epochs=2",
         "logging.progress=auto", "logging.progress_every_s=0.001", "checkpoint.every_n_epochs=null"],
        capture_output=True, text=True, timeout=180, env=clean_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    epoch_lines = [i for i, line in enumerate(lines) if "trainer: epoch " in line]
    progress = [i for i, line in enumerate(lines) if "tracking.hub: epoch " in line and "samples/s" in line]
    assert len(epoch_lines) == 2
    assert any(i < epoch_lines[0] for i in progress)
    assert any(epoch_lines[0] < i < epoch_lines[1] for i in progress)
    assert all("ETA epoch" in lines[i] and " loss " in lines[i] for i in progress)

    # The curves of that run (which drew none: logging.plot=false), from the command line.
    assert not (tmp_path / "runs" / "p" / "curves.png").exists()
    plot = subprocess.run([*ddp_hpc_command(), "plot", str(tmp_path / "runs" / "p")], capture_output=True,
                          text=True, timeout=120, env=clean_env(), cwd=tmp_path)
    assert plot.returncode == 0, plot.stderr
    png = tmp_path / "runs" / "p" / "curves.png"
    assert plot.stdout.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    from ddp_hpc.tracking.plot import MatplotlibMissing, plot_run

    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "step": 4, "train_loss": 1.0}) + "\n")
    # As if not installed, also where an earlier test in this worker imported it.
    for name in ["matplotlib", *(name for name in sys.modules if name.startswith("matplotlib."))]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MatplotlibMissing, match="pip install matplotlib"):
        plot_run(run)


def test_plot_draws_train_and_validation_of_every_metric(tmp_path, monkeypatch):
    require_module("matplotlib")
    from ddp_hpc.tracking import plot

    run = tmp_path / "r"
    run.mkdir()
    rows = [{"epoch": e, "step": 10 * e, "lr": 0.1, "train_loss": 1 / e, "val_loss": 1.1 / e,
             "train_accuracy": 0.5 + e / 10, "val_accuracy": 0.4 + e / 10} for e in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"world_size": 4, "effective_batch_size": 256}))
    drawn = {}
    from matplotlib.figure import Figure

    original = Figure.subplots

    def spy(figure, *args, **kwargs):
        drawn["figure"], drawn["axes"] = figure, original(figure, *args, **kwargs)
        return drawn["axes"]

    monkeypatch.setattr(Figure, "subplots", spy)
    path = plot.plot_run(run)
    assert path == run / "curves.png" and path.stat().st_size > 0
    axes = {ax.get_title(): ax for ax in drawn["axes"].flat if ax.get_title()}
    assert set(axes) == {"loss", "accuracy", "lr"}
    for name in ("loss", "accuracy"):
        labels = [line.get_label() for line in axes[name].get_lines()]
        assert labels == ["train (epoch)", "validation"]
        assert axes[name].get_xlabel() == "optimizer step" and axes[name].get_ylabel() == name
    assert drawn["figure"]._suptitle.get_text() == "r: world size 4, effective batch 256"


# ----- the run record ---------------------------------------------------------------------------

def test_secret_names_are_dropped():
    kept = without_secrets({"MY_API_TOKEN": "t", "aws_secret_access_key": "k", "DB_PASSWORD": "p",
                            "SSH_KEYFILE": "x", "HOME": "/root", "SLURM_JOB_ID": "7"})
    assert kept == {"HOME": "/root", "SLURM_JOB_ID": "7"}


@pytest.mark.multiproc
def test_run_record_holds_every_ranks_environment_and_no_secret(tmp_path):
    (tmp_path / "runs" / "rec").mkdir(parents=True)
    (tmp_path / "runs" / "rec" / "job.sbatch").write_text("#!/bin/bash\n#SBATCH -N 1\nsrun ddp-hpc train\n")
    result = launch(tmp_path, 2, "synthetic.yaml", [*SMALL, "training.epochs=1", "training.max_steps=2"],
                    name="rec", env={"MY_API_TOKEN": "hunter2-secret", "DDP_HPC_TEST_MARK": "visible"})
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp_path / "runs" / "rec" / "record").glob("*.json")
    text = path.read_text()
    assert "MY_API_TOKEN" not in text and "hunter2-secret" not in text
    record = json.loads(text)
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    for rank in record["ranks"]:
        assert {"world_size", "local_rank", "master_addr", "source", "host", "device", "backend", "pid"} <= set(rank)
        assert rank["world_size"] == 2
    assert record["environment"]["DDP_HPC_TEST_MARK"] == "visible"
    # The ranks differ in their launcher variables, and only those are repeated.
    assert record["environment_differences"]["1"]["RANK"] == "1"
    assert record["hosts"] == sorted({r["host"] for r in record["ranks"]})
    assert record["config"]["training"]["max_steps"] == 2
    assert record["command_line"][-1] == "training.max_steps=2"
    assert record["job_scripts"] == {"job.sbatch": "#!/bin/bash\n#SBATCH -N 1\nsrun ddp-hpc train\n"}
    assert record["versions"]["torch"] and record["versions"]["python"] and record["versions"]["ddp_hpc"]
    assert any(p.startswith("torch==") for p in record["packages"])
    assert record["git"] is None  # tmp_path is not a repository


def test_a_large_world_writes_one_facts_file_a_rank_and_rank_0_keeps_a_fixed_size_record(tmp_path):
    """Beyond MAX_GATHERED_RANKS the facts do not travel to rank 0: rank 0's own file and the
    record naming the folder, for a world of 4,096 (collectives local: one real process)."""
    from dataclasses import replace

    from ddp_hpc.tracking.hub import RunShape, Tracking
    from ddp_hpc.tracking.record import MAX_GATHERED_RANKS

    config = load_config(None, [f"logging.run_dir={tmp_path}", "logging.name=big", *SMALL])
    with process_group(environ={}) as ctx:
        big = replace(ctx, env=replace(ctx.env, world_size=4096, local_world_size=8, num_nodes=512))
        assert big.world_size > MAX_GATHERED_RANKS
        tracking = Tracking(config, big, RunFolder(tmp_path / "big"))
        tracking.start(RunShape(4096, 16 * 4096, 1, 1, 1), 0, None, [], environ={"DDP_HPC_TEST_MARK": "x"},
                       argv=["ddp-hpc", "train"])
        tracking.wait_for_record()
    (record_path,) = (tmp_path / "big" / "record").glob("*.json")
    record = json.loads(record_path.read_text())
    assert record["world_size"] == 4096 and record["nodes"] == 1  # local_rank 0 counted, alone here
    assert record["ranks"] == [] and record["hosts"] == [] and record["environment_differences"] == {}
    assert record["rank_files"] == f"record/{record_path.stem.rsplit('-step', 1)[0]}-step0.ranks"
    (facts_path,) = (tmp_path / "big" / record["rank_files"]).glob("rank-*.json")
    facts = json.loads(facts_path.read_text())
    assert facts_path.name == "rank-0.json" and facts["world_size"] == 4096
    assert facts["environment"] == {"DDP_HPC_TEST_MARK": "x"}


# ----- every tracker through a kill and a resume ---------------------------------------------

def wandb_history(run: Path) -> tuple[set[str], list[tuple[int, dict]]]:
    from ddp_hpc.tracking import wandb_log

    folders = sorted((run / "tracking" / "wandb").glob("offline-run-*"))
    ids = {folder.name.rsplit("-", 1)[1] for folder in folders}
    rows = []
    for folder in folders:
        (path,) = folder.glob("run-*.wandb")
        rows += wandb_log.history(path)
    return ids, rows


@pytest.mark.multiproc
@pytest.mark.slow
def test_every_tracker_keeps_one_run_through_a_kill_and_resume(tmp_path):
    for tracker in ("tensorboard", "mlflow", "wandb"):
        require_module(tracker)
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # digits on 2 ranks, batch 32: 20 steps per epoch, 40 in all. Checkpoints every 5 steps;
    # the kill comes at step 28, after the killed attempt logged steps 26 and 27.
    common = ["training.epochs=2", "logging.trackers=[tensorboard,mlflow,wandb,csv]", "logging.log_every_n_steps=1",
              "checkpoint.every_n_steps=5", "checkpoint.every_n_epochs=null", "checkpoint.keep_last=10",
              "training.deterministic=true", "logging.progress=never", "logging.plot=false"]
    kill = ["callbacks=[{target: 'fault_injection:KillLaunchAtStep', params: {step: 28}}]"]
    killed = launch(tmp_path, 2, "digits.yaml", [*common, *kill], name="digits")
    assert killed.returncode != 0
    run = tmp_path / "runs" / "digits"
    first = load_checkpoint(run / "checkpoints" / "last.pt")
    assert first["progress"]["global_step"] == 25
    assert set(first["tracking"]["runs"]) == {"tensorboard", "mlflow", "wandb", "csv"}
    csv_steps = [s for s, k, _ in read_points(run / "tracking" / "metrics.csv") if k == "train/loss"]
    assert csv_steps[-1] == 27  # the killed attempt logged past its last checkpoint

    resumed = launch(tmp_path, 2, "digits.yaml", common, name="digits")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and "continuing run" in resumed.stderr
    last = load_checkpoint(run / "checkpoints" / "last.pt")
    assert last["tracking"]["runs"] == first["tracking"]["runs"]
    every_step = list(range(1, 41))

    # TensorBoard: one folder; its own reader hides what the killed attempt logged after step 25.
    assert [p.name for p in (run / "tracking").iterdir() if p.name.startswith("tensorboard")] == ["tensorboard"]
    events = EventAccumulator(str(run / "tracking" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == every_step
    assert [e.step for e in events.Scalars("train/lr")] == every_step
    assert [e.step for e in events.Scalars("val/accuracy")] == [20, 40]
    assert [e.step for e in events.Scalars("test/accuracy")] == [40]

    # MLflow: one run, read back through the client.
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'tracking' / 'mlflow.db'}")
    experiments = client.search_experiments()
    runs = client.search_runs([e.experiment_id for e in experiments])
    assert len(runs) == 1 and runs[0].info.run_id == first["tracking"]["runs"]["mlflow"]
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.params["world_size"] == "2" and runs[0].data.params["effective_batch_size"] == "64"
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")] == every_step
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "val/accuracy")] == [20, 40]

    # W&B offline: one folder per attempt, all of the same run id, whose rows join without
    # a gap or a repeat (what `wandb sync` uploads into the one run).
    ids, rows = wandb_history(run)
    assert ids == {first["tracking"]["runs"]["wandb"]}
    assert len(list((run / "tracking" / "wandb").glob("offline-run-*"))) == 2
    assert [step for step, row in rows if "train/loss" in row] == every_step
    assert [step for step, row in rows if "val/accuracy" in row] == [20, 40]

    # csv: the same axis; the values of the resumed steps are the ones the straight run logs.
    points = read_points(run / "tracking" / "metrics.csv")
    assert [s for s, k, _ in points if k == "train/loss"] == every_step
    assert len(list((run / "record").glob("*.json"))) == 2


def test_epoch_rows_become_tracker_metrics():
    row = {"epoch": 2, "step": 40, "lr": 0.1, "epoch_time_s": 1.5, "samples_per_s": 100.0,
           "train_loss": 0.5, "val_loss": 0.6, "val_accuracy": 0.9}
    assert row_metrics(row) == {"epoch": 2.0, "train/epoch_lr": 0.1, "epoch/epoch_time_s": 1.5,
                                "epoch/samples_per_s": 100.0, "train/epoch_loss": 0.5, "val/loss": 0.6,
                                "val/accuracy": 0.9}


def test_a_resumed_run_neither_repeats_nor_skips_points_the_killed_attempt_logged(tmp_path):
    # 256 samples, batch 16: 16 steps per epoch. The first attempt stops at step 6 with a
    # checkpoint there; then, as a killed attempt would, it logged steps 7 and 8 and half a line.
    common = ["training.epochs=1", "logging.trackers=[csv]", "logging.log_every_n_steps=1",
              "checkpoint.every_n_epochs=null"]
    fit_in_process(tmp_path, [*common, "training.max_steps=6"])
    csv_file = tmp_path / "r" / "tracking" / "metrics.csv"
    with open(csv_file, "a") as handle:
        handle.write("7,train/loss,0.5\n7,train/lr,0.05\n8,train/loss,0.25\n8,train/lr,0.05\n9,train/lo")
    summary = fit_in_process(tmp_path, common)
    assert summary.global_step == 16
    points = read_points(csv_file)
    loss = [(s, v) for s, k, v in points if k == "train/loss"]
    assert [s for s, _ in loss] == list(range(1, 17))
    assert dict(loss)[8] == 0.25  # held from the earlier attempt, not logged again
    assert [s for s, k, _ in points if k == "val/loss"] == [16]
    assert "train/lo\n" not in csv_file.read_text()


def test_mlflow_local_store_needs_sqlalchemy_but_a_server_does_not(monkeypatch):
    real = registry.importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    with pytest.raises(UserError, match="'sqlalchemy' package is not installed: pip install 'ddp_hpc\\[mlflow\\]'"):
        registry.check_installed(["mlflow"], None)
    registry.check_installed(["mlflow"], "http://127.0.0.1:5000")
