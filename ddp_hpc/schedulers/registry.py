"""The scheduler families ``render FAMILY`` and ``submit FAMILY`` know, found through entry
points, and their backends.

Every family, the built-in ones too, is an entry point of the group ``ddp_hpc.schedulers``
naming the ``SchedulerFamily`` in its package (pyproject.toml)::

    [project.entry-points."ddp_hpc.schedulers"]
    lsf = "my_site.lsf:FAMILY"

so a site's own package adds one without editing ddp_hpc (docs/architecture.md). They are
listed ddp_hpc's first, then the others, each by ``SchedulerFamily.listed_at``; a name taken
twice keeps ddp_hpc's (``ddp_hpc/entry_points.py``, shared with the launchers). The CLI asks
``run_opts`` and ``backend_for`` for the options each backend declares (``Scheduler.run_opts``).

A family without a default profile (``slurm``, ``pbs``) takes the profile whose ``match`` fits
this machine (``cluster/which.py``): a generic one would render a script for another cluster."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ddp_hpc.entry_points import Refused, load_entry_points
from ddp_hpc.errors import UserError
from ddp_hpc.schedulers.base import RunOpt, Scheduler, SchedulerFamily
from ddp_hpc.schedulers.facts import ClusterReader

if TYPE_CHECKING:
    from ddp_hpc.specs.profiles import ClusterProfile

GROUP = "ddp_hpc.schedulers"
#: The built-ins, where this install's metadata lacks their entry points (an install older
#: than pyproject.toml's table): the same names, by module.
_BUILT_IN = {"pbs": "ddp_hpc.schedulers.pbs:FAMILY",
             "slurm": "ddp_hpc.schedulers.slurm:FAMILY",
             "local": "ddp_hpc.schedulers.local:FAMILY"}


def _family(name: str, found: object) -> SchedulerFamily:
    if not isinstance(found, SchedulerFamily) or found.name != name:
        raise Refused(f"is not a ddp_hpc SchedulerFamily named {name}")
    return found


@lru_cache(maxsize=1)
def scheduler_families() -> dict[str, SchedulerFamily]:
    """Every family by name: ddp_hpc's first, then the others, each by ``listed_at``."""
    return load_entry_points(GROUP, _BUILT_IN, _family, "scheduler family")


def _get(family: str) -> SchedulerFamily:
    known = scheduler_families()
    try:
        return known[family]
    except KeyError:
        raise UserError(f"no scheduler submits to {family!r} clusters: choose one of {', '.join(known)} (a site's "
                        f"family comes with its package, through the {GROUP} entry points)") from None


class _Registry(Mapping[str, tuple[tuple[type[Scheduler], ...], "str | None"]]):
    """The older view of the families, read-only: family -> (its backends, the default first;
    its default profile)."""

    def __getitem__(self, family: str) -> tuple[tuple[type[Scheduler], ...], str | None]:
        found = scheduler_families()[family]
        return found.backends, found.default_profile

    def __iter__(self) -> Iterator[str]:
        return iter(scheduler_families())

    def __len__(self) -> int:
        return len(scheduler_families())


REGISTRY = _Registry()


def backends() -> dict[str, type[Scheduler]]:
    """Every backend by its name (``pbs``, ``submitit``, ...), in the families' order."""
    return {cls.name: cls for family in scheduler_families().values() for cls in family.backends}


def families() -> dict[str, tuple[str, ...]]:
    """Each family's backend names, the default first."""
    return {name: tuple(cls.name for cls in family.backends) for name, family in scheduler_families().items()}


def default_profile(family: str) -> str | None:
    """The cluster profile ``render``/``submit FAMILY`` use without ``--cluster``; None: the
    one whose ``match`` fits this machine."""
    return _get(family).default_profile


def check_profile_family(profile: ClusterProfile) -> None:
    """Refuse a profile whose ``scheduler`` names no family installed here, in one line."""
    known = scheduler_families()
    if not any(profile.scheduler == name or profile.scheduler in family.old_names for name, family in known.items()):
        raise UserError(f"cluster profile {profile.name!r} ({profile.path or 'no file'}): scheduler "
                        f"{profile.scheduler!r} is none of the families installed here: {', '.join(known)} (a site's "
                        f"family comes with its package, through the {GROUP} entry points)")


def readers() -> dict[str, ClusterReader]:
    """The families ``ddp-hpc cluster probe|check|which`` can read, by name, in the order they
    are asked which scheduler runs here (``ClusterReader.asked_at``)."""
    found = [(name, family.reader) for name, family in scheduler_families().items() if family.reader is not None]
    return {name: reader for name, reader in sorted(found, key=lambda item: item[1].asked_at)}


def reader(family: str) -> ClusterReader:
    """The family's ``ClusterReader``; one line where it has none."""
    found = readers()
    if family not in found:
        raise UserError(f"the {family!r} family has no cluster reader: `cluster probe` and `cluster check` read "
                        f"{' and '.join(found) or 'none'} (a site's family gives its own: SchedulerFamily.reader)")
    return found[family]


def get_scheduler(name: str) -> Scheduler:
    known = backends()
    try:
        return known[name]()
    except KeyError:
        raise UserError(f"unknown scheduler {name!r}: choose one of {', '.join(known)}") from None


def scheduler_for(family: str, *, batch_script: bool = False) -> Scheduler:
    """The family's default backend, or its first that submits a rendered batch script."""
    classes = _get(family).backends
    if batch_script:
        classes = tuple(cls for cls in classes if cls.script_suffix) or classes
    return classes[0]()


def run_opts(family: str, group: str) -> list[RunOpt]:
    """The options the family's backends declare in ``group``, each once, in backend order."""
    found: dict[tuple[str, ...], RunOpt] = {}
    for cls in _get(family).backends:
        for opt in cls.run_opts:
            if opt.group == group:
                found.setdefault(opt.flags, opt)
    return list(found.values())


def backend_for(family: str, options: Mapping[str, Any]) -> Scheduler:
    """The backend that declares a backend option set in ``options`` (``--sbatch``), else
    the family's default."""
    for cls in _get(family).backends:
        if any(options.get(opt.dest) for opt in cls.run_opts if opt.group == "backend"):
            return cls()
    return scheduler_for(family)
