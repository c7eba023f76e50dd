"""Each launcher object (launch/launchers/) answers what ``ddp-hpc launch`` once decided by
comparing ``spec.mode``/``spec.launcher``: its signal table, where its ranks run, its nodes."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ddp_hpc.errors import UserError
from ddp_hpc.launch.entry import stop_signals
from ddp_hpc.launch.launchers.mpiexec import MpiexecLauncher
from ddp_hpc.launch.launchers.node_supervisor import NodeSupervisor
from ddp_hpc.launch.recovering import RecoveryLimits
from ddp_hpc.launch.spec import LaunchSpec

HUP, TERM, USR1, USR2 = signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2
HOSTS = dict(hostfile=Path("hosts"), hosts=("h1", "h2", "h3"), run_folder=Path("/run"))
SRUN = dict(launcher="srun", run_folder=Path("/run"), allocated=3)
RECOVER = dict(recovery=RecoveryLimits(1))


@pytest.mark.parametrize("given, table", [
    (dict(), {HUP: None, USR2: USR2, TERM: TERM}),
    (dict(**RECOVER), {HUP: None, USR2: USR2, TERM: TERM}),
    (dict(launcher="openmpi"), {HUP: None, USR2: USR2, TERM: USR2}),
    (dict(launcher="mpich"), {HUP: None, USR2: TERM, TERM: TERM}),
    # Node supervisors take the stop through the recovery store, as it came.
    (dict(launcher="mpich", **RECOVER), {HUP: None, USR2: USR2, TERM: TERM}),
    (dict(launcher="pals", stop_signal=USR1, **HOSTS), {HUP: None, USR2: USR2, TERM: USR2, USR1: USR2}),
    (dict(launcher="mpich", stop_signal=USR1, **HOSTS), {HUP: None, USR2: TERM, TERM: TERM, USR1: TERM}),
    (dict(**SRUN), {TERM: None, HUP: None, USR2: USR2}),
    (dict(stop_signal=USR1, torchrun="h:1", **SRUN), {TERM: None, HUP: None, USR1: TERM}),
    (dict(node_supervisor=True, store_address="h:1", **RECOVER), {HUP: None, USR2: USR2, TERM: TERM}),
])
def test_each_launcher_says_which_signal_is_a_stop_and_what_it_passes_on(given, table):
    assert stop_signals(LaunchSpec(("true",), **given)) == table


def test_the_spec_holds_the_launcher_object_and_asks_it_where_the_ranks_run():
    here = LaunchSpec(("true",), launcher="mpich")
    over = LaunchSpec(("true",), launcher="mpich", nodes=2, **HOSTS)
    srun = LaunchSpec(("true",), **SRUN)
    node = LaunchSpec(("true",), launcher="openmpi", node_supervisor=True, store_address="h:1", **RECOVER)
    assert isinstance(here.launcher, MpiexecLauncher) and here.launcher == over.launcher
    assert isinstance(node.launcher, NodeSupervisor)  # --node-supervisor, whatever --launcher says
    assert [spec.node_count for spec in (here, over, srun, node)] == [1, 2, 3, 1]
    assert [spec.launcher.ranks_here(spec) for spec in (here, over, srun, node)] == [True, False, False, True]
    assert here.launcher.needs_scratch_folder(here) and not LaunchSpec(("true",), launcher="openmpi").launcher \
        .needs_scratch_folder(here)


@pytest.mark.parametrize("given, refusal", [
    (dict(launcher="local", **HOSTS), "--hostfile starts ranks on other hosts through mpiexec: give --launcher "
                                      "openmpi or mpich or pals (not local)"),
    (dict(launcher="pals"), "--launcher pals starts ranks over the hosts of a --hostfile"),
    (dict(launcher="openmpi", depth=2, **HOSTS), "--cpu-bind and --depth are Cray PALS's mpiexec options: give "
                                                 "--launcher pals (not openmpi)"),
    (dict(launcher="srun", run_folder=Path("/run")), "--launcher srun runs inside a SLURM allocation"),
    (dict(launcher="openmpi", nodes=2), "--nodes goes with --hostfile or --launcher srun"),
])
def test_each_launcher_checks_its_own_flags(given, refusal):
    with pytest.raises(UserError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        LaunchSpec(("true",), **given)
