"""What ``bench scale``'s parts share: the client processes and their line-per-message
streams, the private /etc/hosts they run under, the spread of a figure and its power law."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

from ddp_hpc.errors import UserError

ADDR = "127.0.0.1"


def dns_isolation(workdir: Path) -> list[str] | None:
    """A command prefix giving the clients a private /etc/hosts naming ADDR, or None."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    hosts = workdir / "hosts"
    original = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
    hosts.write_text(f"{original}\n{ADDR} localhost\n::ffff:{ADDR} localhost\n")
    prefix = ["unshare", "-m", "sh", "-c", f'mount --bind "{hosts}" /etc/hosts && exec "$0" "$@"']
    try:
        subprocess.run([*prefix, "true"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return prefix


class Clients:
    """The client processes and their line-per-message streams."""

    def __init__(self, argvs: list[list[str]], prefix: list[str] | None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.procs: list[subprocess.Popen[str]] = [
            subprocess.Popen([*(prefix or []), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=env) for argv in argvs]

    def read_all(self, event: str, timeout_s: float) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        give_up_at = time.monotonic() + timeout_s
        for proc in self.procs:
            while True:
                if time.monotonic() > give_up_at:
                    raise UserError(f"scale harness: no '{event}' from a client within {timeout_s:g}s")
                line = _readline(proc.stdout, give_up_at - time.monotonic())
                if not line:
                    raise UserError(f"scale harness: a client process ended before '{event}' "
                                    f"(status {proc.poll()})")
                message = json.loads(line)
                if message.get("event") == event:
                    out.append(message)
                    break
        return out

    def send(self, **command: Any) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()

    def close(self) -> None:
        for proc in self.procs:
            try:
                if proc.stdin:
                    proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _readline(stream: IO[str] | None, timeout_s: float) -> str:
    assert stream is not None
    holder: list[str] = []
    reader = threading.Thread(target=lambda: holder.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(max(timeout_s, 0.0))
    return holder[0] if holder else ""


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 4),
            "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 4),
            "max": round(ordered[-1], 4)}


def fit_power_law(sizes: list[int], values: list[float]) -> dict[str, float]:
    """``value = a * N**b`` by least squares in log space."""
    points = [(math.log(n), math.log(v)) for n, v in zip(sizes, values) if v > 0]
    if len(points) < 2:
        return {}
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x, _ in points))
    return {"a": math.exp(mean_y - slope * mean_x), "b": slope}
