"""PBS Pro (Aurora, Polaris, generic sites) through a rendered script and ``qsub``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ddp_hpc.specs.request import SubmitRequest, job_name_directive
from ddp_hpc.schedulers.base import DryRun, JobStatus, ScriptScheduler, recover_opt, run_tool, spare_nodes_opt
from ddp_hpc.schedulers.pbs.render import render_pbs
from ddp_hpc.schedulers.pbs.state import pbs_status


class PbsScheduler(ScriptScheduler):
    name = "pbs"
    family = "pbs"
    script_suffix = ".pbs"
    tool = "qsub"
    where = "PBS"
    launchers = ("pals", "mpich", "openmpi")
    run_opts = (
        spare_nodes_opt("runs mpiexec without the node where a rank failed first"),
        recover_opt("ddp-hpc launch --hostfile --recover N: one node supervisor per node"),
    )

    def render(self, request: SubmitRequest) -> str:
        return render_pbs(request)

    def submit_argv(self, script_path: Path) -> list[str]:
        return ["qsub", str(script_path)]

    def after(self, job_id: str) -> list[str]:
        return ["-W", f"depend=afterany:{job_id}"]

    def log_paths(self, dry_run: DryRun, job_ids: Sequence[str]) -> list[Path]:
        # PBS Pro writes NAME.oNUMBER in the submit folder (-j oe merges stderr into it);
        # Slurm's qsub wrapper ignores -N and -j for this: SCRIPT.oNUMBER and SCRIPT.eNUMBER,
        # and SCRIPT.oNUMBER.INDEX for array elements.
        numbers = [job_id.split(".")[0].replace("[]", "") for job_id in job_ids]
        stems = dict.fromkeys((job_name_directive(dry_run.request.name), dry_run.script_path.name))
        suffixes = [f".{e.index}" for e in dry_run.request.elements] or [""]
        return [dry_run.workdir / f"{stem}.{kind}{number}{suffix}" for number in numbers for stem in stems
                for kind in ("o", "e") for suffix in suffixes]

    def element_id(self, job_id: str, index: int) -> str:
        """PBS Pro names subjobs ``123[4].server``; Slurm's qsub wrapper ``123_4``."""
        return job_id.replace("[]", f"[{index}]") if "[]" in job_id else f"{job_id}_{index}"

    def job_status(self, job_id: str, exit_file: Path) -> JobStatus:
        return pbs_status(job_id, exit_file)

    def cancel_jobs(self, job_ids) -> None:
        run_tool(["qdel", *job_ids], "qdel cancels PBS jobs")
