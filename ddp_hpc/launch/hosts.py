"""``ddp-hpc launch --hostfile``: mpiexec over the hosts of a file, outside any scheduler.

The launch is a bash script built from the batch scripts' pieces (launch/script.py): the
common launch loop restarts the ranks (``--max-restarts``), and when the file lists more
hosts than ``--nodes`` the restart leaves out the host where a rank failed and takes a spare
one (``hostfile_leave_out``), recorded in ``RUN/left-out-hosts.jsonl``. The CLI runs the
script in the foreground as a ``local`` job (``schedulers/local``), so ``ddp-hpc status RUN``
shows how it ended and what it left out.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc import __version__
from ddp_hpc.contract import HOSTFILE_VAR, MPIEXEC_VAR, RESTART_COUNT_VAR, RUN_FOLDER_VAR
from ddp_hpc.errors import UserError
from ddp_hpc.launch.local import rank_command
from ddp_hpc.launch.mpi import MpiLaunch, build_mpiexec
from ddp_hpc.specs.request import shell_quote
from ddp_hpc.launch.script import (
    ShellVar,
    hostfile_leave_out,
    launch_lines,
    mpiexec_lookup,
    recording_rank_failures,
    render_argv,
)

HOSTFILE_LAUNCHERS = ("openmpi", "mpich")
#: The launch script, kept in the run folder (rendered again by every launch).
SCRIPT_NAME = "launch.sh"
#: Rank 0's port when ``$MASTER_PORT`` is unset (torch's default).
DEFAULT_MASTER_PORT = 29500
#: What Open MPI must pass on to ranks on other hosts (MPICH passes the whole environment).
FORWARDED = ("PATH", "MASTER_ADDR", "MASTER_PORT", RESTART_COUNT_VAR, RUN_FOLDER_VAR)

_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*$")


def read_hostfile(path: Path) -> tuple[str, ...]:
    """One host name per line (``#`` starts a comment; a repeated name counts once), as in
    PBS's node file. MPI's own ``host:slots`` or ``slots=N`` forms are refused: ``--nproc``
    says how many ranks each host runs."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"--hostfile {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise UserError(f"--hostfile {path}: not a text file of host names") from None
    hosts: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if not _HOST_NAME.match(name):
            raise UserError(f"--hostfile {path}, line {number}: {name!r} is not a host name (one name per line; "
                            "--nproc gives the ranks per host)")
        if name not in hosts:
            hosts.append(name)
    if not hosts:
        raise UserError(f"--hostfile {path} lists no host")
    return tuple(hosts)


@dataclass(frozen=True)
class HostLaunch:
    """``per_node`` ranks on each of the first ``nodes`` hosts; the hosts after those are
    spares that a restart takes in place of one where a rank failed."""

    flavour: str
    hosts: tuple[str, ...]
    nodes: int
    per_node: int
    command: tuple[str, ...]
    run_folder: Path
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.flavour not in HOSTFILE_LAUNCHERS:
            raise UserError(f"--hostfile starts ranks on other hosts through mpiexec: give --launcher "
                            f"{' or '.join(HOSTFILE_LAUNCHERS)} (not {self.flavour})")
        if not 1 <= self.nodes <= len(self.hosts):
            raise UserError(f"--nodes {self.nodes}: the hostfile lists {len(self.hosts)} host(s)")
        if self.per_node < 1:
            raise UserError(f"--nproc {self.per_node} must be >= 1")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts {self.max_restarts} must be >= 0")
        if not self.command:
            raise UserError("no command to launch: give it after '--', e.g. -- ddp-hpc doctor")

    @property
    def spare_nodes(self) -> int:
        return len(self.hosts) - self.nodes

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def leaves_out_failed_hosts(self) -> bool:
        return self.max_restarts > 0 and self.spare_nodes > 0


def render_host_launch(launch: HostLaunch) -> str:
    """The bash script: rank 0's address is the first host of each attempt."""
    argv = rank_command(launch.command)
    if launch.leaves_out_failed_hosts:  # the first rank to fail names the host a restart leaves out
        argv = recording_rank_failures(argv)
    mpiexec = build_mpiexec(MpiLaunch(launch.flavour, launch.nodes, launch.per_node, argv,
                                      hostfile=ShellVar(HOSTFILE_VAR), forward=FORWARDED,
                                      allow_root=os.geteuid() == 0), program=ShellVar(MPIEXEC_VAR))
    master = ["export MASTER_ADDR=\"$first_host\""]
    leave_out = (hostfile_leave_out(HOSTFILE_VAR, launch.nodes, launch.per_node, master)
                 if launch.leaves_out_failed_hosts else None)
    lines = [
        "#!/bin/bash",
        f"# Rendered by ddp-hpc {__version__} for ddp-hpc launch --hostfile: {launch.world_size} ranks = "
        f"{launch.nodes} host(s) x {launch.per_node}, {launch.spare_nodes} spare",
        "set -euo pipefail",
        f"export {RUN_FOLDER_VAR}={shell_quote(str(launch.run_folder))}",
        f'mkdir -p "${RUN_FOLDER_VAR}"',
        f"{HOSTFILE_VAR}=$(mktemp)",
        f"trap 'rm -f \"${HOSTFILE_VAR}\"' EXIT",
        f"printf '%s\\n' {' '.join(shell_quote(host) for host in launch.hosts)} >\"${HOSTFILE_VAR}\"",
        f'first_host=$(head -n 1 "${HOSTFILE_VAR}")',
        *master,
        f'export MASTER_PORT="${{MASTER_PORT:-{DEFAULT_MASTER_PORT}}}"',
        mpiexec_lookup(launch.flavour),
        f'echo "ddp_hpc: launch $$: {launch.world_size} ranks on {launch.nodes} host(s), rank 0 at '
        f'$MASTER_ADDR:$MASTER_PORT; run folder ${RUN_FOLDER_VAR}" >&2',
        # The job id is this script's PID: the exit file is named after it, as for the local scheduler.
        *launch_lines(launch.max_restarts, render_argv(mpiexec), "$$", requeue=None, trap_signals="USR2 TERM",
                      leave_out=leave_out),
        "",
    ]
    return "\n".join(lines)
