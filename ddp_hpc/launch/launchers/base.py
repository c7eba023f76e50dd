"""``Launcher``: one object per way of starting a launch's ranks (``--launcher NAME``).

Each answers, for its own launcher, what ``ddp-hpc launch`` would otherwise decide by
comparing names: which flags it takes and how they are checked (``check``,
``check_placement``), the nodes an attempt runs on, how it starts an attempt (``plan``: the
``Attempts``, launch/attempts.py, and the launch's end), which signal is a stop and what it
passes on (``stop_signals``), and what ``--dry-run`` prints. How it names a failed rank and
host is its ``Attempts``' (``outcome.NamesFailedHost``); the variables its tasks see are set
there too. ``LaunchSpec`` (launch/spec.py) holds the object; ``entry.launch`` asks it.

One module per launcher in this package, each registered through the ``ddp_hpc.launchers``
entry points (launch/registry.py), so a site's package adds its own the same way.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ddp_hpc.errors import UserError
from ddp_hpc.launch.attempts import Attempts
from ddp_hpc.launch.recovering import Recoverer
from ddp_hpc.launch.restart import LaunchEnd

if TYPE_CHECKING:
    from ddp_hpc.launch.spec import LaunchSpec

#: Each signal the launch handles -> the stop the supervisor passes on, or None: not a stop
#: (the launch ends as on Ctrl-C).
SignalTable = dict[int, "int | None"]


@dataclass(frozen=True)
class Plan:
    """What runs a launch: its attempts, the recovery inside them where the launch itself
    recovers (a ``Recoverer``), and its end."""

    attempts: Attempts
    in_job: Recoverer | None
    end: LaunchEnd


@dataclass(frozen=True)
class Launcher(ABC):
    """One launcher. Subclasses are frozen dataclasses without fields (two of one kind are
    equal, and a ``LaunchSpec`` holding one stays comparable)."""

    #: ``--launcher NAME``.
    name: ClassVar[str] = ""
    #: Names it was called before, still accepted with a warning naming ``name``.
    old_names: ClassVar[tuple[str, ...]] = ()
    #: Its place in lists (``--help``, error messages) among its package's (ddp_hpc's come first).
    listed_at: ClassVar[int] = 100
    #: Starts ranks over the hosts of ``--hostfile`` (mpiexec).
    over_hostfile: ClassVar[bool] = False

    def check(self, spec: LaunchSpec) -> None:
        """The flags only some launchers read, refused where this one does not (one line, exit 2)."""
        if spec.hostfile is not None:
            check_hostfile_flags(spec)
            if not self.over_hostfile:
                from ddp_hpc.launch.registry import hostfile_launchers

                raise UserError(f"--hostfile starts ranks on other hosts through mpiexec: give --launcher "
                                f"{' or '.join(hostfile_launchers())} (not {self.name})")
            return
        refuse_hostfile_only_flags(spec)
        self.check_here(spec)

    def check_here(self, spec: LaunchSpec) -> None:
        """Without ``--hostfile``: the ranks on this machine."""
        if spec.nodes is not None:
            raise UserError("--nodes goes with --hostfile or --launcher srun (a launch on this machine has one node)")
        if spec.stop_signal is not None or spec.requeue or spec.torchrun is not None:
            raise UserError("--stop-signal, --requeue and --torchrun go with --launcher srun (--stop-signal also "
                            "with --hostfile)")

    def check_placement(self, spec: LaunchSpec) -> None:
        """The nodes, and how ranks are placed on them, where the launcher has several."""

    def node_count(self, spec: LaunchSpec) -> int:
        """The nodes each attempt runs on."""
        return spec.nodes if spec.nodes is not None else 1

    def ranks_here(self, spec: LaunchSpec) -> bool:
        """Whether this process's host runs ranks (its device is checked under ``--recover``)."""
        return True

    def starts_node_supervisors(self, spec: LaunchSpec) -> bool:
        """Under ``--recover``: whether its tasks are node supervisors (launch/node.py)."""
        return spec.recovery is not None

    @abstractmethod
    def plan(self, spec: LaunchSpec, folder: Path | None) -> Plan:
        """The attempts and end of ``spec`` (``folder``: the run folder, or a scratch one)."""

    def stop_signals(self, spec: LaunchSpec) -> SignalTable:
        """Each signal the launch handles -> the stop passed on (to the ranks through the
        launcher, or to node supervisors through the recovery store, as it came), or None."""
        through = None if self.starts_node_supervisors(spec) else self.stop_passed_on(spec)
        return {signal.SIGHUP: None, **{signum: through or signum for signum in self.stops(spec)}}

    def stops(self, spec: LaunchSpec) -> set[int]:
        """The signals that ask the ranks to stop."""
        return {signal.SIGUSR2, signal.SIGTERM}

    def stop_passed_on(self, spec: LaunchSpec) -> int | None:
        """What the launch sends the launcher for a stop; None: the signal it got."""
        return None

    def needs_scratch_folder(self, spec: LaunchSpec) -> bool:
        """Whether, without a run folder, the launch makes one of its own (where the ranks say
        they stopped: the launcher's status may lose their 75)."""
        return False

    def keeps_snapshot_folder(self, spec: LaunchSpec) -> bool:
        """Under ``--recover``: whether this launch owns the ranks' snapshot folder."""
        return True

    def restarts(self, spec: LaunchSpec) -> int:
        return spec.max_restarts

    def end(self, spec: LaunchSpec, plan: Plan) -> LaunchEnd:
        """The launch's end, once it is about to start its first attempt."""
        return plan.end

    def attach(self, plan: Plan, supervisor: Any) -> None:
        """Connect what the plan needs of the running ``Supervisor``."""

    def refused(self, spec: LaunchSpec) -> None:
        """The launch failed before it ran (a user's mistake, a file it could not write)."""

    def describe(self, spec: LaunchSpec, attempts: Attempts) -> str:
        """``--dry-run``: what each attempt starts (on this machine: and the restarts)."""
        return (f"# at most {spec.max_restarts} restart(s) after a failure, none after a stop (75)"
                f"{self.describe_nodes(spec)}\n{attempts.describe()}")

    def describe_nodes(self, spec: LaunchSpec) -> str:
        return ""


def check_hostfile_flags(spec: LaunchSpec) -> None:
    """A launch over ``--hostfile``: the flags that go with it, whatever the launcher."""
    if spec.run_folder is None:
        raise UserError("--hostfile needs --run-folder DIR: where the launch records its exit status and "
                        "the hosts it leaves out")
    if spec.requeue or spec.torchrun is not None:
        raise UserError("--requeue and --torchrun go with --launcher srun (a launch over a hostfile "
                        "requeues nothing: it exits 75 after a stop)")
    if spec.job_id is not None and not spec.job_id.strip():
        raise UserError("--job-id is empty: give the scheduler's job id (a PBS script passes "
                        "\"$PBS_JOBID\")")


def refuse_hostfile_only_flags(spec: LaunchSpec) -> None:
    given = [flag for flag, value in (("--mpiexec", spec.mpiexec), ("--cpu-bind", spec.cpu_bind),
                                      ("--depth", spec.depth), ("--host-suffix", spec.host_suffix),
                                      ("--job-id", spec.job_id)) if value is not None]
    if given:
        raise UserError(f"{' and '.join(given)} {'go' if len(given) > 1 else 'goes'} with --hostfile (mpiexec "
                        "over listed hosts)")
