"""Across real hosts: the multihost test world (scripts/dev-cluster.sh up --hosts 2).

Hosts h1 and h2 are network namespaces with their own host names, a management network
(eth0, names h1, h2) and a high-speed network (hsn0, names h1-hsn, h2-hsn); their own
SLURM cluster answers under SLURM_CONF=/etc/slurm-mh/slurm.conf, and scripts/on-host runs
a command on a host (also the MPI launchers' remote-start agent). docs/test-world.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import shlex
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from conftest import FIGURES, REPO, clean_env, ddp_hpc_command, need, run

pytestmark = [pytest.mark.multihost, pytest.mark.multiproc]

ON_HOST = str(REPO / "scripts" / "on-host")
SLURM_CONF = "/etc/slurm-mh/slurm.conf"
NAMESPACE = "ddpmh-{host}"
SLURMD_PID = "/run/slurm-mh/slurmd-{host}.pid"
ADDRESSES = {"h1": "198.18.14.11", "h2": "198.18.14.12", "h1-hsn": "198.18.15.11", "h2-hsn": "198.18.15.12"}
LOCK = "/run/ddp-hpc-mh/tests.lock"
TIMEOUT = 240  # a loaded 2-core machine starts 4 torch processes slowly


@pytest.fixture(scope="session")
def world_up() -> None:
    need(os.geteuid() == 0, "the multihost tests enter network namespaces: run them as root")
    status = subprocess.run([str(REPO / "scripts" / "dev-cluster.sh"), "status", "--hosts"],
                            capture_output=True, text=True, timeout=60)
    need(status.returncode == 0 and status.stdout.startswith("hosts: "),
         "the multihost test world is not up (scripts/dev-cluster.sh up --hosts 2, as root)")
    hosts = int(status.stdout.split()[1])
    need(hosts >= 2, f"the multihost test world has {hosts} host(s); 2 are needed")


@pytest.fixture
def world(world_up: None) -> Iterator[None]:
    """The world, to this test alone: test runs from several checkouts share it, and one
    test takes a link down."""
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def some_port() -> int:
    """A port for a rendezvous inside the world (its namespaces have no other listeners)."""
    return random.randrange(20000, 30000)


def slurm_env(**extra: str) -> dict[str, str]:
    return {"SLURM_CONF": SLURM_CONF, **extra}


def on_host(host: str, argv: Sequence[str], *, hosts_file: Path | None = None) -> list[str]:
    """The argv that runs ``argv`` on ``host`` (on-host joins words like ssh: quote them)."""
    prefix = [ON_HOST] + (["--hosts-file", str(hosts_file)] if hosts_file else [])
    return [*prefix, host, shlex.join(argv)]


def doctor_hosts(output: str) -> dict[int, str]:
    """Rank -> host from the doctor's table (columns: rank world_size node_rank host ...)."""
    rows = [line.split() for line in output.splitlines() if re.match(r"^\d+\s+\d+\s+\d+\s+\S+", line)]
    return {int(row[0]): row[3] for row in rows}


def assert_doctor_on_two_hosts(result: subprocess.CompletedProcess[str], source: str) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert "doctor: OK: 4 ranks on 2 node(s), backend gloo" in result.stdout, result.stdout + result.stderr
    assert doctor_hosts(result.stdout) == {0: "h1", 1: "h1", 2: "h2", 3: "h2"}, result.stdout
    assert f" {source} " in result.stdout


