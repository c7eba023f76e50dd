"""Pieces shared by the PBS and SLURM script renderers."""

from __future__ import annotations

from collections.abc import Sequence

from ddp_hpc import __version__
from ddp_hpc.launch.mpi import PROGRAMS
from ddp_hpc.launch.request import JobRequest, export_lines, shell_quote


class ShellVar(str):
    """An argument that is a shell variable (``"$NAME"``), not a literal to quote."""


def render_argv(argv: Sequence[str]) -> str:
    return " ".join(f'"${{{a}}}"' if isinstance(a, ShellVar) else shell_quote(str(a)) for a in argv)


def header_comment(request: JobRequest, scheduler: str) -> str:
    return (f"# Rendered by ddp-hpc {__version__} for cluster profile {request.profile.name!r} ({scheduler}): "
            f"{request.world_size} ranks = {request.nodes} node(s) x {request.per_node}")


def environment_block(request: JobRequest) -> list[str]:
    lines = []
    setup = request.setup_lines()
    if setup:
        lines += ["", "# Set-up", *setup]
    env = request.environment()
    if env:
        lines += ["", "# Environment for every rank", *export_lines(env)]
    return lines


def mpiexec_lookup(flavour: str) -> str:
    """Shell that finds the flavour's mpiexec at run time (names differ between sites)."""
    candidates = " || ".join(f"command -v {name}" for name in PROGRAMS[flavour])
    return f'DDP_HPC_MPIEXEC=$({candidates}) || {{ echo "ddp_hpc: no {flavour} mpiexec on PATH" >&2; exit 1; }}'


def run_folder_line(request: JobRequest, workdir_var: str) -> str:
    """A pointer to the run folder in the job's output (relative folders are under the workdir)."""
    folder = shell_quote(str(request.run_folder))
    if request.run_folder.is_absolute():
        return f'echo "ddp_hpc: run folder "{folder}'
    return f'echo "ddp_hpc: run folder ${{{workdir_var}}}/"{folder}'
