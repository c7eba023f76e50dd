"""Run as ``python tests/scripts/runner_probe.py ARGS``; see probe_pkg."""

import warnings

from probe_pkg import report  # found only if sys.path[0] is this script's folder


def _warn():
    warnings.warn("deprecated in the probe", DeprecationWarning)


if __name__ == "__main__":
    report(globals())