def link_bytes(host: str) -> dict[str, int]:
    """Interface -> bytes received + sent, inside ``host``'s namespace."""
    out = subprocess.run(["ip", "-n", NAMESPACE.format(host=host), "-j", "-s", "link", "show"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return {link["ifname"]: link["stats64"]["rx"]["bytes"] + link["stats64"]["tx"]["bytes"]
            for link in json.loads(out)}


def tcp_sockets(host: str) -> list[tuple[str, int, str, int, str]]:
    """(local ip, port, remote ip, port, state) of every IPv4 TCP socket on ``host``.

    Read from /proc/PID/net/tcp of the host's slurmd: it shows that process's namespace.
    """
    pid = Path(SLURMD_PID.format(host=host)).read_text().strip()
    states = {"0A": "LISTEN", "01": "ESTABLISHED"}
    sockets = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]

        def address(text: str) -> tuple[str, int]:
            ip, port = text.split(":")
            return socket.inet_ntoa(struct.pack("<I", int(ip, 16))), int(port, 16)

        sockets.append((*address(local), *address(remote), states.get(state, state)))
    return sockets


def digits_param_bytes() -> int:
    from ddp_hpc.builtin_jobs.digits import DigitsCNN

    return 4 * sum(p.numel() for p in DigitsCNN().parameters())


def test_srun_doctor_runs_on_two_hosts(world):
    result = run(["srun", "-N2", "-n4", "--ntasks-per-node=2", *ddp_hpc_command(), "doctor"],
                 env=slurm_env(), timeout=TIMEOUT)
    assert_doctor_on_two_hosts(result, "slurm")


def test_srun_digits_trains_over_the_high_speed_network(world, tmp_path):
    """With the host suffix, the store listens on h1-hsn alone, h2 reaches it there, and the
    gradients cross hsn0 (gloo's interface is picked from h2-hsn), not eth0."""
    port = some_port()
    seen: set[tuple[str, int, str, int, str]] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(s for s in tcp_sockets("h1") if port in (s[1], s[3]))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    before = link_bytes("h2")
    watcher.start()
    try:
        result = run(["srun", "-N2", "-n4", "--ntasks-per-node=2", *ddp_hpc_command(), "train",
                      "configs/digits.yaml", "training.epochs=2", "logging.progress=never", "logging.plot=false",
                      f"logging.run_dir={tmp_path}"],
                     env=slurm_env(DDP_HPC_HOST_SUFFIX="-hsn", MASTER_PORT=str(port)), timeout=TIMEOUT)
    finally:
        done.set()
        watcher.join()
    after = link_bytes("h2")
    assert result.returncode == 0, result.stdout + result.stderr
    steps = int(re.search(r"done: 2 epochs, (\d+) steps", result.stdout + result.stderr).group(1))

    listening = {(ip, p) for ip, p, _, _, state in seen if state == "LISTEN" and p == port}
    assert listening == {(ADDRESSES["h1-hsn"], port)}, seen
    from_h2 = [s for s in seen if s[4] == "ESTABLISHED" and s[:2] == (ADDRESSES["h1-hsn"], port)
               and s[2] == ADDRESSES["h2-hsn"]]
    assert from_h2, seen

    hsn, eth = after["hsn0"] - before["hsn0"], after["eth0"] - before["eth0"]
    FIGURES.append(f"digits under srun on 2 hosts x 2 ranks, {steps} steps: h2 hsn0 moved "
                   f"{hsn / 1e6:.2f} MB, eth0 {eth / 1e6:.3f} MB (gradients "
                   f"{digits_param_bytes() / 1e6:.3f} MB per step)")
    # Every step all-reduces the gradients across the two hosts: at least their size in
    # and out of h2 together. The management network only carries SLURM's own traffic.
    assert hsn >= steps * digits_param_bytes(), (hsn, eth)
    assert eth < hsn / 10, (hsn, eth)


def test_open_mpi_doctor_across_hosts_through_its_rsh_agent(world, openmpi):
    command = [openmpi, "--host", "h1:2,h2:2", "-n", "4", "-x", "PATH", "-x", "OMP_NUM_THREADS",
               "-x", "MASTER_ADDR=h1", *ddp_hpc_command(), "doctor"]
    # mpiexec runs on h1, as on a cluster's first node; h2's daemon starts through the agent.
    result = run(on_host("h1", command), env={"OMPI_MCA_plm_rsh_agent": ON_HOST}, timeout=TIMEOUT)
    assert_doctor_on_two_hosts(result, "openmpi")


def test_mpich_doctor_across_hosts_through_its_launcher_exec(world, mpich):
    command = [mpich, "-hosts", "h1,h2", "-ppn", "2", "-n", "4", "-launcher", "ssh",
               "-launcher-exec", ON_HOST, "-genv", "MASTER_ADDR", "h1",
               "-genv", "MASTER_PORT", str(some_port()),
               *ddp_hpc_command(), "doctor"]
    result = run(on_host("h1", command), timeout=TIMEOUT)
    assert_doctor_on_two_hosts(result, "mpich")


def test_a_launch_over_a_hostfile_restarts_on_the_spare_host_without_the_failed_one(world, mpich, tmp_path):
    """``ddp-hpc launch --hostfile`` (h1, then h2 as the spare) started on h1 through Hydra's
    launcher exec: rank 1 is killed on h1 in the first attempt, the restart runs on h2 alone,
    and ``ddp-hpc status RUN`` shows h1 left out and why."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2\n")
    folder = tmp_path / "run"
    probe = ('echo "attempt $DDP_HPC_RESTART_COUNT rank $RANK on $(hostname)"; '
             'if [ "$DDP_HPC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then kill -9 $$; fi')
    command = [*ddp_hpc_command(), "launch", "--launcher", "mpich", "--hostfile", str(hostfile), "--nodes", "1",
               "--nproc", "2", "--max-restarts", "1", "--run-folder", str(folder), "--", "sh", "-c", probe]
    result = run(on_host("h1", command), env={"HYDRA_LAUNCHER_EXEC": ON_HOST}, timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    places = re.findall(r"attempt (\d) rank (\d) on (h\d)", output)
    assert ("0", "1", "h1") in places and {host for attempt, _, host in places if attempt == "1"} == {"h2"}, output
    assert "leaving out node(s) h1, where a rank failed (rank 1 exited with status 137)" in output, output[-3000:]
    status = run([*ddp_hpc_command(), "status", str(folder)])
    assert status.returncode == 0, status.stdout + status.stderr
    assert "(local, 2 ranks" in status.stdout and ": completed, exit status 0" in status.stdout, status.stdout
    assert "left out: h1 (attempt 0: rank 1 exited with status 137)" in status.stdout, status.stdout


def test_torchrun_per_host_with_a_c10d_rendezvous_on_h1(world, tmp_path):
    command = ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"h1:{some_port()}", "--rdzv-id", f"mh{time.time_ns()}",
               "--max-restarts", "0", "-m", "ddp_hpc", "doctor"]
    h1, h2 = run_together([on_host("h1", command), on_host("h2", command)], tmp_path)
    assert h2.returncode == 0, h2.stdout + h2.stderr
    assert_doctor_on_two_hosts(h1, "torchrun")


def test_command_job_runs_on_two_hosts_with_ddp_hpc_run(world, tmp_path):
    """The user's own script, unmodified, under ``ddp-hpc run`` inside srun."""
    script = tmp_path / "hosts.py"
    script.write_text(
        "import socket, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "hosts = [None] * dist.get_world_size()\n"
        "dist.all_gather_object(hosts, socket.gethostname())\n"
        "if dist.get_rank() == 0:\n"
        "    print('hosts:', ' '.join(hosts), flush=True)\n"
        "dist.destroy_process_group()\n")
    result = run(["srun", "-N2", "-n4", "--ntasks-per-node=2", *ddp_hpc_command(), "run", "--", "python",
                  str(script)], env=slurm_env(), timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hosts: h1 h1 h2 h2" in result.stdout, result.stdout + result.stderr


def run_together(commands: Sequence[Sequence[str]], tmp_path: Path) -> list[subprocess.CompletedProcess[str]]:
    """Start every command at once, wait for all; output goes to files (no pipe fills up).

    Each runs in a session of its own, killed as a whole at the end: on-host's shell does
    not always exec the command, so killing the first process alone could orphan it.
    """
    files = [(tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt") for i in range(len(commands))]
    processes = []
    try:
        for command, (out, err) in zip(commands, files):
            with out.open("w") as stdout, err.open("w") as stderr:
                processes.append(subprocess.Popen(list(command), stdout=stdout, stderr=stderr, text=True,
                                                  env=clean_env(), cwd=REPO, start_new_session=True))
        deadline = time.monotonic() + TIMEOUT
        for process in processes:
            process.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    return [subprocess.CompletedProcess(process.args, process.returncode, out.read_text(), err.read_text())
            for process, (out, err) in zip(processes, files)]


def hosts_file_with_loopback_line(path: Path, host: str) -> Path:
    """This machine's /etc/hosts with the installer's classic line for ``host`` on top."""
    lines = Path("/etc/hosts").read_text().splitlines()
    path.write_text("\n".join([lines[0], f"127.0.1.1 {host}", *lines[1:]]) + "\n")
    return path


def test_a_hostname_on_a_loopback_line_is_named_before_the_rendezvous(world, tmp_path):
    """h1's and h2's /etc/hosts carry ``127.0.1.1 <own name>``: rank 0 would serve the store
    on loopback, rank 1 would offer gloo peers a loopback address. Each says so in one line
    and exits 2, before anything connects (rank 0 does not wait for rank 1).

    The ranks are started as a launcher inside a SLURM allocation would start them: with the
    allocation's node list, from which rank 0 learns that h2 is another machine.
    """
    commands = []
    port = some_port()
    for rank, host in enumerate(("h1", "h2")):
        environment = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "h1",
                       "MASTER_PORT": str(port), "SLURM_JOB_NODELIST": "h[1-2]"}
        command = ["env", *(f"{k}={v}" for k, v in environment.items()), *ddp_hpc_command(), "doctor",
                   "--timeout", "60"]
        hosts_file = hosts_file_with_loopback_line(tmp_path / f"hosts-{host}", host)
        commands.append(on_host(host, command, hosts_file=hosts_file))
    rank0, rank1 = run_together(commands, tmp_path)
    outputs = [(rank0.stdout, rank0.stderr), (rank1.stdout, rank1.stderr)]
    assert [rank0.returncode, rank1.returncode] == [2, 2], outputs
    (_, err0), (_, err1) = outputs
    assert err0.strip().splitlines() == [
        "ddp-hpc: error: rank 0 on host h1: the rendezvous host 'h1' resolves to 127.0.1.1, a loopback "
        "address, but the job spans 2 nodes: the other nodes cannot reach it. Fix: delete the line "
        "'127.0.1.1 h1' from /etc/hosts on h1, or set MASTER_ADDR (or the host suffix) to a name on the "
        "job's network"], err0
    assert err1.strip().splitlines() == [
        "ddp-hpc: error: rank 1 on host h2: the host name 'h2' resolves to 127.0.1.1, a loopback address, "
        "so gloo would offer the other ranks an address they cannot reach (the job spans 2 nodes). Fix: "
        "delete the line '127.0.1.1 h2' from /etc/hosts on h2, or export GLOO_SOCKET_IFNAME=<the interface "
        "of the job's network>"], err1


def test_a_rank_that_cannot_reach_the_store_says_so_in_one_line(world):
    """Rank 1 on h2, and nothing serves the store on h1 (rank 0 never started; a firewall
    dropping the port looks the same, only slower): one line naming the address, exit 2."""
    port = some_port()
    environment = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "h1-hsn",
                   "MASTER_PORT": str(port)}
    command = ["env", *(f"{k}={v}" for k, v in environment.items()), "DDP_HPC_RENDEZVOUS_TIMEOUT=3",
               *ddp_hpc_command(), "doctor"]
    result = run(on_host("h2", command), timeout=TIMEOUT)
    assert result.returncode == 2, result.stdout + result.stderr
    # torch's own C++ warning about the client socket's host name may precede it.
    lines = [line for line in result.stderr.splitlines() if line.startswith("ddp-hpc: error:")]
    assert len(lines) == 1, result.stderr
    [line] = lines
    assert line.startswith(f"ddp-hpc: error: rank 1 on host h2: no rendezvous store answered at h1-hsn:{port} "
                           "within 3s"), line
    assert "rank 0 did not start or failed" in line
    assert "firewall blocks the port" in line


@pytest.mark.slow
@pytest.mark.reliability
def test_a_host_whose_link_goes_down_is_named_and_the_job_ends(world, tmp_path):
    """h2's high-speed link goes down mid-training: no reset, just silence. Every rank's
    watchdog (20 s) fires; h1's ranks name ranks 2 and 3 on h2 from the heartbeats in the
    store, h2's ranks find the store unreachable; srun ends non-zero within 60 s."""
    command = ["srun", "-N2", "-n4", "--ntasks-per-node=2", *ddp_hpc_command(), "train",
               "configs/digits.yaml", "training.epochs=1000", "distributed.watchdog_s=20",
               "logging.progress=never",
               f"logging.run_dir={tmp_path}"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=clean_env(slurm_env(DDP_HPC_HOST_SUFFIX="-hsn")), cwd=REPO,
                           start_new_session=True)
    lines: list[str] = []
    training = threading.Event()

    def read() -> None:
        for line in job.stdout:
            lines.append(line)
            if re.search(r"epoch 2/1000", line):
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    link = ["ip", "-n", NAMESPACE.format(host="h2"), "link", "set", "hsn0"]
    try:
        assert training.wait(TIMEOUT), "".join(lines)
        subprocess.run([*link, "down"], check=True, timeout=30)
        cut = time.monotonic()
        returncode = job.wait(timeout=120)
        seconds = time.monotonic() - cut
    finally:
        subprocess.run([*link, "up"], check=True, timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        reader.join(timeout=10)
    output = "".join(lines)
    FIGURES.append(f"h2's hsn0 down mid-training (watchdog 20 s, srun, 2 hosts x 2 ranks): job ended "
                   f"{seconds:.1f}s later, exit {returncode}")
    assert returncode != 0, output
    assert seconds < 60, output
    assert re.search(r"\[rank [01]\] watchdog: silent: ranks 2, 3 on host h2 \(no heartbeat", output), output
    assert re.search(r"\[rank [23]\] watchdog: this rank cannot reach the rendezvous store at h1-hsn:\d+ "
                     r"either .*host h2 has likely lost the job's network", output), output


@contextlib.contextmanager
def rate_limited(host: str, interface: str, rate: str) -> Iterator[None]:
    """A token bucket on ``host``'s ``interface`` (its sending side), always removed again:
    other tests share the world."""
    qdisc = ["ip", "netns", "exec", NAMESPACE.format(host=host), "tc", "qdisc"]
    subprocess.run([*qdisc, "add", "dev", interface, "root", "tbf", "rate", rate, "burst", "64kb",
                    "latency", "50ms"], check=True, timeout=30)
    try:
        yield
    finally:
        subprocess.run([*qdisc, "del", "dev", interface, "root"], check=True, timeout=30)


@pytest.mark.slow
def test_doctor_links_passes_a_clean_world_and_names_a_rate_limited_host(world):
    """``doctor --links`` over the high-speed network: clean, exit 0; with h2's hsn0 limited
    to 100 Mbit/s (tc tbf), the h2 -> h1 link is slow, h2 is named, and the exit is non-zero."""
    command = ["srun", "-N2", "-n2", "--ntasks-per-node=1", *ddp_hpc_command(), "doctor", "--links"]
    env = slurm_env(DDP_HPC_HOST_SUFFIX="-hsn")
    started = time.monotonic()
    clean = run(command, env=env, timeout=TIMEOUT)
    clean_s = time.monotonic() - started
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "links: every pair: 1 pair(s) of 2 hosts" in clean.stdout
    assert re.search(r"^h1\s+h2\s+[\d.]+\s+\d+$", clean.stdout, re.MULTILINE), clean.stdout
    assert "links: OK: 2 directed link(s) between 2 hosts, none slow" in clean.stdout, clean.stdout

    with rate_limited("h2", "hsn0", "100mbit"):
        limited = run(command, env=env, timeout=TIMEOUT)
    assert limited.returncode != 0, limited.stdout + limited.stderr
    assert re.search(r"^links: SLOW: h2 -> h1: [\d.]+ MB/s, 0\.\d\dx the median", limited.stdout, re.MULTILINE), \
        limited.stdout
    assert "h1 -> h2" not in limited.stdout.split("links: SLOW", 1)[1]
    assert re.search(r"^links: FAILED: suspect host\(s\): h2\b", limited.stdout, re.MULTILINE), limited.stdout
    took = re.search(r"took ([\d.]+) s", clean.stdout).group(1)
    FIGURES.append(f"doctor --links, 2 hosts over hsn0 (srun, 1 rank per host): clean run {clean_s:.1f} s "
                   f"end to end (measurement {took} s)")


def test_a_hosts_ranks_of_a_sharded_model_lost_with_their_memory_come_back_from_the_other_hosts_copies(
        world, mpich, tmp_path):
    """examples/sharded_recovering_loop.py, 2 ranks on each of h1 and h2 (``--hostfile``,
    MPICH, a node supervisor per host, ``--recover 2``): both ranks of h2 remove the
    snapshots in h2's memory and die after step 7's optimizer step, as the loss of the host
    would leave them. Their replacements take their shards from the copies on h1 (the buddy
    2 ranks away), h1's ranks keep their processes, nothing is read from disk, and every
    rank's shards end as in the same launch without a loss."""
    from conftest import assert_same_model_and_optimizer
    import torch

    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2\n")
    example = str(REPO / "examples" / "sharded_recovering_loop.py")

    def launch(run: Path, **fault: str) -> str:
        command = [*ddp_hpc_command(), "launch", "--launcher", "mpich", "--hostfile", str(hostfile), "--nodes", "2",
                   "--nproc", "2", "--recover", "2", "--run-folder", str(run / "launch"), "--", "python", example]
        settings = {"RUN_DIR": str(run), "EPOCHS": "1", "STEP_DELAY_S": "0.2", "HYDRA_LAUNCHER_EXEC": ON_HOST,
                    "DDP_HPC_SNAPSHOT_DIR": str(tmp_path / "node-memory"), **fault}
        result = run_on_h1(command, settings)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-4000:]
        return output

    def run_on_h1(command: list[str], settings: dict[str, str]) -> subprocess.CompletedProcess:
        exports = [f"{key}={value}" for key, value in settings.items()]
        return run(on_host("h1", ["env", *exports, *command]), timeout=3 * TIMEOUT)

    launch(tmp_path / "reference")
    lost = tmp_path / "lost"
    output = launch(lost, PYTHONPATH=str(REPO / "tests" / "scripts" / "recovery_faults"), RECOVERY_FAULT="host",
                    RECOVERY_FAULT_SLOT="2,3", RECOVERY_FAULT_STEP="7")
    assert "rank 2 lost" in output and "rank 3 lost" in output, output[-4000:]
    records = [json.loads(path.read_text()) for path in sorted((lost / "record").glob("recovery-*.json"))]
    assert records and set(records[-1]["from_buddies"]) == {2, 3}, records
    killed = {int((lost / f"fault-rank-{slot}").read_text()) for slot in (2, 3)}
    for slot in range(4):
        expected = torch.load(tmp_path / "reference" / "final" / f"rank-{slot}.pt", weights_only=True)
        state = torch.load(lost / "final" / f"rank-{slot}.pt", weights_only=True)
        assert state["pid"] not in killed and state["resumed"] is None
        assert_same_model_and_optimizer(expected, state)


def test_the_trainer_with_fsdp2_on_two_hosts_replaces_a_killed_rank_by_its_hosts_warm_spare_bit_identical(
        world, mpich, tmp_path):
    """``ddp-hpc train`` with ``training.strategy=fsdp2``, 2 ranks on each of h1 and h2
    (``--hostfile``, MPICH, a node supervisor per host, ``--recover 2 --warm-spare``): rank 3
    on h2 is SIGKILLed after step 6 of 32 and h2's warm spare takes its place there as local
    rank 1 of h2 (it started with h2's first rank's variables, local rank 0; its slot, 3, is
    no local rank of a 2-rank node), its shards from the snapshots; the last checkpoint is
    bit-identical to the same launch without the loss (and without a spare)."""
    from conftest import assert_same_model_and_optimizer, load_last_checkpoint
    from ddp_hpc.logs import rank_log_path

    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2\n")
    trainer = ["train", str(REPO / "configs" / "synthetic.yaml"), "job.params.samples=2048", "job.params.val_samples=0",
               "job.params.input_dim=32", "job.params.hidden=64", "job.params.depth=2", "training.batch_size=16",
               "training.epochs=1", "logging.progress=never", "logging.plot=false", "checkpoint.every_n_epochs=null",
               "checkpoint.every_n_steps=4", "training.strategy=fsdp2", "job.name=synthetic"]

    def launch(name: str, callbacks: str, *flags: str) -> tuple[Path, str]:
        command = [*ddp_hpc_command(), "launch", "--launcher", "mpich", "--hostfile", str(hostfile), "--nodes", "2",
                   "--nproc", "2", "--recover", "2", *flags, "--run-folder", str(tmp_path / f"{name}-launch"),
                   "--",
                   *ddp_hpc_command(), *trainer, f"logging.run_dir={tmp_path / name}", f"callbacks=[{callbacks}]"]
        settings = [f"HYDRA_LAUNCHER_EXEC={ON_HOST}", f"PYTHONPATH={REPO / 'tests'}"]
        result = run(on_host("h1", ["env", *settings, *command]), timeout=3 * TIMEOUT)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-4000:]
        [folder] = list((tmp_path / name).iterdir())
        return folder, output

    whole, _ = launch("whole", "")
    lost, output = launch("lost", f"{{target: 'fault_injection:KillRankAtStep', params: {{rank: 3, step: 6, "
                                  f"marker: '{tmp_path / 'killed-at'}', once: true}}}}", "--warm-spare")
    record = json.loads((lost / "record" / "recovery-1.json").read_text())
    assert record["rank"] == 3 and record["host"] == "h2" and record["snapshot_step"] in (5, 6)
    spare = re.search(r"rank 3 lost \(.*\): the warm spare \(pid (\d+)\) takes its place", output)
    assert spare, output[-4000:]
    # Each process of rank 3 says where it runs (the Trainer's first line in the rank's log).
    places = re.findall(r"rank 3 of 4 on host (\S+) \(pid (\d+), local rank (\d+),",
                        rank_log_path(lost, 3).read_text())
    assert ("h2", spare.group(1), "1") in places, places
    expected, actual = load_last_checkpoint(whole / "checkpoints"), load_last_checkpoint(lost / "checkpoints")
    assert actual["progress"]["global_step"] == expected["progress"]["global_step"] == 32
    assert_same_model_and_optimizer(expected, actual)
