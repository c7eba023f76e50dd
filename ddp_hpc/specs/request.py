"""What to run where: the typed request every script renderer takes, and shared pieces.

Rendering is pure: a ``SubmitRequest`` in, script text out. Every user-supplied string that
reaches the shell goes through ``shell_quote`` (one physical line, whatever it holds);
values in ``#PBS``/``#SBATCH`` directives (read by the scheduler, not the shell) are
reduced to a safe character set.
"""

from __future__ import annotations

import logging
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ddp_hpc.config import Config, load_config
from ddp_hpc.contract import BACKEND_VAR, DEVICE_VAR, HOST_SUFFIX_VAR
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.specs.profiles import ClusterProfile, check_single_line
from ddp_hpc.specs.sweep import Sweep, SweepElement
from ddp_hpc.stop import StopSignal

log = logging.getLogger(__name__)

_WALLTIME = re.compile(r"^(?:(\d+):)?(\d{1,2}):(\d{2})$")
_DIRECTIVE_UNSAFE = re.compile(r"[^A-Za-z0-9_.:=+,/@%-]")
_ENV_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)


def parse_walltime(text: str) -> tuple[str, int]:
    """``"1:30:00"`` / ``"90:00"`` / ``"45"`` (minutes) -> (``"01:30:00"``, minutes rounded up)."""
    text = text.strip()
    if text.isdigit():
        seconds = int(text) * 60
    else:
        match = _WALLTIME.match(text)
        if not match:
            raise ConfigError(f"--walltime {text!r}: use HH:MM:SS, MM:SS or whole minutes")
        hours, minutes, secs = int(match.group(1) or 0), int(match.group(2)), int(match.group(3))
        if minutes >= 60 and match.group(1) is not None or secs >= 60:
            raise ConfigError(f"--walltime {text!r}: minutes and seconds must be below 60")
        seconds = hours * 3600 + minutes * 60 + secs
    if seconds <= 0:
        raise ConfigError(f"--walltime {text!r} must be longer than zero")
    hms = f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    return hms, -(-seconds // 60)


def directive_value(value: str, what: str) -> str:
    """A value safe inside a scheduler directive line; unsafe characters become ``_``."""
    safe = _DIRECTIVE_UNSAFE.sub("_", value)
    if safe != value:
        log.warning("%s %r contains characters a scheduler directive cannot hold; using %r", what, value, safe)
    return safe or "_"


def job_name_directive(name: str) -> str:
    """PBS and SLURM job names: letters first, at most 63 safe characters."""
    safe = directive_value(name, "job name")
    return (safe if safe[0].isalpha() else f"j{safe}")[:63]


def parse_env_assignments(assignments: Sequence[str]) -> dict[str, str]:
    env = {}
    for text in assignments:
        match = _ENV_ASSIGNMENT.match(text)
        if not match:
            raise ConfigError(f"--env {text!r} is not NAME=VALUE")
        env[match.group(1)] = match.group(2)
    return env


@dataclass(frozen=True)
class TrainPayload:
    """Train a ``Job`` from a config: every rank runs ``ddp-hpc train CONFIG OVERRIDES``."""

    config_path: str
    overrides: tuple[str, ...] = ()

    @cached_property
    def config(self) -> Config:
        """The training config, loaded (and so checked) at render time."""
        return load_config(self.config_path, list(self.overrides))

    @property
    def default_name(self) -> str:
        return self.config.run_name(self.config_path)

    def run_folder(self, name: str) -> Path:
        return Path(self.config.logging.run_dir) / self.config.run_name(self.config_path)

    def rank_command(self, program: Sequence[str]) -> list[str]:
        return [*program, "train", self.config_path, *self.overrides]

    def with_overrides(self, extra: Sequence[str]) -> TrainPayload:
        return TrainPayload(self.config_path, (*self.overrides, *extra))

    def describe(self) -> str:
        return " ".join([self.config_path, *self.overrides])


@dataclass(frozen=True)
class CommandPayload:
    """Run the user's own command on every rank, through ``ddp-hpc run`` (torchrun's
    variables, derived from whichever launcher started the rank)."""

    argv: tuple[str, ...]
    #: Where command jobs keep their run folders (script, logs, submission record).
    run_dir: str = "runs"

    def __post_init__(self) -> None:
        if not self.argv:
            raise ConfigError("no command: give it after '--', e.g. -- python train.py")

    @property
    def default_name(self) -> str:
        """The script's name (``python train.py`` -> ``train``), else the program's."""
        scripts = [Path(a).stem for a in self.argv[1:] if a.endswith(".py")]
        return scripts[0] if scripts else Path(self.argv[0]).name or "command"

    def run_folder(self, name: str) -> Path:
        """``RUN_DIR/NAME``, the name reduced to safe file-name characters."""
        return Path(self.run_dir) / (re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "command")

    def rank_command(self, program: Sequence[str]) -> list[str]:
        return [*program, "run", "--", *self.argv]

    def describe(self) -> str:
        return shlex.join(self.argv)


Payload = TrainPayload | CommandPayload


@dataclass(frozen=True)
class SubmitRequest:
    """What to submit (scheduler side: what render and submit take): a config or a command,
    on which cluster profile, in which shape."""

    payload: Payload
    profile: ClusterProfile
    nodes: int
    walltime: str = "01:00:00"
    ranks_per_node: int | None = None
    account: str | None = None
    queue: str | None = None
    job_name: str | None = None
    #: Extra shell lines run before the launch (e.g. activating an environment).
    setup: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    #: Activate this Python environment in the job (the one rendering the script).
    python_env: str | None = None
    #: SLURM: one torchrun per node (c10d rendezvous) instead of one srun task per rank.
    torchrun_per_node: bool = False
    #: Relaunch every rank inside the same allocation after a failure, at most this often.
    max_restarts: int = 0
    #: SLURM: allocate this many extra nodes; a restart leaves out the node where a rank failed.
    spare_nodes: int = 0
    #: SLURM batch script or PBS script: in-job recovery (``ddp-hpc launch --recover N``): a lost
    #: rank is replaced from the survivors' memory at most this often before a restart in place.
    recover: int = 0
    #: Run ``ddp-hpc doctor --links`` (one rank per node) before the ranks; end the job if it fails.
    preflight: bool = False
    #: Run the cartesian product of these overrides as one array job.
    sweep: Sweep | None = None
    #: Submit this many jobs, each starting when the previous one ended (``afterany``).
    chain: int = 1
    #: The signal the scheduler sends ahead of the job's deadline, and how far ahead (SLURM).
    stop_signal: StopSignal = field(default_factory=StopSignal.default)
    #: Copy the job's Python environment to every node's ``stage_dir`` and run the ranks from there.
    stage_env: bool = False
    #: Node-local folder for the copy (``--stage-dir``).
    stage_dir: str = "/tmp"

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"--nodes {self.nodes} must be >= 1")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts} must be >= 0")
        self.profile.check_ranks_per_node(self.per_node)
        parse_walltime(self.walltime)
        for line in self.setup:
            check_single_line(line, "--setup line")
        if self.recover < 0:
            raise ConfigError(f"--recover {self.recover} must be >= 0")
        if self.spare_nodes < 0:
            raise ConfigError(f"--spare-nodes {self.spare_nodes} must be >= 0")
        if self.spare_nodes and not self.max_restarts:
            raise ConfigError("--spare-nodes needs --max-restarts: spare nodes are used by a restart")
        if self.stage_env and not Path(self.stage_dir).is_absolute():
            raise ConfigError(f"--stage-dir {self.stage_dir!r} must be an absolute path (node-local, e.g. /tmp)")
        if self.chain < 1:
            raise ConfigError(f"--chain {self.chain} must be >= 1")
        if self.sweep is not None and self.chain > 1:
            raise ConfigError("--sweep and --chain cannot be combined: chain each element's run instead")
        if self.sweep is not None and len(self.sweep.elements()) < 2:
            raise ConfigError("--sweep needs at least two elements; give a single value as an override")
        if isinstance(self.payload, TrainPayload):
            self.payload.config  # load and check the training config now, not on the cluster
            for element in self.elements:  # and every element's, before anything is submitted
                try:
                    self.element_payload(element).config
                except ConfigError as exc:
                    raise ConfigError(f"--sweep element {element.index} ({element.describe()}): {exc}") from None

    @property
    def elements(self) -> list[SweepElement]:
        return self.sweep.elements() if self.sweep is not None else []

    def element_overrides(self, element: SweepElement) -> tuple[str, ...]:
        """What a config job's sweep element adds: its values and its own run name."""
        if not isinstance(self.payload, TrainPayload):
            return ()
        name = self.payload.config.run_name(self.payload.config_path)
        return (*element.overrides, f"logging.name={name}-{element.index}")

    def element_payload(self, element: SweepElement) -> Payload:
        if not isinstance(self.payload, TrainPayload):
            return self.payload
        return self.payload.with_overrides(self.element_overrides(element))

    def element_run_folder(self, element: SweepElement) -> Path:
        if isinstance(self.payload, TrainPayload):
            return self.element_payload(element).run_folder(self.name)
        return self.payload.run_folder(f"{self.name}-{element.index}")

    @classmethod
    def build(cls, cluster: str, nodes: int = 1, *, config: str | None = None, overrides: Sequence[str] = (),
              command: Sequence[str] | None = None, run_dir: str = "runs", **options) -> SubmitRequest:
        """A request from plain values: a cluster profile's name (or YAML path) and either a
        config (with overrides) or a command; ``options`` are the other fields."""
        from ddp_hpc.specs.profiles import load_profile

        if (config is None) == (command is None):
            raise ConfigError("give a config or a command, not both")
        payload = CommandPayload(tuple(command), run_dir) if command is not None else TrainPayload(config, tuple(overrides))
        return cls(payload=payload, profile=load_profile(cluster), nodes=nodes, **options)

    @property
    def per_node(self) -> int:
        return self.ranks_per_node or self.profile.ranks_per_node

    @property
    def resolved_account(self) -> str | None:
        """``--account``, else the profile's."""
        return self.account or self.profile.account

    @property
    def resolved_queue(self) -> str | None:
        """``--queue``/``--partition``, else the profile's."""
        return self.queue or self.profile.queue

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def walltime_s(self) -> int:
        hms, _ = parse_walltime(self.walltime)
        hours, minutes, seconds = (int(part) for part in hms.split(":"))
        return hours * 3600 + minutes * 60 + seconds

    @property
    def name(self) -> str:
        return self.job_name or self.payload.default_name

    @property
    def run_folder(self) -> Path:
        return self.payload.run_folder(self.name)

    def rank_command(self, program: Sequence[str] = ("ddp-hpc",)) -> list[str]:
        """The per-rank command (an argument list, quoted when rendered)."""
        return self.payload.rank_command(program)

    def environment(self) -> dict[str, str]:
        """Variables every rank sees: profile presets, the device choice, user extras."""
        env = dict(self.profile.env)
        if self.profile.device != "auto":
            env[DEVICE_VAR] = self.profile.device
        if self.profile.backend != "auto":
            env[BACKEND_VAR] = self.profile.backend
        if self.profile.host_suffix:
            env[HOST_SUFFIX_VAR] = self.profile.host_suffix
        env.update(self.env)
        return env

    def setup_lines(self) -> list[str]:
        lines = list(self.profile.setup)
        if self.python_env:
            lines.append(f"source {shell_quote(str(Path(self.python_env) / 'bin' / 'activate'))}")
        return lines + list(self.setup)


def current_python_env() -> str | None:
    """The virtual environment running ddp-hpc now, to activate in the job."""
    return sys.prefix if sys.prefix != sys.base_prefix else None


def shell_quote(value: str) -> str:
    """``shlex.quote``, but never over several lines: control characters become ``$'\\n'``
    escapes, so no value can start a line of a script (where a scanner might read it as
    a ``#PBS``/``#SBATCH`` directive)."""
    if all(ch.isprintable() for ch in value):
        return shlex.quote(value)
    escaped = []
    for ch in value:
        if ch == "\\":
            escaped.append("\\\\")
        elif ch == "'":
            escaped.append("\\'")
        elif ch.isprintable():
            escaped.append(ch)
        else:
            escaped.extend(f"\\x{byte:02x}" for byte in ch.encode("utf-8", "surrogatepass"))
    return "$'" + "".join(escaped) + "'"


def export_lines(env: Mapping[str, str]) -> list[str]:
    return [f"export {name}={shell_quote(value)}" for name, value in env.items()]


def quote_command(argv: Sequence[str]) -> str:
    return " ".join(shell_quote(str(a)) for a in argv)
