"""SLURM through a rendered batch script and ``sbatch`` (srun per rank, or torchrun per node)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ddp_hpc.specs.request import SubmitRequest, job_name_directive
from ddp_hpc.schedulers.base import DryRun, RunOpt, ScriptScheduler, recover_opt, spare_nodes_opt
from ddp_hpc.contract.slurm_job_key import element_key
from ddp_hpc.schedulers.slurm.render import LOG_DIR, render_sbatch
from ddp_hpc.schedulers.slurm.state import SlurmJobs


class SbatchScheduler(SlurmJobs, ScriptScheduler):
    name = "sbatch"
    family = "slurm"
    script_suffix = ".sbatch"
    tool = "sbatch"
    where = "SLURM"
    run_opts = (
        spare_nodes_opt("leaves out the node where a rank failed (a batch script)"),
        recover_opt("a batch script: ddp-hpc launch --launcher srun --recover N"),
        RunOpt(("--sbatch",), "submit a rendered batch script instead of using submitit", "backend",
               {"action": "store_true"}),
        RunOpt(("--torchrun",), "one torchrun per node with a c10d rendezvous, instead of one task per rank "
               "(a batch script)", "backend", {"action": "store_true"},
               request_field="torchrun_per_node"),
    )

    def render(self, request: SubmitRequest) -> str:
        return render_sbatch(request)

    def submit_argv(self, script_path: Path) -> list[str]:
        return ["sbatch", "--parsable", str(script_path)]

    def after(self, job_id: str) -> list[str]:
        return [f"--dependency=afterany:{job_id}"]

    def job_id_from(self, output: str) -> str:
        return output.split(";")[0].strip()  # --parsable: ID[;CLUSTER]

    def prepare(self, dry_run: DryRun) -> None:
        (dry_run.workdir / LOG_DIR).mkdir(exist_ok=True)  # sbatch does not create it

    def log_paths(self, dry_run: DryRun, job_ids: Sequence[str]) -> list[Path]:
        logs, name = dry_run.workdir / LOG_DIR, job_name_directive(dry_run.request.name)
        if dry_run.request.sweep is not None:
            return [logs / f"{name}-{element_key(job_ids[0], e.index)}.out" for e in dry_run.request.elements]
        return [logs / f"{name}-{job_id}.out" for job_id in job_ids]
