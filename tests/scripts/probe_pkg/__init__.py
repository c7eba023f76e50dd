"""What a script sees of how it was started, for comparing a run through ddp_hpc's
script runner with the interpreter's own (tests/test_script_runner.py)."""

import json
import sys
import warnings


def report(namespace: dict) -> None:
    """Print one JSON line of what the module with globals ``namespace`` sees, then act
    on its first argument: ``raise``, ``exit N``, ``interrupt`` or ``warn``."""
    spec = namespace.get("__spec__")
    loader = namespace.get("__loader__")
    seen = {
        "name": namespace.get("__name__"),
        "file": namespace.get("__file__"),
        "cached": namespace.get("__cached__", "absent"),
        "package": namespace.get("__package__"),
        "spec": getattr(spec, "name", None),
        "loader": type(loader).__name__ if loader is not None else None,
        "loader_path": getattr(loader, "path", None),
        "argv": sys.argv,
        "path0": sys.path[0],
        "main_is_this": sys.modules["__main__"].__dict__ is namespace,
        "doc": namespace.get("__doc__"),
        "names": sorted(name for name in namespace if name.startswith("__")),
        "annotations": namespace.get("__annotations__", "absent"),
    }
    print(json.dumps(seen), flush=True)
    action = sys.argv[1:2]
    if action == ["raise"]:
        raise ValueError("raised by the probe")
    if action == ["exit"]:
        sys.exit(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
    if action == ["interrupt"]:
        raise KeyboardInterrupt
    if action == ["warn"]:
        namespace["_warn"]()
