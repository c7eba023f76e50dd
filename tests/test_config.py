"""Config loading: types, overrides, and bad input refused with the key named."""

from __future__ import annotations

import pytest
import yaml

from ddp_hpc.config import Config, load_config
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.training.job import create_job
from conftest import REPO


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_shipped_configs_load():
    for name in ("digits", "synthetic", "preference"):
        config = load_config(REPO / "configs" / f"{name}.yaml")
        assert config.job.name == name
        create_job(config.job.name, config.job.params)


def test_defaults_without_a_file():
    config = load_config(None)
    assert config == Config()
    assert config.training.batch_size == 32 and config.checkpoint.resume == "auto"


def test_overrides_are_typed_yaml_values(tmp_path):
    config = load_config(write(tmp_path, "training:\n  epochs: 3\n"), [
        "training.batch_size=64", "training.lr=1e-2", "training.grad_clip_norm=null",
        "data.drop_last=true", "job.params.hidden=8", "logging.name=x", "training.scheduler.name=cosine"])
    assert config.training.batch_size == 64 and config.training.lr == 0.01
    assert config.training.epochs == 3 and config.data.drop_last is True
    assert config.job.params == {"hidden": 8} and config.training.scheduler.name == "cosine"


def test_resolved_config_round_trips():
    config = load_config(REPO / "configs" / "digits.yaml", ["training.epochs=2"])
    from ddp_hpc.config_loader import build
    assert build(Config, yaml.safe_load(yaml.safe_dump(config.to_dict()))) == config
    changed = yaml.safe_load(yaml.safe_dump(config.to_dict()))
    changed["training"]["epochs"] = 3  # equality sees one changed value: the check above can fail
    assert build(Config, changed) != config and build(Config, changed).training.epochs == 3


@pytest.mark.parametrize("text,overrides,fragment", [
    ("training:\n  batchsize: 4\n", [], "unknown key 'training.batchsize' (did you mean 'batch_size'?)"),
    ("trainig: {}\n", [], "unknown key 'trainig' (did you mean 'training'?)"),
    ("training:\n  batch_size: -1\n", [], "training.batch_size must be > 0, got -1"),
    ("training:\n  batch_size: 0\n", [], "training.batch_size must be > 0"),
    ("training:\n  grad_accum_steps: 0\n", [], "training.grad_accum_steps must be > 0"),
    ("training:\n  batch_size: '32'\n", [], "training.batch_size: expected int, got '32'"),
    ("training:\n  epochs: 2.5\n", [], "training.epochs: expected int, got 2.5"),
    ("training:\n  lr: fast\n", [], "training.lr: expected float, got 'fast'"),
    ("training:\n  precision: fp8\n", [], "training.precision: expected one of"),
    ("training:\n  scheduler:\n    warmup: -3\n", [], "training.scheduler.warmup must be >= 0"),
    ("data:\n  prefetch_factor: 2\n", [], "data.prefetch_factor needs data.num_workers > 0"),
    ("validation:\n  early_stopping:\n    patience: 0\n", [], "validation.early_stopping.patience must be > 0"),
    ("distributed:\n  backend: mpi\n", [], "distributed.backend: expected one of"),
    ("checkpoint:\n  keep_last: 0\n", [], "checkpoint.keep_last must be > 0"),
    ("logging:\n  name: ../escape\n", [], "logging.name '../escape' must be a plain folder name"),
    ("training: [1, 2]\n", [], "training: expected a mapping of keys"),
    ("- just\n- a list\n", [], "the top level must be a mapping"),
    ("training:\n  epochs: [\n", [], "at line"),
    ("", ["training.batch_size"], "is not KEY=VALUE"),
    ("training:\n  epochs: 3\n", ["training.epochs.x=1"], "training.epochs is not a section"),
    ("", ["=3"], "is not KEY=VALUE"),
])
def test_bad_configs_name_the_key(tmp_path, text, overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), overrides)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.reliability
def test_yaml_tags_that_build_objects_are_refused(tmp_path):
    path = write(tmp_path, "job: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError):
        load_config(path)


@pytest.mark.parametrize("name,params,fragment", [
    ("nosuchpackage.jobs:Job", {}, "cannot import module 'nosuchpackage.jobs'"),
    ("ddp_hpc.builtin_jobs.digits:Nope", {}, "module 'ddp_hpc.builtin_jobs.digits' has no 'Nope'"),
    ("os:path", {}, "is not a ddp_hpc Job subclass"),
    ("digits", {"layers": 3}, "job.params for 'digits'"),
    ("justaname", {}, "is not 'package.module:Name'"),
])
def test_bad_jobs_are_named(name, params, fragment):
    with pytest.raises(ConfigError) as err:
        create_job(name, params)
    assert fragment in str(err.value)


def test_an_unset_checkpoint_format_follows_the_checkpoint_resume_names_or_the_only_format_the_run_folder_holds(
        tmp_path):
    from ddp_hpc.config import checkpoint_format

    assert checkpoint_format(load_config(None, [])) == "file"
    assert checkpoint_format(load_config(None, ["training.strategy=fsdp2"])) == "dcp"
    for named, fmt in [("runs/a/checkpoints/last.dcp", "dcp"), ("runs/a/checkpoints/step-00000030", "dcp"),
                       ("runs/a/checkpoints/step-00000030/.metadata", "dcp"), ("runs/a/checkpoints/last.pt", "file")]:
        for strategy in ("ddp", "fsdp2"):
            config = load_config(None, [f"training.strategy={strategy}", f"checkpoint.resume={named}"])
            assert checkpoint_format(config) == fmt, (named, strategy)
    copied = tmp_path / "kept-for-later"  # a sharded checkpoint copied under a name of one's own
    copied.mkdir()
    (copied / ".metadata").write_bytes(b"")
    assert checkpoint_format(load_config(None, [f"checkpoint.resume={copied}"])) == "dcp"
    # auto: the strategy's default, unless the run folder holds only the other format's checkpoints
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "step-00000004.ranks").mkdir()  # the file format's per-rank parts name no format
    assert checkpoint_format(load_config(None, []), checkpoints) == "file"
    (checkpoints / "step-00000004").mkdir()
    assert checkpoint_format(load_config(None, []), checkpoints) == "dcp"
    (checkpoints / "step-00000004.pt").write_bytes(b"")
    assert checkpoint_format(load_config(None, []), checkpoints) == "file"  # both: the default
    assert checkpoint_format(load_config(None, ["checkpoint.format=dcp"]), checkpoints) == "dcp"
    assert checkpoint_format(load_config(None, ["checkpoint.resume=never"]), tmp_path / "nowhere") == "file"
    (checkpoints / "step-00000004.pt").unlink()
    assert checkpoint_format(load_config(None, ["checkpoint.resume=never"]), checkpoints) == "file"  # a fresh start
