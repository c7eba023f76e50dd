"""The launch's recovery store without torch (issue 44): ddp_hpc/engine/recovery/store_server.py
serves torch's TCPStore protocol to torch's own clients (the ranks), its client serves the
launch and the node supervisors, and a ``--recover`` launch never imports torch."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from conftest import REPO, clean_env

CLIENT = str(REPO / "tests" / "scripts" / "torch_store_client.py")


def torch_client_passes(python: str, env: dict[str, str] | None = None) -> str:
    """tests/scripts/torch_store_client.py in ``python``, against a fresh server of this
    process: its output, after it passed."""
    from ddp_hpc.engine.recovery.store_server import StoreServer

    with StoreServer() as server:
        result = subprocess.run([python, CLIENT, str(server.port)], capture_output=True, text=True, timeout=300,
                                env=clean_env(env))
    assert result.returncode == 0 and "passed" in result.stdout, (result.stdout + result.stderr)[-4000:]
    return result.stdout


@pytest.mark.multiproc
def test_torch_s_own_client_and_a_gloo_group_over_prefix_stores_work_against_the_torch_free_server():
    assert "passed" in torch_client_passes(sys.executable)


def test_the_stdlib_client_against_the_server():
    from ddp_hpc.engine.recovery.store_client import StoreClient
    from ddp_hpc.engine.recovery.store_protocol import StoreTimeout
    from ddp_hpc.engine.recovery.store_server import StoreServer

    with StoreServer() as server:
        client, other = StoreClient("127.0.0.1", server.port), StoreClient("127.0.0.1", server.port, timeout=0.5)
        client.set("a", "1")
        assert client.get("a") == b"1" and other.get("a") == b"1"
        assert client.add("n", 3) == 3 and other.add("n", 2) == 5
        assert client.check(["a", "n"]) and not client.check(["a", "missing"])
        assert client.compare_set("a", "1", "2") == b"2" and client.compare_set("a", "9", "3") == b"2"
        assert client.compare_set("fresh", "", "x") == b"x" and client.compare_set("absent", "e", "x") == b"e"
        client.multi_set(["m1", "m2"], ["v1", b"v\x002"])
        assert client.multi_get(["m1", "m2"]) == [b"v1", b"v\x002"]
        client.append("m1", "+")
        assert client.get("m1") == b"v1+"
        keys = client.num_keys()
        assert client.delete_key("a") and not client.delete_key("a") and client.num_keys() == keys - 1
        assert client.ping(12345)

        started = time.monotonic()
        with pytest.raises(StoreTimeout):
            client.wait(["never"], timedelta(seconds=0.3))
        with pytest.raises(StoreTimeout):
            other.get("never")  # a get waits for its key, up to the client's timeout
        assert time.monotonic() - started < 5
        assert client.add("n", 0) == 5  # both connections still answer after a canceled wait

        started = time.monotonic()  # before the timer: its 0.3 s start here
        threading.Timer(0.3, lambda: other.set("late", "L")).start()
        client.wait(["late", "n"], timedelta(seconds=30))
        assert time.monotonic() - started >= 0.25 and client.get("late") == b"L"


def test_a_client_that_does_not_validate_first_is_disconnected_and_the_server_serves_on():
    import socket

    from ddp_hpc.engine.recovery.store_client import StoreClient
    from ddp_hpc.engine.recovery.store_server import StoreServer

    with StoreServer() as server:
        rogue = socket.create_connection(("127.0.0.1", server.port))
        rogue.sendall(b"GET / HTTP/1.0\r\n\r\n")
        rogue.settimeout(5)
        assert rogue.recv(1) == b""  # closed
        assert StoreClient("127.0.0.1", server.port).add("n", 1) == 1


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_recovering_launch_never_imports_torch(tmp_path):
    """``python -X importtime`` writes each module the launch process imports, when it does:
    the ranks' imports are not written (they run without the flag)."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "ddp_hpc", "launch", "--nproc", "2",
                             "--recover", "1", "--", "python", str(REPO / "examples" / "recovering_loop.py")],
                            capture_output=True, text=True, timeout=500, cwd=REPO,
                            env=clean_env({"EPOCHS": "1", "RUN_DIR": str(tmp_path)}))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "ddp_hpc.engine.recovery.store_server" in imported, sorted(imported)
    assert not {name for name in imported if name == "torch" or name.startswith("torch.")}, sorted(imported)
