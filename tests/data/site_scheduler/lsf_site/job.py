"""The fake LSF's job as its processes see it: the id LSF sets, the hosts of its host file, the
requeue a user may ask for. Registered in the ``ddp_hpc.jobs`` entry points, so ``ddp-hpc port``,
rank 0's address and ``cluster probe``'s "inside a job" know an LSF job with no file of ddp_hpc edited."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ddp_hpc.environment.jobs import SchedulerJob


class LsfJob(SchedulerJob):
    name = "lsf"
    job_id_variables = ("LSB_JOBID",)
    requeue_argv = ("brequeue",)

    def hosts(self, env: Mapping[str, str]) -> list[str] | None:
        hostfile = env.get("LSB_DJOB_HOSTFILE", "").strip()
        if not hostfile:
            return None
        return list(dict.fromkeys(line.strip() for line in Path(hostfile).read_text().splitlines() if line.strip()))
