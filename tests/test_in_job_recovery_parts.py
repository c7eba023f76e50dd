"""In-job recovery's parts that need no launch: the one-line refusals and fall-backs."""

import argparse
import io
import os
import logging

import pytest

from ddp_hpc.errors import UserError


def test_fsdp2_is_taken_and_refused_in_one_line_under_shrink_or_on_a_mesh_it_cannot_rebuild(tmp_path):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddp_hpc.engine.recovery import run_refusal
    from ddp_hpc.engine.recovery.shards import sharding_refusal

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plain = nn.Sequential(nn.Linear(4, 4))
        assert run_refusal(plain, None) is None  # DDP's module: accepted
        sharded = nn.Sequential(nn.Linear(4, 4))
        fully_shard(sharded)
        assert run_refusal(sharded, None) is None and sharding_refusal(sharded) is None  # snapshots keep it
        why = run_refusal(sharded, None, shrinks=True)
        assert why is not None and why.startswith("an FSDP2 model cannot go on with fewer ranks") and "\n" not in why
        hybrid = nn.Sequential(nn.Linear(4, 4))
        fully_shard(hybrid, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
        why = sharding_refusal(hybrid)
        assert why is not None and "a mesh of one dimension over every rank" in why and "\n" not in why
    finally:
        dist.destroy_process_group()


#: A user's script that gives InJobRecovery.run a DDP-wrapped model (or, with BACKEND set, a
#: backend in-job recovery does not run over): the same mistake on every rank.
MISTAKEN_SCRIPT = """
import os
import torch
import ddp_hpc
from torch.nn.parallel import DistributedDataParallel
recovery = ddp_hpc.InJobRecovery(os.environ.get("BACKEND", "gloo"))
model = torch.nn.Linear(2, 2)
recovery.run(lambda ddp_model: None, model=DistributedDataParallel(model), optimizer=torch.optim.SGD(model.parameters()))
"""


@pytest.mark.multiproc
def test_a_users_mistake_under_recover_exits_2_on_every_rank_in_one_line_and_spends_no_recovery(tmp_path):
    """Two ranks under ``launch --recover 1`` give ``InJobRecovery.run`` a DDP-wrapped model:
    each exits 2 with one line (no traceback), the launch starts no replacement and ends with 2."""
    import subprocess
    import sys

    from conftest import clean_env, ddp_hpc_command

    script = tmp_path / "mistaken.py"
    script.write_text(MISTAKEN_SCRIPT)
    result = subprocess.run([*ddp_hpc_command(), "launch", "--nproc", "2", "--recover", "1", "--", sys.executable,
                             str(script)], env=clean_env(), capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "replacement started" not in output, output[-3000:]
    assert "no in-job recovery is spent on it" in output
    refusals = [line for line in output.splitlines() if "InJobRecovery.run takes the model itself" in line]
    assert len(refusals) == 2 and {line.split(":")[0] for line in refusals} == {"rank 0", "rank 1"}, output[-3000:]


@pytest.mark.parametrize("backend", ["xccl", "ccl"])
def test_a_backend_in_job_recovery_cannot_leave_is_refused_on_the_rank_in_one_line(monkeypatch, backend):
    """Under a recovering launch (its store's address set), ``InJobRecovery`` refuses XCCL
    and oneCCL at once, before it connects anywhere: exit 2 uncaught, one line."""
    from ddp_hpc.contract import RECOVERY_STORE_VAR
    from ddp_hpc.engine.recovery import InJobRecovery

    with pytest.raises(UserError, match=f"in-job recovery runs over gloo and nccl, not {backend}") as refused:
        InJobRecovery(backend, environ={RECOVERY_STORE_VAR: "127.0.0.1:1", "RANK": "1"})
    assert isinstance(refused.value, SystemExit) and refused.value.code == 2
    assert "\n" not in str(refused.value)


def test_nccl_recovery_refuses_what_would_end_its_ranks_and_a_host_without_nvidia_gpus(monkeypatch, tmp_path):
    """NCCL recovery aborts a broken group itself: a rank refuses (one line) where the torch
    sees no CUDA device, or where NCCL's own error handling would end it first; the launch
    refuses --recover over nccl on a host that shows no NVIDIA device."""
    import torch

    from ddp_hpc.engine.recovery.group_abort import abort_refusal
    from ddp_hpc.engine.recovery.backends import host_refusal

    assert abort_refusal("gloo", {}) is None
    if not torch.cuda.is_available():
        assert "needs a CUDA device and this torch" in abort_refusal("nccl", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert abort_refusal("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}) is None
    unset = abort_refusal("nccl", {})  # torch's default is 3: it ends the rank
    assert unset.startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING unset (torch's 3)") and "\n" not in unset
    why = abort_refusal("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert why.startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING=1 lets NCCL's watchdog end this rank") and "\n" not in why

    assert host_refusal("nccl", tmp_path).startswith("nccl needs NVIDIA or AMD GPUs and this host shows none")
    assert host_refusal("gloo", tmp_path) is None
    (tmp_path / "proc" / "driver" / "nvidia" / "gpus" / "0000:01:00.0").mkdir(parents=True)
    assert host_refusal("nccl", tmp_path) is None  # the driver lists it before /dev/nvidia0 exists


def test_the_step_fence_refuses_a_step_whose_group_was_aborted_and_bounds_its_wait():
    """``StepFence`` on the optimizer: a step during which the group was aborted raises
    ``GroupAborted`` and leaves the parameters as they were; after ``reset`` (a new group)
    steps apply again. While it waits for the stream, the heartbeat sees it overdue once the
    collective timeout has passed (a clock of the test's)."""
    import torch

    from ddp_hpc.engine.recovery import fence as fence_module
    from ddp_hpc.engine.recovery.errors import GroupAborted
    from ddp_hpc.engine.recovery.group_abort import is_collective_error

    now = [100.0]
    fence = fence_module.StepFence("cpu", timeout_s=30.0, clock=lambda: now[0])
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    fence.attach(optimizer)

    def one_step() -> None:
        optimizer.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()

    before = [p.detach().clone() for p in model.parameters()]
    one_step()
    fence.step_ended()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    fence.mark_aborted()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(GroupAborted) as refused:
        one_step()
    assert is_collective_error(refused.value)  # InJobRecovery.run recovers from it
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    fence.reset()
    one_step()
    fence.step_ended()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    # The step's end: one whose optimizer step passed counts whatever came after; one whose
    # optimizer step never ran (a gradient scaler skipped it on the inf an abort left) is
    # checked there instead.
    one_step()
    fence.mark_aborted()
    fence.step_ended()
    with pytest.raises(GroupAborted):
        fence.step_ended()
    fence.reset()
    fence.step_ended()

    # Two optimizer steps in one step, the abort between them: the first is applied, so no
    # whole state is left to go on from in the job (a restart in place).
    from ddp_hpc.engine.recovery.errors import RecoveryError

    one_step()
    fence.mark_aborted()
    with pytest.raises(RecoveryError, match="between two optimizer steps of one step"):
        one_step()
    fence.reset()

    seen = []

    def slow_stream(device_type: str) -> None:  # the heartbeat's view while the step's work is not done
        seen.append(fence.overdue())
        now[0] += 31.0
        seen.append(fence.overdue())

    original, fence_module.wait_for_stream = fence_module.wait_for_stream, slow_stream
    try:
        one_step()
    finally:
        fence_module.wait_for_stream = original
    assert seen == [False, True] and not fence.overdue()


def _one_rank_through_an_aborted_group(backend: str, steps: int, publish_at: int | None, folder: str,
                                       results, hang_at: int | None = None) -> None:
    """One rank under ``InJobRecovery(backend)`` on a launch store served here. At step
    ``publish_at`` this process plays the launch: it publishes the next plan, as for a lost
    peer; the rank's heartbeat aborts the group, the step it lands in is refused, the rank
    forms the next group and trains on. Puts the final state, the generation and how often
    ``train`` was called. Over gloo (the CPU dry run) the group is handled as NCCL's is,
    fence and abort, where gloo's abort does nothing: the fence alone keeps the step out.
    ``hang_at``: from that step the step's work never finishes (the fence's wait holds until
    an abort), no plan comes: puts the error ``run`` ended with."""
    import time

    from ddp_hpc.contract import RECOVERY_STORE_VAR, RECOVERY_WAIT_VAR
    from ddp_hpc.environment.ports import free_port
    from ddp_hpc.engine.recovery.store import LaunchStore, Plan

    os.environ.update({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "0",
                       "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    import torch
    from torch import nn

    from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
    from ddp_hpc.engine.recovery import group_abort, rank
    from ddp_hpc.engine.recovery.errors import RecoveryError

    if backend == "gloo":
        group_abort.ABORTED_BACKENDS["gloo"] = "cpu"
    marked_first = []
    abort_group = group_abort.abort_group

    def abort_marked_first(group, slot):  # the fence marked before the abort: a kernel it cuts short is seen
        marked_first.append(recovery._fence.aborted)
        abort_group(group, slot)

    group_abort.abort_group = abort_marked_first
    if hang_at is not None:
        from ddp_hpc.engine.recovery import fence

        def never_done(device_type: str) -> None:  # a collective no peer joins: the wait ends with an abort
            while not recovery._fence.aborted:
                time.sleep(0.01)

        fence.wait_for_stream = lambda device_type: never_done(device_type) if recovery.step >= hang_at else None
    launch = LaunchStore()
    os.environ.update({RECOVERY_STORE_VAR: launch.address, RECOVERY_WAIT_VAR: "60" if hang_at is None else "2",
                       "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    recovery = rank.InJobRecovery(backend, run_dir=folder, heartbeat_s=0.05,
                                  collective_timeout_s=60 if hang_at is None else 1)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    # A gradient scaler (the Trainer's fp16 path): the refused step is refused inside scaler.step.
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10)
    checkpointer = Checkpointer(folder, {"model": model, "optimizer": optimizer, "scaler": scaler})
    calls = []

    def train(ddp_model: nn.Module) -> None:
        calls.append(recovery.step)
        while recovery.step < steps:
            batch = torch.randn(64, 32, generator=torch.Generator().manual_seed(recovery.step)).to(device)
            optimizer.zero_grad()
            scaler.scale(ddp_model(batch).pow(2).mean()).backward()
            if recovery.step == publish_at and recovery.generation == 0:
                launch.publish(Plan(generation=launch.next_generation(), world_size=1, ranks={0: 0}, lost=1,
                                    host="elsewhere", cause="the test's plan", detected_at=time.time(),
                                    replaced=False))
                deadline = time.monotonic() + 30
                while not recovery._fence.aborted and time.monotonic() < deadline:  # the abort lands in this step
                    time.sleep(0.01)
            scaler.step(optimizer)
            scaler.update()
            recovery.step_done()

    try:
        recovery.run(train, model=model, optimizer=optimizer, checkpointer=checkpointer)
    except RecoveryError as exc:
        results.put({"error": str(exc), "marked_first": marked_first, "step": recovery.step})
        recovery.close()
        return
    state = io.BytesIO()  # bytes, not tensors: a tensor in a queue is shared memory gone with this process
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, state)
    results.put({"state": state.getvalue(), "generation": recovery.generation, "marked_first": marked_first,
                 "calls": calls, "step": recovery.step, "recoveries": len(recovery.recoveries)})
    recovery.close()


def run_one_rank_through_an_aborted_group(backend: str, tmp_path, publish_at: int | None) -> dict:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    folder = tmp_path / f"{backend}-{publish_at}"
    child = context.Process(target=_one_rank_through_an_aborted_group, args=(backend, 8, publish_at, str(folder),
                                                                             results))
    child.start()
    try:
        return results.get(timeout=240)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()


def assert_the_aborted_step_was_redone_bit_identical(backend: str, tmp_path) -> None:
    import torch

    reference = run_one_rank_through_an_aborted_group(backend, tmp_path, None)
    aborted = run_one_rank_through_an_aborted_group(backend, tmp_path, 3)
    for run in (reference, aborted):
        run["state"] = torch.load(io.BytesIO(run["state"]), weights_only=True)
    assert reference["generation"] == 0 and reference["calls"] == [0]
    assert aborted["generation"] == 1 and aborted["recoveries"] == 1, aborted
    assert aborted["calls"] == [0, 3], aborted  # the step in which the abort landed was not applied
    assert aborted["marked_first"] == [True] and reference["marked_first"] == []
    assert aborted["step"] == reference["step"] == 8
    for name, expected in reference["state"].items():
        assert torch.equal(expected, aborted["state"][name]), name


def test_a_step_the_group_was_aborted_in_is_refused_and_redone_in_the_next_group_cpu_dry_run(tmp_path):
    """The NCCL path's CPU dry run (the same run with one GPU and nccl: tests/test_gpu_recovery.py):
    the heartbeat aborts the group on the launch's newer plan, the fence refuses the step it
    landed in, the rank forms the next group on its own and ends bit-identical to a run
    without the plan."""
    assert_the_aborted_step_was_redone_bit_identical("gloo", tmp_path)  # a gradient scaler's stages made fresh too


def test_a_step_whose_collectives_never_finish_is_aborted_after_the_collective_timeout(tmp_path):
    """Over NCCL nothing else ends a hung collective (torch's watchdog is off under
    recovery): the rank's heartbeat aborts the group once the step's wait has outlasted the
    collective timeout (1 s here), the step is refused, and with no plan from the launch the
    rank ends (``RecoveryError``) for a restart in place. The fence on gloo, its wait held."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_one_rank_through_an_aborted_group,
                            args=("gloo", 8, None, str(tmp_path / "hung"), results, 2))
    child.start()
    try:
        ended = results.get(timeout=240)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert ended["step"] == 2 and ended["marked_first"] == [True], ended
    assert "no new group from the launch within 2 s" in ended["error"], ended


def test_a_backend_this_torch_lacks_is_refused_in_one_line_without_a_recovering_launch():
    from ddp_hpc.engine.recovery import InJobRecovery

    with pytest.raises(UserError, match=r"InJobRecovery\('nccl'\): this torch \(.*\) has no nccl backend"):
        InJobRecovery("nccl", environ={})


def test_a_warm_spare_on_another_node_takes_a_local_rank_of_that_node():
    """A spare started as node 1's first rank (RANK 2, LOCAL_RANK 0 of 2 per node) that takes
    slot 3 is local rank 1 there, not 3 (outside the node's devices)."""
    from ddp_hpc.engine.recovery import spare_places

    assert spare_places({"RANK": "2", "LOCAL_RANK": "0"}, 3) == {"RANK": "3", "LOCAL_RANK": "1"}
    assert spare_places({"RANK": "0", "LOCAL_RANK": "0"}, 1) == {"RANK": "1", "LOCAL_RANK": "1"}


def test_a_warm_spares_device_is_the_one_of_the_local_rank_it_takes(monkeypatch, tmp_path):
    """The Trainer's start-up (``process_group``) under a recovering launch, on a node of 2
    GPUs: a warm spare chose a device before it knew its place (its node's first rank's,
    cuda:0); once the group start made it local rank 1, it computes on cuda:1, the lost
    rank's GPU, not beside local rank 0 on cuda:0, and it never made cuda:0 current (CUDA
    would keep a context there)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from ddp_hpc.device import DeviceChoice
    from ddp_hpc.engine.recovery import spare_places
    from ddp_hpc.environment.netcheck import NetworkPlan
    from ddp_hpc.startup.distributed import DistributedOptions, process_group

    class TwoGpus:
        def device_count(self, device_type: str) -> int:
            return {"cuda": 2}.get(device_type, 1)

        def backend_available(self, backend: str) -> bool:
            return backend == "gloo"

    activated = []
    monkeypatch.setattr("ddp_hpc.device.torch_host", lambda device, backend: TwoGpus())
    monkeypatch.setattr(DeviceChoice, "activate", lambda choice: activated.append(choice.index))
    monkeypatch.setattr("ddp_hpc.startup.distributed.check_network", lambda *args, **kwargs: NetworkPlan())
    environ = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "DDP_HPC_RECOVERY_SPARE": "0"}

    def start(settings):  # as InJobRecovery does for a spare: the launch names slot 3, then the group forms
        environ.update(spare_places(environ, 3))
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        return SimpleNamespace(close=dist.destroy_process_group)

    with process_group(DistributedOptions(device="cuda", backend="gloo"), environ, start=start) as ctx:
        assert ctx.local_rank == 1 and str(ctx.torch_device) == "cuda:1"
    assert activated == [1]  # cuda:0, its node's first rank's, never made current: no context held there

    # Over nccl the group itself is made on the device (device_id): InJobRecovery moves the
    # start it was handed (decided for cuda:0) to the local rank the spare took.
    import torch
    from datetime import timedelta

    from ddp_hpc.startup.group_start import GroupStart

    monkeypatch.setattr(TwoGpus, "backend_available", lambda self, backend: True, raising=False)
    activated.clear()
    before = GroupStart("nccl", timedelta(seconds=60), torch.device("cuda", 0))
    moved = before.for_local_rank(1, 2, environ)
    assert moved.device_id == torch.device("cuda", 1) and moved.backend == "nccl" and activated == [1]
    assert GroupStart("gloo", timedelta(seconds=60)).for_local_rank(1, 2, environ).device_id is None


@pytest.mark.parametrize("launcher", ["mpich", "openmpi"])
def test_recover_under_mpiexec_starts_one_node_supervisor_per_node(launcher, caplog):
    from ddp_hpc.launch.entry import plan_launch
    from ddp_hpc.launch.node import NodeSupervisors
    from ddp_hpc.launch.recovering import RecoveryLimits
    from ddp_hpc.launch.spec import LaunchSpec

    limits = RecoveryLimits(1, wait_s=120.0, shrink=False, hang_s=10.0, warm_spare=True)
    with caplog.at_level(logging.WARNING, logger="ddp_hpc"):
        supervisors = plan_launch(LaunchSpec(("python", "train.py"), nproc=4, launcher=launcher, recovery=limits),
                                  None).attempts
    assert isinstance(supervisors, NodeSupervisors) and not caplog.records
    argv = list(supervisors.attempts.argv)
    assert argv[argv.index("-n") + 1] == "1"  # one task: the node supervisor, which starts the 4 ranks
    node = argv[argv.index("launch") + 1:]
    assert node == ["--node-supervisor", "--nproc", "4", "--recover", "1", "--recovery-wait", "120",
                    "--hang-timeout", "10", "--warm-spare", "--", "python", "train.py"]


def test_recover_under_the_default_launcher_recovers(caplog):
    from ddp_hpc.contract import RECOVERY_SHRINK_VAR
    from ddp_hpc.engine.recovery.store import LaunchStore
    from ddp_hpc.launch.entry import plan_launch
    from ddp_hpc.launch.recovering import Recoverer, RecoveryLimits
    from ddp_hpc.launch.spec import LaunchSpec

    limits = RecoveryLimits(2, wait_s=60.0, shrink=True, hang_s=5.0, warm_spare=False)
    plan = plan_launch(LaunchSpec(("true",), nproc=2, recovery=limits), None)
    recoverer = plan.attempts
    assert isinstance(recoverer, Recoverer) and plan.in_job is recoverer
    assert (recoverer.limits.max_recoveries, recoverer.limits.shrink, recoverer.limits.hang_s) == (2, True, 5.0)
    recoverer._store = LaunchStore()  # each rank hears of --shrink (the Trainer refuses it)
    assert recoverer._environment(0)[RECOVERY_SHRINK_VAR] == "1"
    assert not caplog.records


#: A node supervisor's environment (recorded on this machine: Hydra 4.0, Open MPI 4.1, SLURM
#: 22.05), node 1 of 2; its ranks must read their own places, not this.
NODE_SUPERVISOR_TASKS = {
    "mpich": {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "6", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1",
              "MPIR_CVAR_CH3_INTERFACE_HOSTNAME": "n2"},
    "openmpi": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_NODE_RANK": "0", "PMIX_RANK": "1",
                "PMIX_NAMESPACE": "540737537", "OMPI_MCA_ess_base_vpid": "1", "OMPI_MCA_ess": "^singleton",
                "OMPI_UNIVERSE_SIZE": "2"},
    "slurm": {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_ID": "3",
              "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
              "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "2"},
}


@pytest.mark.parametrize("launcher", sorted(NODE_SUPERVISOR_TASKS))
def test_a_node_supervisors_ranks_read_their_own_places_not_the_launchers_task_variables(launcher):
    """The node supervisor is the launcher's task 1 of 2 (one per node); its 3 ranks are 3-5
    of 6. They start without its task variables: only torchrun's (and env://'s) say who they
    are, so nothing in them (an MPI library, a launcher check) takes itself for task 1."""
    from ddp_hpc.contract import RECOVERY_STORE_VAR
    from ddp_hpc.environment import resolve_env
    from ddp_hpc.environment.launchers import LAUNCHERS
    from ddp_hpc.launch.node import node_place, rank_base_environment
    from ddp_hpc.launch.local import LocalRanks

    task = {"PATH": "/usr/bin", "HOME": "/root", RECOVERY_STORE_VAR: "n1:29400", **NODE_SUPERVISOR_TASKS[launcher]}
    assert node_place(task) == (1, 2)
    ranks = LocalRanks(3, ["python", "train.py"], base_env=rank_base_environment(task), node_rank=1, num_nodes=2,
                       master_addr="n1")
    for local_rank in range(3):
        env = ranks.environment(local_rank, attempt=0, port=29400, run_id="abc")
        assert [found.name for found in LAUNCHERS if found.detect(env)] == ["torchrun", "env", "single"]
        assert env["PATH"] == "/usr/bin" and RECOVERY_STORE_VAR not in env  # Recoverer sets the store's itself
        place = resolve_env(env)
        assert (place.rank, place.world_size, place.local_rank, place.node_rank, place.num_nodes) == (
            3 + local_rank, 6, local_rank, 1, 2)
        assert (place.master_addr, place.master_port) == ("n1", 29400)


def test_a_node_supervisor_started_more_than_once_per_node_is_refused_in_one_line():
    from ddp_hpc.launch.node import node_place

    with pytest.raises(UserError, match="runs once per node.*mpich started 2 on this one") as refused:
        node_place({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert "\n" not in str(refused.value)


def test_node_supervisors_draw_each_generation_once_from_the_store_and_latest_only_rises(tmp_path):
    """Two node supervisors (2 nodes, 1 rank each) around one served store, as under mpiexec
    -ppn 1: each replaces its own lost rank (slot 0 on node 0, slot 1 on node 1); the plans
    get generations 1 and 2 from the store's counter, not 1 twice; a plan published late
    never lowers ``latest``; --recover 2 counts both nodes' recoveries."""
    import subprocess
    import sys

    from ddp_hpc.engine.recovery.store import LATEST_KEY, LaunchStore, Plan, plan_key, ready_key
    from ddp_hpc.launch.recovering import Recoverer, RecoveryLimits
    from ddp_hpc.launch.local import LocalRanks

    served = LaunchStore()
    rank = [sys.executable, "-c", "import time; time.sleep(60)"]
    nodes = [Recoverer(LocalRanks(1, rank, node_rank=node, num_nodes=2), RecoveryLimits(2, hang_s=600),
                       store_address=served.address) for node in range(2)]
    children = [node.start(0) for node in nodes]
    try:
        assert [child[0].args for child in children] == [rank, rank]
        for slot in range(2):
            served.store.set(ready_key(slot), "1")
        for node, lost in ((0, 0), (1, 1)):
            children[node][0].kill()
            children[node][0].wait()
            assert nodes[node].on_failure(0, 137, children[node])
            served.store.set(ready_key(lost), "1")  # its replacement joined
        assert served.store.check([plan_key(1), plan_key(2)]), "two node supervisors published one generation"
        plans = [Plan.from_json(served.store.get(plan_key(generation))) for generation in (1, 2)]
        assert [(plan.generation, plan.lost, plan.world_size, plan.ranks) for plan in plans] == [
            (1, 0, 2, {0: 0, 1: 1}), (2, 1, 2, {0: 0, 1: 1})]
        assert int(served.store.get(LATEST_KEY)) == 2
        served.publish(plans[0])  # an older plan, published late
        assert int(served.store.get(LATEST_KEY)) == 2
        # The recoveries of both nodes count: a third loss, on either node, is beyond --recover 2.
        children[0][0].kill()
        children[0][0].wait()
        assert not nodes[0].on_failure(0, 137, children[0])
    finally:
        for child in (one for node in children for one in node):
            if child.poll() is None:
                child.kill()
                child.wait()
        for node in nodes:
            node.close()


def test_a_negative_recovery_count_is_refused():
    from ddp_hpc.launch.recovering import RecoveryLimits

    with pytest.raises(UserError, match="--recover -1 must be >= 0"):
        RecoveryLimits(-1)


def test_a_warm_spare_with_shrinking_is_refused():
    from ddp_hpc.launch.recovering import RecoveryLimits

    with pytest.raises(UserError, match="--warm-spare replaces a lost rank, --shrink goes on without it"):
        RecoveryLimits(1, shrink=True, warm_spare=True)


def test_a_ranks_streams_after_any_step_are_rebuilt_from_its_base_seed_alone():
    """What lets a rank lost anywhere in a step be replaced: its streams after step N are
    ``step_seed(base, N)``'s, whatever it drew before; other steps and bases differ."""
    import torch

    from ddp_hpc.engine.rng import capture_rng, seed_for_step, step_seed

    def same_streams(a, b) -> bool:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same_streams(a[key], b[key]) for key in a)
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    seed_for_step(1001, 7)
    after_7 = capture_rng()
    torch.rand(3)
    seed_for_step(1001, 7)
    assert same_streams(after_7, capture_rng())
    seed_for_step(1001, 8)
    assert not same_streams(after_7, capture_rng())
    seed_for_step(1002, 7)
    assert not same_streams(after_7, capture_rng())
    assert len({step_seed(base, step) for base in range(1000, 1004) for step in range(4)}) == 16


def test_a_replacement_takes_the_base_seed_its_slot_left_in_the_store_not_its_own():
    import torch

    from ddp_hpc.engine.recovery import store as keys
    from ddp_hpc.engine.recovery import InJobRecovery

    store = keys.LaunchStore()
    torch.manual_seed(1002)
    first = object.__new__(InJobRecovery)
    first.slot, first._store, first.enabled, first.generation, first._checkpointer = 2, store.store, True, 0, None
    assert first._base_seed() == 1002
    torch.manual_seed(0)  # a warm spare seeds before it knows its slot
    replacement = object.__new__(InJobRecovery)
    replacement.slot, replacement._store, replacement.enabled, replacement.generation = 2, store.store, True, 1
    replacement._checkpointer = None
    assert replacement._base_seed() == 1002


def test_a_restart_takes_the_base_seed_its_checkpoint_kept_not_the_seed_the_restore_left(tmp_path):
    """Restoring a checkpoint restores the streams, which reseeds torch with the step's seed:
    the base comes from the rank's own part of the checkpoint (the Checkpointer's rank
    extras), so that a restart in place goes on with the streams the run without it had."""
    import torch
    from torch import nn

    from ddp_hpc import Checkpointer
    from ddp_hpc.engine.recovery import STREAM_SEED, InJobRecovery
    from ddp_hpc.engine.rng import seed_for_step, step_seed

    saving = Checkpointer(tmp_path, {"model": nn.Linear(2, 2)})
    saving.rank_extras[STREAM_SEED] = 1001
    seed_for_step(1001, 5)
    saving.step = 5
    saving.save(wait=True)
    torch.manual_seed(0)
    restarted = Checkpointer(tmp_path, {"model": nn.Linear(2, 2)})
    restarted.restore()
    assert torch.initial_seed() == step_seed(1001, 5) and restarted.rank_extras == {STREAM_SEED: 1001}
    recovery = object.__new__(InJobRecovery)
    recovery.slot, recovery._store, recovery.enabled, recovery.generation = 0, None, False, 0
    recovery._checkpointer = restarted
    assert recovery._base_seed() == 1001


#: A rank that stops (75) on SIGUSR2. A replacement (or a warm spare) installs its handler only
#: once told to (a file), as one still importing torch has none yet: a SIGUSR2 before it would end it.
STOPPABLE_RANK = """
import os, signal, sys, time
from pathlib import Path
folder = Path(os.environ["TEST_FOLDER"])
if os.environ.get("DDP_HPC_RECOVERY_GENERATION") or os.environ.get("DDP_HPC_RECOVERY_SPARE"):
    while not (folder / "go").exists():
        time.sleep(0.02)
signal.signal(signal.SIGUSR2, lambda *_: sys.exit(75))
(folder / f"armed-{os.getpid()}").write_text("")
time.sleep(60)
sys.exit(1)
"""


@pytest.mark.parametrize("warm_spare", [False, True], ids=["new-process", "warm-spare"])
def test_a_stop_that_comes_while_a_replacement_starts_is_held_for_it_until_it_is_up(tmp_path, warm_spare):
    """The launch's logic in this process (ranks are small Python processes, no torch): rank 1
    is killed, its replacement started (or the warm spare given its place); a stop then goes
    to rank 0 at once and to the replacement only once it has started InJobRecovery (its
    ready key), so nothing ends it and the launch ends with 75 (stopped on request)."""
    import os
    import signal
    import sys
    import threading
    import time

    from ddp_hpc.engine.recovery.store import ready_key
    from ddp_hpc.launch.recovering import Recoverer, RecoveryLimits
    from ddp_hpc.launch.restart import RestartPolicy
    from ddp_hpc.launch.local import LocalRanks
    from ddp_hpc.launch.supervisor import Supervisor

    def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    def armed(child) -> bool:
        return (tmp_path / f"armed-{child.pid}").exists()

    ranks = LocalRanks(2, [sys.executable, "-c", STOPPABLE_RANK], base_env={**os.environ,
                                                                            "TEST_FOLDER": str(tmp_path)})
    recoverer = Recoverer(ranks, RecoveryLimits(1, hang_s=600, warm_spare=warm_spare))  # none is frozen here
    supervisor = Supervisor(recoverer.start, RestartPolicy(0), end_grace_s=5, in_job=recoverer)
    statuses: list[int] = []
    runner = threading.Thread(target=lambda: statuses.append(supervisor.run()), daemon=True)
    runner.start()
    try:
        wait_for(lambda: len(supervisor._children) == 2 and all(map(armed, supervisor._children)), "ranks up")
        first = list(supervisor._children)
        for slot in range(2):  # as InJobRecovery says it runs
            recoverer._store.store.set(ready_key(slot), "1")
        if warm_spare:
            wait_for(lambda: recoverer._spare is not None, "no spare started")
            spare = recoverer._spare
        first[1].kill()
        wait_for(lambda: supervisor._children[1] is not first[1], "no replacement started")
        replacement = supervisor._children[1]
        if warm_spare:
            assert replacement is spare

        supervisor.request_stop(signal.SIGUSR2)
        wait_for(lambda: first[0].poll() is not None, "rank 0 did not get the stop")
        assert first[0].returncode == 75
        time.sleep(0.5)
        assert replacement.poll() is None, "the stop reached the replacement before it could take it"

        (tmp_path / "go").write_text("")
        wait_for(lambda: armed(replacement), "the replacement never installed its handler")
        recoverer._store.store.set(ready_key(1), "1")
        runner.join(timeout=30)
        assert not runner.is_alive()
        assert replacement.returncode == 75 and statuses == [75]
    finally:
        for child in supervisor._children:
            if child.poll() is None:
                child.kill()
                child.wait()


class NotPlain:
    """An object that torch.load(weights_only=True) refuses to build."""


def test_the_state_travels_as_bytes_read_back_weights_only():
    """What a survivor sends (torch.save into a uint8 tensor) comes back equal on the
    receiver, read with weights_only=True: an object that is not tensors and plain data is
    refused in one line instead of being unpickled."""
    import torch

    from ddp_hpc import ResumableSampler
    from ddp_hpc.engine.recovery import RecoveryError, state_from_tensor, state_to_tensor

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    sampler = ResumableSampler(torch.utils.data.TensorDataset(torch.arange(10)), num_replicas=2, rank=0,
                               batch_size=2)
    sampler.advance()
    state = {"step": 3, "objects": {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                    "sampler": sampler.state_dict()},
             "checkpointer": {"step": 3, "saved_step": None, "saved_path": None, "extras": {"best": 0.5}}}
    payload = state_to_tensor(state)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    received = state_from_tensor(payload.clone())
    assert received["step"] == 3 and received["checkpointer"] == state["checkpointer"]
    assert received["objects"]["sampler"] == sampler.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(received["objects"]["model"][key], value)
    assert torch.equal(received["objects"]["optimizer"]["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])

    with pytest.raises(RecoveryError, match=r"NotPlain.*weights_only=True") as refused:
        state_from_tensor(state_to_tensor({**state, "extras": NotPlain()}))
    assert "\n" not in str(refused.value)


#: A rank that stops (75) on SIGUSR2 and says where it runs and what its environment holds.
RANK_THAT_STOPS = """
import json, os, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGUSR2, lambda *_: sys.exit(75))
seen = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_FD")}
Path(os.environ["TEST_FOLDER"], f"up-{os.getpid()}").write_text(json.dumps(seen))
time.sleep(40)
sys.exit(1)
"""


@pytest.mark.multiproc
def test_under_mpich_a_stop_reaches_the_node_supervisors_ranks_through_the_store_and_the_launch_exits_75(
        mpich, tmp_path):
    """Hydra does not pass SIGUSR2 on (it dies of it): the launch asks the node supervisor for
    the stop through the store, which passes it on to its ranks; their 75 comes back out
    through the node supervisor and mpiexec. The ranks start without Hydra's PMI variables."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from conftest import clean_env, ddp_hpc_command

    process = subprocess.Popen([*ddp_hpc_command(), "launch", "--launcher", "mpich", "--recover", "1", "--nproc", "2",
                                "--", sys.executable, "-c", RANK_THAT_STOPS],
                               env=clean_env({"TEST_FOLDER": str(tmp_path)}), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("up-*"))) < 2:
            assert process.poll() is None and time.monotonic() < deadline, "the ranks never came up"
            time.sleep(0.1)
        process.send_signal(signal.SIGUSR2)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            import os

            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 75, output[-3000:]
    seen = sorted((json.loads(path.read_text()) for path in tmp_path.glob("up-*")), key=lambda one: one["RANK"])
    assert seen == [{"RANK": rank, "WORLD_SIZE": "2", "PMI_RANK": None, "PMI_FD": None} for rank in ("0", "1")]


def test_a_node_supervisor_watches_and_hands_a_spare_to_the_slots_of_its_own_node(tmp_path):
    """Node 1 of 2 with 2 ranks each (slots 2 and 3): its warm spare is named apart from node
    0's, takes the place of a lost slot 3, and its heartbeat watch reads slots 2 and 3 (a rank
    whose slot's counter stands still is ended as frozen)."""
    import sys
    import time

    from ddp_hpc.engine.recovery.store import LaunchStore, Plan, alive_key, plan_key, ready_key, spare_key
    from ddp_hpc.launch.recovering import Recoverer, RecoveryLimits
    from ddp_hpc.launch.local import LocalRanks

    served = LaunchStore()
    rank = [sys.executable, "-c", "import time; time.sleep(60)"]
    node = Recoverer(LocalRanks(2, rank, node_rank=1, num_nodes=2), RecoveryLimits(2, hang_s=0.5, warm_spare=True),
                     store_address=served.address)
    children = node.start(0)
    try:
        for slot in range(4):
            served.store.set(ready_key(slot), "1")
        node.watch(children)
        spare = node._spare
        assert spare is not None and spare.args == rank
        children[1].kill()
        children[1].wait()
        assert node.on_failure(1, 137, children)
        assert children[1] is spare and int(served.store.get(spare_key("1.1"))) == 3
        assert Plan.from_json(served.store.get(plan_key(1))).lost == 3
        served.store.set(ready_key(3), "1")  # the spare joined
        # Slot 2's counter stands still, slot 3's moves: only node 1's first child (slot 2) is frozen.
        deadline = time.monotonic() + 10
        while children[0].poll() is None:
            assert time.monotonic() < deadline, "the frozen rank in slot 2 was not ended"
            served.store.add(alive_key(3), 1)
            node._next_watch = 0.0
            node.watch(children)
            time.sleep(0.1)
        assert children[1].poll() is None
        assert node._causes == {0: "frozen: no heartbeat for 0.5 s"}
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        node.close()


def test_a_process_state_is_read_from_proc_after_the_last_parenthesis_stopped_or_not(tmp_path):
    """``/proc/PID/stat``: the command name, in parentheses, may hold both; ``T`` and ``t``
    are stopped; a process gone (or no /proc) reads as None, never stopped."""
    import signal
    import subprocess
    import sys
    import time

    from ddp_hpc.launch.proc_state import is_stopped, parse_state, process_state

    assert parse_state("42 (a) b (T x) S 1 42 42 0 -1") == "S"
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text("7 (py) t 1 7 7 0 -1\n")
    assert process_state(7, tmp_path) == "t" and is_stopped(7, tmp_path) and process_state(8, tmp_path) is None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not is_stopped(child.pid)
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not is_stopped(child.pid):
            assert time.monotonic() < deadline, process_state(child.pid)
            time.sleep(0.01)
        assert process_state(child.pid) == "T"
        child.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while is_stopped(child.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is None and not is_stopped(child.pid)


def test_a_replacement_stopped_before_its_first_heartbeat_is_ended_after_the_hang_timeout():
    """Issue 44: two ranks not ready yet (no heartbeat: starting replacements); the one
    stopped (SIGSTOP) is ended once it was seen stopped for ``hang_s``, naming the cause; the
    one still starting is left alone, and so is a rank stopped and continued before that."""
    import signal
    import time

    from ddp_hpc.engine.recovery.store import LaunchStore
    from ddp_hpc.launch.local import LocalRanks
    from ddp_hpc.launch.proc_state import is_stopped
    from ddp_hpc.launch.recovering import Recoverer, RecoveryLimits

    served = LaunchStore()
    node = Recoverer(LocalRanks(3, ["sleep", "60"]),
                     RecoveryLimits(1, hang_s=0.5), store_address=served.address)
    children = node.start(0)
    try:
        for index in (0, 2):
            children[index].send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not (is_stopped(children[0].pid) and is_stopped(children[2].pid)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started = time.monotonic()
        while children[0].poll() is None:
            assert time.monotonic() - started < 10, "the stopped rank in slot 0 was not ended"
            if time.monotonic() - started > 0.3 and is_stopped(children[2].pid):
                children[2].send_signal(signal.SIGCONT)  # stopped for less than hang_s
            node._next_watch = 0.0
            node.watch(children)
            time.sleep(0.05)
        assert time.monotonic() - started >= 0.5 and children[0].returncode == -signal.SIGKILL
        assert node._causes == {0: "frozen (stopped) before its first heartbeat"}
        assert children[1].poll() is None and children[2].poll() is None
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        node.close()


def test_a_node_supervisor_reads_its_ranks_heartbeats_in_a_few_requests_a_tick_whatever_their_number():
    """Recoverer.watch asks which of a node's 600 ranks are ready and reads their counters in
    requests of 256 keys (9 here), not two requests a rank (1,200), and still sees a
    counter that moved and ends a rank whose counter stood still."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    from ddp_hpc.bench.store_calls import CountingStore
    from ddp_hpc.engine.recovery.store import LaunchStore, alive_key, ready_key
    from ddp_hpc.launch.recovering import Recoverer, RecoveryLimits
    from ddp_hpc.launch.local import LocalRanks

    served = LaunchStore()
    ranks = 600
    served.store.multi_set([ready_key(slot) for slot in range(ranks)] + [alive_key(slot) for slot in range(ranks)],
                           ["1"] * ranks + ["0"] * ranks)
    node = Recoverer(LocalRanks(ranks, ["true"]), RecoveryLimits(1, hang_s=0.3))
    node._store = LaunchStore(address=served.address)
    node.members = {slot: slot for slot in range(ranks)}
    node._store.store = counting = CountingStore(node._store.store)
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    children = [SimpleNamespace(returncode=None, pid=0, kill=lambda: None) for _ in range(ranks - 1)] + [frozen]
    try:
        node.watch(children)
        assert counting.calls == 3 + 3 + 3  # ready: 3 checks; counters: 3 checks and 3 multi_gets
        started = time.monotonic()
        while frozen.poll() is None and time.monotonic() - started < 10:
            served.store.multi_set([alive_key(slot) for slot in range(ranks - 1)],
                                   [str(int(time.monotonic() * 1000))] * (ranks - 1))
            node._next_watch = 0.0
            node.watch(children)
            time.sleep(0.05)
        assert frozen.poll() is not None and node._causes == {ranks - 1: "frozen: no heartbeat for 0.3 s"}
    finally:
        if frozen.poll() is None:
            frozen.kill()
        frozen.wait()


#: The Trainer, small: configs/synthetic.yaml with a few hundred samples.
SMALL_TRAINER = ["job.params.samples=256", "job.params.val_samples=0", "job.params.input_dim=16",
                 "job.params.hidden=32", "job.params.depth=2", "training.batch_size=16", "training.epochs=1",
                 "logging.progress=never", "logging.plot=false"]


@pytest.mark.parametrize("override, why", [
    ("training.zero_optimizer=true", "in-job recovery \\(--recover\\).*each rank holds one shard of the optimizer state"),
    ("shrink", "the Trainer does not yet go on with fewer ranks under --recover --shrink"),
])
def test_the_trainer_refuses_in_job_recovery_where_it_cannot_go_on(monkeypatch, tmp_path, override, why):
    """Under `ddp-hpc launch --recover` (its store's address in the environment) the Trainer
    refuses, in one line, before it starts a group or makes its run folder: ZeRO (a survivor
    lacks the lost rank's optimizer shard, of which no snapshot is kept) and --shrink (not
    re-planned for fewer ranks yet)."""
    import ddp_hpc
    from ddp_hpc.config_loader import ConfigError
    from ddp_hpc.contract import RECOVERY_SHRINK_VAR, RECOVERY_STORE_VAR, RECOVERY_WAIT_VAR
    from conftest import REPO

    monkeypatch.setenv(RECOVERY_STORE_VAR, "127.0.0.1:1")  # nothing listens: a group would not form
    monkeypatch.setenv(RECOVERY_WAIT_VAR, "1")
    if override == "shrink":
        monkeypatch.setenv(RECOVERY_SHRINK_VAR, "1")
    overrides = [*SMALL_TRAINER, f"logging.run_dir={tmp_path}", *([override] if override != "shrink" else [])]
    with pytest.raises(ConfigError, match=why) as refused:
        ddp_hpc.train(REPO / "configs" / "synthetic.yaml", overrides)
    assert "\n" not in str(refused.value)
    assert not any(tmp_path.iterdir())


def test_the_trainer_under_a_recovering_launch_trains_through_in_job_recovery(monkeypatch, tmp_path):
    """One rank under a recovering launch's store (served here): the Trainer's group is
    InJobRecovery's and each step is counted through it (the rank's RNG streams after its
    last step are in the store, for a replacement); at the end it leaves the store (its
    ready key gone: the launch no longer watches it)."""
    import ddp_hpc
    from ddp_hpc.contract import RECOVERY_STORE_VAR
    from ddp_hpc.engine.recovery import store as keys
    from conftest import REPO

    store = keys.LaunchStore()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.store.port),
                        RECOVERY_STORE_VAR: store.address}.items():
        monkeypatch.setenv(name, value)
    from ddp_hpc.training import trainer

    given = []
    real_watchdog = trainer.watchdog

    def watchdog(*args, **kwargs):
        given.append(kwargs.get("heartbeat"))
        return real_watchdog(*args, **kwargs)

    monkeypatch.setattr(trainer, "watchdog", watchdog)
    summary = ddp_hpc.train(REPO / "configs" / "synthetic.yaml", [*SMALL_TRAINER, f"logging.run_dir={tmp_path}",
                                                                 "distributed.watchdog_s=300"])
    assert summary.status.value == "completed" and summary.global_step == 16
    assert int(store.store.get(keys.seed_key(0))) == 0  # its base seed (training.seed + rank), for a replacement
    assert not store.ready(0)
    # Its watchdog reports through the recovery's heartbeat, the one the launch reads: no second thread.
    assert len(given) == 1 and given[0] is not None and given[0].keys.prefix.startswith("ddp_hpc/recovery/")


def test_in_job_recoverys_group_is_started_with_the_start_ups_network_plan_and_device(monkeypatch, tmp_path):
    """The Trainer under a recovering launch: the group InJobRecovery forms is initialised
    with what process_group()'s start-up decided (here a network plan that puts gloo on
    ``lo``, and the bound device), as the rendezvous's group would be, not by a bare
    init_process_group of its own."""
    import torch.distributed as dist

    import ddp_hpc
    from ddp_hpc.contract import RECOVERY_STORE_VAR
    from ddp_hpc.engine.recovery import store as keys
    from ddp_hpc.environment.netcheck import GLOO_IFNAME_VAR, NetworkPlan
    from conftest import REPO

    store = keys.LaunchStore()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.store.port),
                        RECOVERY_STORE_VAR: store.address}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(GLOO_IFNAME_VAR, raising=False)
    monkeypatch.setattr("ddp_hpc.startup.distributed.check_network",
                        lambda *args, **kwargs: NetworkPlan(gloo_ifname="lo", reason="test"))
    seen = []
    real_init = dist.init_process_group

    def init(*args, **kwargs):
        seen.append((os.environ.get(GLOO_IFNAME_VAR), kwargs.get("device_id", "absent")))
        return real_init(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", init)
    summary = ddp_hpc.train(REPO / "configs" / "synthetic.yaml", [*SMALL_TRAINER, f"logging.run_dir={tmp_path}"])
    assert summary.status.value == "completed"
    assert seen == [("lo", None)]  # gloo on the plan's interface; device_id passed (None: gloo on cpu)


@pytest.mark.parametrize("called", ["recovery", "checkpointer"])
def test_a_loop_calls_one_step_done_either_the_recoverys_or_the_checkpointers(monkeypatch, tmp_path, called):
    """Under ``InJobRecovery.run`` with a Checkpointer, its ``step_done`` and the recovery's
    are one call: 6 steps through either count 6 on both, advance the sampler 6 batches
    (not 12), reseed the streams after each step and save at the cadence."""
    import socket

    import torch
    from torch import nn

    from ddp_hpc import Checkpointer, ResumableSampler
    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.engine.rng import step_seed

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as probe:  # a free port for the one-rank group's store
        probe.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(probe.getsockname()[1]))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    recovery = InJobRecovery("gloo")  # off: the group through the rendezvous, as process_group() starts it
    try:
        model = nn.Linear(2, 2)
        sampler = ResumableSampler(list(range(64)), 1, 0, shuffle=False, seed=0, batch_size=4)
        checkpointer = Checkpointer(tmp_path, {"model": model, "sampler": sampler}, every_n_steps=3)
        torch.manual_seed(7)

        def train(ddp_model: nn.Module) -> None:
            for _ in range(6):
                (recovery if called == "recovery" else checkpointer).step_done()

        recovery.run(train, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler,
                     checkpointer=checkpointer)
        assert recovery.step == checkpointer.step == 6 and sampler.batches_done == 6
        assert torch.initial_seed() == step_seed(7, 6)
        assert sorted(path.name for path in tmp_path.glob("checkpoints/step-*.pt")) == [
            "step-00000003.pt", "step-00000006.pt"]
    finally:
        recovery.close()


def test_ranks_that_recover_in_the_job_get_nccls_error_handling_and_monitor_off_unless_the_user_set_them():
    """Under ``launch --recover`` the survivors abort a broken NCCL group themselves: their
    ranks start with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` and ``TORCH_NCCL_ENABLE_MONITORING=0``
    (a value the user set is kept); a launch without it keeps torchrun's ``1``."""
    import subprocess
    import sys

    from conftest import clean_env, ddp_hpc_command

    show = [sys.executable, "-c", "import os; print('seen', os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING'), "
                                  "os.environ.get('TORCH_NCCL_ENABLE_MONITORING'))"]

    def seen(*flags: str, **env: str) -> str:
        environment = {k: v for k, v in clean_env().items() if not k.startswith("TORCH_NCCL_")}
        result = subprocess.run([*ddp_hpc_command(), "launch", "--nproc", "1", *flags, "--", *show],
                                env={**environment, **env}, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        return next(line for line in result.stdout.splitlines() if line.startswith("seen "))

    assert seen("--recover", "1") == "seen 0 0"
    assert seen("--recover", "1", TORCH_NCCL_ENABLE_MONITORING="1") == "seen 0 1"
    assert seen() == "seen 1 None"


def test_a_warm_spare_forms_its_group_with_the_start_moved_to_the_local_rank_it_takes(monkeypatch):
    """``InJobRecovery`` handed a ``GroupStart`` decided before the spare had a place (the
    Trainer's: its node's first rank's device, cuda:0): once the launch names the slot it
    takes (slot 3, local rank 1 of a node of 2), its NCCL group is started on cuda:1. A
    described 2-GPU host whose torch has NCCL; the forming itself is stopped where it would
    connect."""
    from datetime import timedelta

    import torch

    from ddp_hpc.contract import RECOVERY_SPARE_VAR, RECOVERY_STORE_VAR
    from ddp_hpc.device import DeviceChoice
    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.engine.recovery.store import LaunchStore, Plan
    from ddp_hpc.startup.group_start import GroupStart

    class TwoGpus:
        def device_count(self, device_type: str) -> int:
            return {"cuda": 2}.get(device_type, 1)

        def backend_available(self, backend: str) -> bool:
            return True

    class Forming(Exception):
        pass

    started_on = []

    def form_newest(recovery, plan):
        started_on.append(recovery._settings().device_id)
        raise Forming

    monkeypatch.setattr("ddp_hpc.device.torch_host", lambda device, backend: TwoGpus())
    monkeypatch.setattr(DeviceChoice, "activate", lambda choice: None)
    monkeypatch.setattr(InJobRecovery, "_form_newest", form_newest)
    launch = LaunchStore()
    launch.publish(Plan(generation=1, world_size=4, ranks={slot: slot for slot in range(4)}, lost=3, host="h2",
                        cause="exit 137", detected_at=0.0, replaced=True))
    launch.assign("0", 3)
    environ = {RECOVERY_STORE_VAR: launch.address, RECOVERY_SPARE_VAR: "0", "RANK": "2", "WORLD_SIZE": "4",
               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
               "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    monkeypatch.setattr(torch.distributed, "is_backend_available", lambda backend: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    decided = GroupStart("nccl", timedelta(seconds=60), torch.device("cuda", 0))
    with pytest.raises(Forming):
        InJobRecovery("nccl", environ=environ, group_start=decided)
    assert started_on == [torch.device("cuda", 1)]
