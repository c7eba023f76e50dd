"""The registry of scheduler backends: each family (a profile's ``scheduler``) and its
backends, the default first, and the cluster profile ``render``/``submit FAMILY`` use without
``--cluster``. Adding a family is one line in ``REGISTRY``; the CLI asks ``run_opts`` and
``backend_for`` for the options each backend declares (``Scheduler.run_opts``).

A family without a default profile (``slurm``, ``pbs``) takes the profile whose ``match`` fits
this machine (``cluster/which.py``): a generic one would render a script for another cluster."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddp_hpc.errors import UserError
from ddp_hpc.schedulers.base import RunOpt, Scheduler
from ddp_hpc.schedulers.local import LocalScheduler
from ddp_hpc.schedulers.pbs import PbsScheduler
from ddp_hpc.schedulers.slurm import SbatchScheduler, SubmititScheduler

#: A profile's scheduler family -> (its backends, the default first; the cluster profile
#: ``render``/``submit FAMILY`` use without ``--cluster``, None: the one that matches this
#: machine). One line per family.
REGISTRY: dict[str, tuple[tuple[type[Scheduler], ...], str | None]] = {
    "pbs": ((PbsScheduler,), None),
    "slurm": ((SubmititScheduler, SbatchScheduler), None),
    "local": ((LocalScheduler,), "local"),
}


def backends() -> dict[str, type[Scheduler]]:
    """Every backend by its name (``pbs``, ``submitit``, ...), in registry order."""
    return {cls.name: cls for classes, _ in REGISTRY.values() for cls in classes}


def families() -> dict[str, tuple[str, ...]]:
    """Each family's backend names, the default first."""
    return {family: tuple(cls.name for cls in classes) for family, (classes, _) in REGISTRY.items()}


def default_profile(family: str) -> str | None:
    """The cluster profile ``render``/``submit FAMILY`` use without ``--cluster``; None: the
    one whose ``match`` fits this machine."""
    return REGISTRY[family][1]


def get_scheduler(name: str) -> Scheduler:
    known = backends()
    try:
        return known[name]()
    except KeyError:
        raise UserError(f"unknown scheduler {name!r}: choose one of {', '.join(known)}") from None


def scheduler_for(family: str, *, batch_script: bool = False) -> Scheduler:
    """The family's default backend, or its first that submits a rendered batch script."""
    names = families().get(family)
    if not names:
        raise UserError(f"no scheduler submits to {family!r} clusters: choose one of {', '.join(REGISTRY)}")
    if batch_script:
        names = tuple(n for n in names if backends()[n].script_suffix) or names
    return get_scheduler(names[0])


def run_opts(family: str, group: str) -> list[RunOpt]:
    """The options the family's backends declare in ``group``, each once, in backend order."""
    found: dict[tuple[str, ...], RunOpt] = {}
    for cls in REGISTRY[family][0]:
        for opt in cls.run_opts:
            if opt.group == group:
                found.setdefault(opt.flags, opt)
    return list(found.values())


def backend_for(family: str, options: Mapping[str, Any]) -> Scheduler:
    """The backend that declares a backend option set in ``options`` (``--sbatch``), else
    the family's default."""
    for cls in REGISTRY[family][0]:
        if any(options.get(opt.dest) for opt in cls.run_opts if opt.group == "backend"):
            return cls()
    return scheduler_for(family)
