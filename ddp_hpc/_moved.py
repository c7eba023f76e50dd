"""Old module paths kept working after the layout of issue 30 (docs/architecture.md).

No file is left at an old path, so git follows each moved file (history and merges): an
import finder, last on ``sys.meta_path`` and so asked only after no file was found, answers
an old path with a module that warns on import and takes every name from the new module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

#: Old module path -> the module that holds its code now.
MOVED = {
    "ddp_hpc.torchrun_env": "ddp_hpc.run.torchrun_env",
    "ddp_hpc.python_command": "ddp_hpc.run.python_command",
    "ddp_hpc.distributed": "ddp_hpc.startup.distributed",
    "ddp_hpc.rendezvous": "ddp_hpc.startup.rendezvous",
    "ddp_hpc.fail_fast": "ddp_hpc.startup.fail_fast",
    "ddp_hpc.links": "ddp_hpc.startup.links",
    "ddp_hpc.doctor": "ddp_hpc.startup.doctor",
    "ddp_hpc.launch.request": "ddp_hpc.specs.request",
    "ddp_hpc.launch.profiles": "ddp_hpc.specs.profiles",
    "ddp_hpc.launch.sweep": "ddp_hpc.specs.sweep",
}


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the old paths in ``MOVED``, and nothing else."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        new = importlib.import_module(MOVED[module.__name__])
        # warnings skips the import machinery's frames: this names the line that imported the old path.
        warnings.warn(f"{module.__name__} is deprecated: import {new.__name__} instead", DeprecationWarning,
                      stacklevel=2)
        module.__doc__ = f"Deprecated: moved to {new.__name__}."

        def __getattr__(name: str) -> Any:
            return getattr(new, name)

        module.__getattr__ = __getattr__  # type: ignore[method-assign]


def install() -> None:
    """Answer the old paths from now on (once per interpreter)."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(OldPaths())
