"""What a scheduler says about its cluster (``ddp-hpc cluster probe``), as frozen values.

Each family reads its own commands through its ``ClusterReader`` (``slurm/probe.py``: sinfo,
scontrol, sacctmgr; ``pbs/probe.py``: qstat, pbsnodes; a site's family its own), which its
``SchedulerFamily.reader`` names, through one ``Runner``: the real one runs a read-only
command and returns its output, or ``None`` where the command is missing or fails; the tests
give a fake that answers from recorded outputs. What no command answered is a note, never a
guessed value.
"""

from __future__ import annotations

import logging
import re
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

log = logging.getLogger(__name__)

#: Runs one read-only command; its standard output, or None where it is missing or fails.
Runner = Callable[[Sequence[str]], "str | None"]


def run_readonly(argv: Sequence[str], timeout: float = 30) -> str | None:
    """The real ``Runner``: the scheduler's query commands only (nothing here submits)."""
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("%s: %s", argv[0], exc)
        return None
    if result.returncode != 0:
        log.debug("%s exited %s: %s", " ".join(argv), result.returncode, result.stderr.strip())
        return None
    return result.stdout


@dataclass(frozen=True)
class Gpus:
    """A node's GPUs as the scheduler declares them (SLURM's GRES ``gpu:a100:4``, PBS's ``ngpus``)."""
    count: int
    kind: str = ""  # the GRES type (``a100``, ``mi250x``), "" where none is declared


@dataclass(frozen=True)
class Partition:
    """A SLURM partition or a PBS queue: nodes, per-node CPUs/memory/GPUs, time limit.

    ``None`` where the scheduler did not say (a PBS queue names no node size)."""
    name: str
    nodes: int | None = None
    cpus: int | None = None  # per node
    memory_mb: int | None = None  # per node
    gpus: Gpus | None = None  # per node; None: none declared
    time_limit_s: int | None = None  # None: unlimited or not said (see ``time_limit``)
    time_limit: str = ""  # as the scheduler wrote it ("infinite", "1-00:00:00")
    default: bool = False


@dataclass(frozen=True)
class ClusterFacts:
    """What one family's commands answered, and a note for each thing they did not."""
    scheduler: str  # the family: slurm, pbs
    cluster_name: str | None
    partitions: tuple[Partition, ...]
    accounts: tuple[str, ...] | None  # None: not learned (no accounting, or no command)
    notes: tuple[str, ...] = ()  # what could not be learned, one line each

    @property
    def default_partition(self) -> Partition | None:
        return next((p for p in self.partitions if p.default), None)

    def partition(self, name: str) -> Partition | None:
        return next((p for p in self.partitions if p.name == name), None)


@dataclass(frozen=True)
class LauncherFound:
    launcher: str | None  # a profile's launcher name; None where none is on PATH
    how: str  # what was found, for the profile's comment


#: Where a program is on PATH (``shutil.which``), or None.
Which = Callable[[str], "str | None"]


class ClusterReader(ABC):
    """What ``ddp-hpc cluster probe|check|which`` ask of one scheduler family, read-only: the
    cluster's name, its partitions or queues and accounts, and the launcher on PATH. A
    family's package names its reader in ``SchedulerFamily.reader``; a family without one has
    no ``cluster`` verbs (``local``)."""

    #: What the family calls a partition, in the lines the verbs print ("partition", "queue").
    partition_word: ClassVar[str] = "queue"
    #: The commands it asks, named in the first comment of a probed profile.
    commands: ClassVar[str] = ""
    #: The launcher a probed profile names where none was found on PATH.
    usual_launcher: ClassVar[str] = "mpich"
    #: The order in which the readers are asked which scheduler runs here, lowest first.
    asked_at: ClassVar[int] = 100

    @abstractmethod
    def cluster_name(self, runner: Runner) -> str | None:
        """The scheduler's name for its cluster (a profile's ``match.cluster_name``); None
        where its commands do not answer."""

    def answers(self, runner: Runner) -> bool:
        """Whether this family's scheduler answers here (``cluster probe`` without ``--scheduler``)."""
        return self.cluster_name(runner) is not None

    @abstractmethod
    def read_cluster(self, runner: Runner, user: str) -> ClusterFacts:
        """Everything its query commands answer; what they do not is a note."""

    @abstractmethod
    def find_launcher(self, runner: Runner, which: Which) -> LauncherFound:
        """The launcher a profile of this family names, from what is on PATH."""


_DURATION = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(?:(\d+):)?(\d+)$")


def duration_s(text: str) -> int | None:
    """SLURM/PBS time text in seconds: ``1-02:00:00``, ``02:00:00``, ``30:00``, ``30`` (minutes
    in SLURM's sinfo, so only with a colon or a day is a bare number read); None for
    ``infinite``, ``UNLIMITED``, ``n/a`` and anything else."""
    text = text.strip()
    match = _DURATION.match(text)
    if not match:
        return None
    days, first, second, last = match.groups()
    parts = [int(p) for p in (first, second, last) if p is not None]
    if len(parts) == 1 and days is None:  # a bare number: minutes, as sinfo and sbatch read it
        return parts[0] * 60
    if len(parts) == 1:  # D-HH
        seconds = parts[0] * 3600
    elif len(parts) == 2:  # MM:SS, or D-HH:MM
        seconds = parts[0] * 3600 + parts[1] * 60 if days is not None else parts[0] * 60 + parts[1]
    else:
        seconds = parts[0] * 3600 + parts[1] * 60 + parts[2]
    return seconds + int(days or 0) * 86400
