"""A scheduler family added from outside the package (issue 46): tests/data/site_scheduler is a
site's package (a fake LSF) whose ``ddp_hpc.schedulers`` entry point registers a
``SchedulerFamily``. On ``PYTHONPATH`` it is a ``render``/``submit`` family like the built-ins:
its script renders, a fake ``bsub`` takes the job and its id is recorded, with no file of
ddp_hpc edited."""

from __future__ import annotations

import json
import logging
import os
import shlex
import textwrap
from pathlib import Path

import pytest

from conftest import ddp_hpc_command, run
from ddp_hpc.errors import UserError
from ddp_hpc.schedulers import registry

SITE = Path(__file__).parent / "data" / "site_scheduler"
PROFILE = SITE / "lsf-test.yaml"
BUILT_IN = ("pbs", "slurm", "local")


@pytest.fixture
def fresh_registry():
    registry.scheduler_families.cache_clear()
    yield
    registry.scheduler_families.cache_clear()


@pytest.fixture
def site_on_path(monkeypatch, fresh_registry):
    monkeypatch.syspath_prepend(str(SITE))


def test_the_built_in_families_come_from_entry_points(fresh_registry):
    from importlib.metadata import entry_points

    from ddp_hpc.entry_points import is_own

    declared = {point.name: point.value for point in entry_points(group=registry.GROUP) if is_own(point)}
    assert declared == {name: f"ddp_hpc.schedulers.{name}:FAMILY" for name in BUILT_IN}
    assert tuple(registry.families()) == BUILT_IN
    assert registry.families()["slurm"] == ("submitit", "sbatch")
    with pytest.raises(UserError, match=r"no scheduler submits to 'lsf' clusters: choose one of pbs, slurm, local"):
        registry.scheduler_for("lsf")


def test_a_site_family_is_listed_after_the_built_ins(site_on_path):
    from ddp_hpc.cli import build_parser

    assert tuple(registry.families()) == (*BUILT_IN, "lsf")
    assert registry.families()["lsf"] == ("lsf",) and registry.default_profile("lsf") is None
    assert type(registry.scheduler_for("lsf")).__module__ == "lsf_site.backend"
    assert tuple(registry.REGISTRY) == (*BUILT_IN, "lsf")
    args = build_parser().parse_args(["cluster", "which", "--scheduler", "lsf"])  # every list of families has it
    assert args.scheduler == "lsf"


def test_without_ddp_hpc_s_own_entry_points_the_built_ins_come_by_module(site_on_path, monkeypatch):
    """An install older than pyproject.toml's table has no ddp_hpc.schedulers entry points of
    its own: the built-in families come by module (``_BUILT_IN``), a site's still after them."""
    from ddp_hpc import entry_points as loading

    real = loading.entry_points
    monkeypatch.setattr(loading, "entry_points",
                        lambda group: [point for point in real(group=group) if not loading.is_own(point)])
    assert tuple(registry.families()) == (*BUILT_IN, "lsf")
    assert registry.scheduler_families()["local"].default_profile == "local"


def _site_env(extra_path: Path | None = None) -> dict[str, str]:
    env = {"PYTHONPATH": str(SITE)}
    if extra_path is not None:
        env["PATH"] = f"{extra_path}{os.pathsep}{os.environ['PATH']}"
    return env


