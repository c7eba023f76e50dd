"""The launch of the recovery part of ``bench scale``: serves the real ``LaunchStore`` and,
told of a loss, makes ``Recoverer.on_failure``'s calls (``scale_recovery.publish_after_loss``).

A process of its own, started like the simulated ranks (under the harness's private
/etc/hosts where it has one): torch's store server looks up each client's address by name
as it accepts it, and on this machine's resolver a burst of 8,000 such look-ups stalls for
seconds each. One JSON object a line on its standard streams.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any


def _say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> int:
    from ddp_hpc.bench.scale_recovery import publish_after_loss
    from ddp_hpc.engine.recovery.store import LaunchStore, ready_key

    world_size = int(argv[1])
    launch = LaunchStore(argv[0])
    members = {slot: slot for slot in range(world_size)}
    _say(event="ready", address=launch.address)
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "cpu":
            _say(event="cpu", cpu_s=_cpu_s())
        elif command["do"] == "lose":
            loss, cpu = time.time(), _cpu_s()
            plan = publish_after_loss(launch, members, command["slot"])
            _say(event="published", loss=loss, cpu_s=cpu, published=time.time(), generation=plan.generation)
        elif command["do"] == "replaced":  # the lost rank's replacement started InJobRecovery
            launch.store.set(ready_key(command["slot"]), "1")
            _say(event="replaced")
        elif command["do"] == "stop":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
