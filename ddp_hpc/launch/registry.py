"""The launchers ``ddp-hpc launch --launcher NAME`` knows, found through entry points.

Every launcher, the built-in ones too, is an entry point of the group ``ddp_hpc.launchers``
naming its ``Launcher`` class (pyproject.toml)::

    [project.entry-points."ddp_hpc.launchers"]
    flux = "my_site.flux_launcher:FluxLauncher"

so a site's own package adds one without editing ddp_hpc (docs/architecture.md). They are
listed ddp_hpc's first, then the others, each by ``Launcher.listed_at``; a name taken twice
keeps ddp_hpc's, else the first found (``ddp_hpc/entry_points.py``, shared with the scheduler
families).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING

from ddp_hpc.entry_points import Refused, load_entry_points
from ddp_hpc.entry_points import is_own as _own  # noqa: F401  (tests ask which entry points are ddp_hpc's)
from ddp_hpc.errors import UserError

if TYPE_CHECKING:  # base.py asks this module for the launchers over a hostfile
    from ddp_hpc.launch.launchers.base import Launcher

log = logging.getLogger(__name__)

GROUP = "ddp_hpc.launchers"
#: The built-ins, where this install's metadata lacks their entry points (an install older
#: than pyproject.toml's table): the same names, by module.
_BUILT_IN = {"local": "ddp_hpc.launch.launchers.local:LocalLauncher",
             "openmpi": "ddp_hpc.launch.launchers.openmpi:OpenMpiLauncher",
             "mpich": "ddp_hpc.launch.launchers.mpich:MpichLauncher",
             "pals": "ddp_hpc.launch.launchers.pals:PalsLauncher",
             "srun": "ddp_hpc.launch.launchers.srun:SrunLauncher"}


def _launcher(name: str, found: object) -> Launcher:
    launcher = found() if isinstance(found, type) else found
    if getattr(launcher, "name", None) != name or not callable(getattr(launcher, "plan", None)):
        raise Refused(f"is not a ddp_hpc Launcher named {name}")
    return launcher  # type: ignore[return-value]


@lru_cache(maxsize=1)
def launchers() -> dict[str, Launcher]:
    """Every launcher by name: ddp_hpc's first, then the others, each by ``listed_at``."""
    return load_entry_points(GROUP, _BUILT_IN, _launcher, "launcher")


def names() -> tuple[str, ...]:
    """``--launcher``'s choices: every name, then the old ones still accepted."""
    known = launchers()
    return (*known, *(old for launcher in known.values() for old in launcher.old_names))


def hostfile_launchers() -> tuple[str, ...]:
    return tuple(name for name, launcher in launchers().items() if launcher.over_hostfile)


def get(given: str) -> Launcher:
    """The launcher called ``given``; an old name with a warning naming the new one."""
    known = launchers()
    if given in known:
        return known[given]
    for launcher in known.values():
        if given in launcher.old_names:
            log.warning("--launcher %s is now called --launcher %s (the same ranks; the old name still works)",
                        given, launcher.name)
            return launcher
    raise UserError(f"unknown launcher {given!r}: choose one of {', '.join(known)}")


class _Names:
    """``--launcher``'s choices (``names``), read only when the flag is given or the help shown."""

    def __contains__(self, name: object) -> bool:
        return name in names()

    def __iter__(self) -> Iterator[str]:
        return iter(names())


CHOICES = _Names()
