"""The fake LSF's answers to ``ddp-hpc cluster probe|check|which`` (``SchedulerFamily.reader``):
the cluster's name from ``lsid``, the queues and their run limits from ``bqueues``, the default
queue from ``bparams``, the hosts' CPUs and GPUs from ``lshosts``. The output formats are this
fixture's own simplification of LSF's; a real site family would parse its LSF's."""

from __future__ import annotations

import re

from ddp_hpc.schedulers.facts import ClusterFacts, ClusterReader, Gpus, LauncherFound, Partition, Runner, Which

LSID = ("lsid",)
QUEUES = ("bqueues", "-noheader", "-o", "queue_name run_limit")
PARAMS = ("bparams", "-a")
HOSTS = ("lshosts", "-noheader", "-o", "host_name ncpus ngpus")


class LsfReader(ClusterReader):
    commands = "lsid, bqueues, bparams -a, lshosts"
    usual_launcher = "openmpi"

    def cluster_name(self, runner: Runner) -> str | None:
        match = re.search(r"^My cluster name is (\S+)", runner(LSID) or "", re.MULTILINE)
        return match.group(1) if match else None

    def read_cluster(self, runner: Runner, user: str) -> ClusterFacts:
        default = re.search(r"^\s*DEFAULT_QUEUE\s*=\s*(\S+)", runner(PARAMS) or "", re.MULTILINE)
        hosts = [line.split() for line in (runner(HOSTS) or "").splitlines() if len(line.split()) == 3]
        cpus = min((int(h[1]) for h in hosts), default=None)
        gpus = min((int(h[2]) for h in hosts), default=0)
        partitions = []
        for line in (runner(QUEUES) or "").splitlines():
            name, minutes = line.split()
            partitions.append(Partition(name, len(hosts) or None, cpus, None, Gpus(gpus) if gpus else None,
                                        int(minutes) * 60, f"{minutes} min",
                                        default=default is not None and default.group(1) == name))
        return ClusterFacts("lsf", self.cluster_name(runner), tuple(partitions), None,
                            ("accounts: LSF's projects are not listed by any query here",))

    def find_launcher(self, runner: Runner, which: Which) -> LauncherFound:
        path = which("mpirun")
        return LauncherFound("openmpi" if path else None, f"mpirun at {path}" if path else "no mpirun on PATH")
