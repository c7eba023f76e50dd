"""The rank side's objects a site's package adds through entry points: ``ClusterEnvironment``
classes (``ddp_hpc.environments``, ``launchers.py``) and ``SchedulerJob`` classes
(``ddp_hpc.jobs``, ``jobs.py``). The bottom layer's own loader: the launch's and the families'
(``ddp_hpc/entry_points.py``) sort and replace built-ins, which these groups never need."""

from __future__ import annotations

import logging
from collections.abc import Collection
from importlib.metadata import entry_points
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def site_objects(group: str, kind: type[T], skip: Collection[str] = ()) -> tuple[T, ...]:
    """An instance of each class (or the object) the group's entry points name, in the
    metadata's order, but those named in ``skip`` (the built-ins). One that cannot be loaded,
    or is not a ``kind``, is left out with a warning."""
    found: list[T] = []
    for point in entry_points(group=group):
        if point.name in skip:
            continue
        try:
            loaded = point.load()
            obj = loaded() if isinstance(loaded, type) else loaded
        except Exception as exc:  # noqa: BLE001 - a site's broken package must not end every rank
            log.warning("%s %s (%s) cannot be loaded, left out: %s", group, point.name, point.value, exc)
            continue
        if isinstance(obj, kind):
            found.append(obj)
        else:
            log.warning("%s %s (%s) is not a %s, left out", group, point.name, point.value, kind.__name__)
    return tuple(found)
