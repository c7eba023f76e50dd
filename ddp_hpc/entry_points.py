"""What other packages add to ddp_hpc through entry points, the built-ins registered the same
way: the launchers (``ddp_hpc.launchers``, ``launch/registry.py``) and the scheduler families
(``ddp_hpc.schedulers``, ``schedulers/registry.py``).

Each group's entry points name objects with a ``listed_at``: ddp_hpc's own come first, then the
others, each by ``listed_at`` (the metadata's order is its installer's); a name taken twice keeps
ddp_hpc's, else the first found; one that cannot be loaded, or that its group refuses, is left
out with a warning. Where this install's metadata lacks ddp_hpc's own entry points (an install
older than its pyproject.toml's table), each group's built-ins are loaded by module instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)


class Listed(Protocol):
    #: Where it is listed among the others of its group from the same package.
    listed_at: int


T = TypeVar("T", bound=Listed)


class Refused(Exception):
    """An entry point's object that is not what its group holds: the message says why."""


def is_own(point: EntryPoint) -> bool:
    """Whether ddp_hpc's own metadata declares ``point``."""
    dist = getattr(point, "dist", None)
    return dist is not None and (dist.metadata["Name"] or "").replace("-", "_").lower() == "ddp_hpc"


def load_entry_points(group: str, built_in: Mapping[str, str], build: Callable[[str, Any], T],
                      what: str) -> dict[str, T]:
    """Every object of ``group`` by name, in the order above. ``build(name, loaded)`` turns what
    an entry point names into the group's object, or raises ``Refused``; ``what`` names one in
    the warnings (``launcher``, ``scheduler family``)."""
    targets = [(point.name, point.value, is_own(point)) for point in entry_points(group=group)]
    if not any(own for _, _, own in targets):
        log.debug("ddp_hpc's own %s entry points are not installed (an install older than its pyproject.toml; "
                  "pip install -e . adds them): the built-ins by module", group)
        targets = [(name, target, True) for name, target in built_in.items()] + targets
    found: dict[str, tuple[bool, T]] = {}
    for name, target, own in sorted(targets, key=lambda item: not item[2]):  # stable: ddp_hpc's win a name
        if name in found:
            continue
        try:
            module, _, attr = target.partition(":")
            loaded = getattr(import_module(module), attr)
        # A site's package that fails on import, however it fails, must not take every verb down with it.
        except Exception as exc:  # noqa: BLE001
            log.warning("%s %s (%s) cannot be loaded, left out: %s", what, name, target, exc)
            continue
        try:
            found[name] = own, build(name, loaded)
        except Refused as exc:
            log.warning("%s %s (%s) %s, left out", what, name, target, exc)
    ordered = sorted(found.items(), key=lambda item: (not item[1][0], item[1][1].listed_at))
    return {name: value for name, (_, value) in ordered}