def test_render_lsf_prints_its_bsub_script(tmp_path):
    argv = ["render", "lsf", "--cluster", str(PROFILE), "--nodes", "2", "--walltime", "90", "--job-name", "t1",
            "--", "python", "train.py", "--note", "it's a b"]
    result = run([*ddp_hpc_command(), *argv], env=_site_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert script.startswith("#!/bin/bash\n#BSUB -J t1\n#BSUB -n 4\n#BSUB -R \"span[ptile=2]\"\n#BSUB -W 1:30\n"
                             "#BSUB -q normal\n"), script
    # The rank's command, quoted by ddp_hpc's one quoting function, at the end of the launch over LSF's hosts.
    last = script.rstrip().splitlines()[-1]
    assert last.startswith('exec ddp-hpc launch --launcher openmpi --hostfile "${job_hosts}" --nodes 2 --nproc 2 ')
    assert shlex.split(last)[-6:] == ["run", "--", "python", "train.py", "--note", "it's a b"]
    # --dry-run says how the script reaches bsub: on its standard input.
    dry = run([*ddp_hpc_command(), "submit", "lsf", "--cluster", str(PROFILE), "--job-name", "t1", "--dry-run",
               "--", "python", "train.py"], env=_site_env(), cwd=tmp_path)
    assert dry.returncode == 0 and f"# would run: bsub < {tmp_path / 'runs' / 't1' / 'job.lsf'}\n" in dry.stdout, (
        dry.stdout + dry.stderr)
    # Without the site's package the family is refused as any unknown one.
    refused = run([*ddp_hpc_command(), *argv], cwd=tmp_path)
    assert refused.returncode == 2 and "invalid choice: 'lsf'" in refused.stderr, refused.stderr


def test_a_profile_of_a_family_not_installed_is_refused_in_one_line(fresh_registry, tmp_path, capsys):
    from ddp_hpc import cli

    args = cli.parse(["render", "pbs", "--cluster", str(PROFILE), "--run-dir", str(tmp_path), "--", "true"])
    with pytest.raises(UserError, match=r"^cluster profile 'lsf-test' \(.*lsf-test.yaml\): scheduler 'lsf' is none "
                                        r"of the families installed here: pbs, slurm, local \(a site's family"):
        args.func(args)


FAKE_BSUB = """\
#!/bin/sh
# A fake LSF bsub: records its arguments and standard input, answers as bsub does.
{{ echo "$#"; for arg in "$@"; do echo "$arg"; done; }} >"{record}/argv"
cat >"{record}/stdin"
echo 'Job <1234> is submitted to queue <normal>.'
"""


def test_submit_lsf_hands_the_script_to_bsub_and_records_the_job(tmp_path):
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    (bin_dir / "bsub").write_text(textwrap.dedent(FAKE_BSUB).format(record=record))
    (bin_dir / "bsub").chmod(0o755)
    result = run([*ddp_hpc_command(), "submit", "lsf", "--cluster", str(PROFILE), "--job-name", "t2",
                  "--", "python", "train.py"], env=_site_env(bin_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run_folder = tmp_path / "runs" / "t2"
    assert "submitted job 1234 (" in result.stdout and str(run_folder) in result.stdout, result.stdout
    # No arguments: bsub < job.lsf (LSF reads a script's #BSUB lines on stdin only).
    assert (record / "argv").read_text() == "0\n"
    script = run_folder / "job.lsf"
    assert (record / "stdin").read_text() == script.read_text() and "#BSUB -J t2\n" in script.read_text()
    submission = json.loads((run_folder / "submission.json").read_text())
    assert (submission["scheduler"], submission["job_id"]) == ("lsf", "1234")
    assert submission["logs"] == [str(tmp_path / "t2.1234.out"), str(tmp_path / "t2.1234.err")]
    # status asks the family's backend, found by the name the submission recorded.
    (run_folder / "exit-1234").write_text("0\n")
    status = run([*ddp_hpc_command(), "status", str(run_folder)], env=_site_env(bin_dir), cwd=tmp_path)
    assert status.returncode == 0 and "job 1234 (lsf, 2 ranks" in status.stdout, status.stdout + status.stderr
    assert "completed, exit status 0 [exit file: 0]" in status.stdout, status.stdout


def test_a_broken_entry_point_is_left_out_with_one_warning(site_on_path, monkeypatch, tmp_path, caplog, capsys):
    """A site's entry point whose module cannot be imported, one naming something that is not a
    family, and one taking a built-in's name: each is left out (the first two with a warning
    each); the built-ins and the good site family still work."""
    from ddp_hpc import cli

    dist_info = tmp_path / "broken_site-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-site\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[ddp_hpc.schedulers]\nbroken = no_such_site_module:FAMILY\n"
                                               "notafamily = lsf_site.backend:LsfScheduler\n"
                                               "pbs = lsf_site:FAMILY\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="ddp_hpc"):
        assert tuple(registry.families()) == (*BUILT_IN, "lsf")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert any(w.startswith("scheduler family broken (no_such_site_module:FAMILY) cannot be loaded, left out: ")
               for w in warnings), warnings
    assert ("scheduler family notafamily (lsf_site.backend:LsfScheduler) is not a ddp_hpc SchedulerFamily named "
            "notafamily, left out") in warnings
    assert type(registry.scheduler_for("pbs")).__name__ == "PbsScheduler"
    args = cli.parse(["render", "local", "--run-dir", str(tmp_path), "--", "true"])
    assert args.func(args) == 0 and capsys.readouterr().out.startswith("#!/bin/bash\n")


@pytest.fixture
def fresh_jobs():
    from ddp_hpc.environment import jobs

    jobs.site_jobs.cache_clear()
    yield jobs
    jobs.site_jobs.cache_clear()


def test_the_built_in_jobs_are_registered_as_entry_points_and_asked_slurm_first(fresh_jobs):
    from importlib.metadata import entry_points

    from ddp_hpc.entry_points import is_own

    declared = {point.name: point.value for point in entry_points(group=fresh_jobs.GROUP) if is_own(point)}
    assert declared == {"slurm": "ddp_hpc.environment.jobs:SlurmJob", "pbs": "ddp_hpc.environment.jobs:PbsJob"}
    assert [job.name for job in fresh_jobs.scheduler_jobs()] == ["slurm", "pbs"]
    # Slurm's PBS wrappers set both ids: SLURM_JOB_ID is the one sacct, scontrol and scancel know.
    job, variable, job_id = fresh_jobs.current_job({"PBS_JOBID": "12.server", "SLURM_JOB_ID": "12"})
    assert (job.name, variable, job_id) == ("slurm", "SLURM_JOB_ID", "12")
    assert job.requeue_command("12") == ("scontrol", "requeue", "12") and job.requeue_command("") == ()
    assert fresh_jobs.current_job({"PBS_JOBID": "12.server"})[0].requeue_command("12.server") == ()
    assert fresh_jobs.current_job({}) is None
    assert registry.scheduler_families()["slurm"].job.name == "slurm"
    assert registry.scheduler_families()["local"].job is None


def test_a_site_job_names_the_job_id_rank_0s_host_and_the_requeue(site_on_path, fresh_jobs, tmp_path):
    from ddp_hpc.environment.launchers import EnvVarsEnvironment

    hostfile = tmp_path / "hosts"
    hostfile.write_text("c7\nc7\nc9\nc9\n")
    env = {"LSB_JOBID": "4242", "LSB_DJOB_HOSTFILE": str(hostfile)}
    assert [job.name for job in fresh_jobs.scheduler_jobs()] == ["slurm", "pbs", "lsf"]
    job, variable, job_id = fresh_jobs.current_job(env)
    assert (type(job).__module__, variable, job_id) == ("lsf_site.job", "LSB_JOBID", "4242")
    assert job.requeue_command(job_id) == ("brequeue", "4242")
    assert fresh_jobs.job_hosts(env) == ["c7", "c9"]
    assert EnvVarsEnvironment().main_address(env, num_nodes=2) == "c7"
    assert registry.scheduler_families()["lsf"].job.name == "lsf"


def test_ddp_hpc_port_reads_a_site_job_s_id(tmp_path):
    from ddp_hpc.environment.ports import PortRange, derive_port

    clean = {"LSB_JOBID": "4242", "SLURM_JOB_ID": "", "PBS_JOBID": ""}
    found = run([*ddp_hpc_command(), "port"], env={**_site_env(), **clean}, cwd=tmp_path)
    assert found.returncode == 0 and found.stdout.strip() == str(derive_port("4242", PortRange())), found.stderr
    # Without the site's package an LSF job is no job: one line naming every variable asked.
    refused = run([*ddp_hpc_command(), "port"], env=clean, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.strip().endswith(
        "no job id: give one, or run inside a job that sets $SLURM_JOB_ID or $PBS_JOBID"), refused.stderr


FAKE_LSF_COMMANDS = {
    "lsid": "IBM Spectrum LSF Standard 10.1.0.13\n\nMy cluster name is lsfcl\nMy master name is lsfmaster\n",
    "bqueues": "normal 720\nlong 2880\n",
    "bparams": "System default queues for automatic queue selection:\n    DEFAULT_QUEUE = normal\n",
    "lshosts": "n1 64 4\nn2 64 4\n",
    "mpiexec.openmpi": "",  # the launcher the profile names, on PATH (cluster check looks for it)
    "mpirun": "",
}
#: The SLURM test cluster's and Slurm's PBS wrappers' query commands, where the suite runs,
#: answer nothing here: this is an LSF cluster.
NOT_HERE = ("scontrol", "sinfo", "qstat", "pbsnodes")


def test_a_site_family_s_reader_probes_checks_and_picks_its_profile_without_cluster(tmp_path):
    """The fake LSF family's ``ClusterReader`` (tests/data/site_scheduler/lsf_site/probe.py)
    under ``cluster probe --scheduler lsf``, ``cluster check``, ``cluster which`` and ``render``
    without ``--cluster``: the probed profile says what lsid, bqueues, bparams and lshosts
    answered, checks clean against them, names a planted mismatch, and is picked by the
    cluster's name; no file of ddp_hpc names LSF."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for command, output in FAKE_LSF_COMMANDS.items():
        (bin_dir / command).write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}EOF\n")
        (bin_dir / command).chmod(0o755)
    for command in NOT_HERE:
        (bin_dir / command).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / command).chmod(0o755)
    env = _site_env(bin_dir)
    profile = tmp_path / "configs" / "clusters" / "lsfsite.yaml"
    probed = run([*ddp_hpc_command(), "cluster", "probe", "--scheduler", "lsf", "--out", str(profile)], env=env,
                 cwd=tmp_path)
    assert probed.returncode == 0, probed.stderr
    text = profile.read_text()
    assert "from LSF's own\n# answers (lsid, bqueues, bparams -a, lshosts)" in text, text
    for line in ("  cluster_name: lsfcl", "scheduler: lsf", "queue: normal", "ranks_per_node: 4",
                 "devices_per_node: 4", "cpus_per_task: 16", "#   long: 2 nodes, 64 CPUs, ? MB, 4 x gpu, time limit 2880 min"):
        assert f"\n{line}" in text, (line, text)
    assert f"\nlauncher: openmpi  # mpirun at {bin_dir}/mpirun\n" in text, text

    checked = run([*ddp_hpc_command(), "cluster", "check", "lsfsite", "--walltime", "13:00:00"], env=env, cwd=tmp_path)
    assert checked.returncode == 2 and checked.stderr.splitlines() == \
        ["ddp-hpc: cluster check: lsfsite: walltime: 13:00:00 is over queue normal's limit of 720 min"], checked.stderr
    fits = run([*ddp_hpc_command(), "cluster", "check", "lsfsite", "--walltime", "2:00:00"], env=env, cwd=tmp_path)
    assert fits.returncode == 0 and f"lsfsite ({profile}): fits this cluster" in fits.stdout, fits.stdout + fits.stderr

    which = run([*ddp_hpc_command(), "cluster", "which", "--scheduler", "lsf"], env=env, cwd=tmp_path)
    assert which.returncode == 0 and which.stdout.startswith(f"lsfsite ({profile}): ") \
        and "lsfcl" in which.stdout, which.stdout + which.stderr
    rendered = run([*ddp_hpc_command(), "render", "lsf", "--", "python", "train.py"], env=env, cwd=tmp_path)
    assert rendered.returncode == 0 and "#BSUB -q normal\n" in rendered.stdout, rendered.stdout + rendered.stderr
