"""Run as ``python -m probe_pkg.mod ARGS`` from tests/scripts."""

import warnings

from probe_pkg import report


def _warn():
    warnings.warn("deprecated in the probe", DeprecationWarning)


report(globals())
