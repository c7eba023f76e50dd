"""No test leaves a process behind (tests/leftovers.py, wired in conftest.py): a process
whose parent died is still found and ended after the test."""

from __future__ import annotations

import subprocess

import leftovers


def test_an_orphan_a_test_started_is_found_and_ended_after_it():
    before = leftovers.descendants()
    # sh starts sleep in the background and exits: the sleep is an orphan at once.
    orphan = int(subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True,
                                text=True, check=True).stdout)
    assert orphan in {pid for pid, _ in leftovers.descendants()}  # came to pytest, the subreaper
    assert leftovers.end_new(before) == [f"{orphan} (sleep 300)"]
    assert orphan not in {pid for pid, _ in leftovers.descendants()}  # killed and reaped
