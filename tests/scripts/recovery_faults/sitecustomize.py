"""Faults for tests/test_in_job_recovery.py, put exactly where each test says: Python imports
this module at start-up in every process whose PYTHONPATH holds this folder, and it patches
ddp_hpc's public parts in the rank in slot ``RECOVERY_FAULT_SLOT`` only.

``RECOVERY_FAULT``:
- ``window``: that rank dies (SIGKILL) after the optimizer step of step ``RECOVERY_FAULT_STEP``
  (its all-reduce done) and before ``step_done`` counts it;
- ``save``: it dies inside the checkpoint save of that step, once it wrote its own part
  and before the barrier after which rank 0 writes the file that makes it count;
- ``replacement``: as ``window``, and its first replacement dies once its new group has
  formed, before it took the state (the survivors are in the transfer).
- ``frozen-replacement``: as ``window``, and its first replacement stops itself (SIGSTOP) as
  it starts, before it imports torch: it never sends a heartbeat;
- ``backward``: that rank dies before its backward of step ``RECOVERY_FAULT_STEP`` (its
  forward done): its peers fail inside their backward's collectives;
- ``mid-backward``: that rank dies inside its backward of that step, once the gradient
  reaches the output of the module ``RECOVERY_FAULT_MODULE`` (a name in the model given to
  ``InJobRecovery.run``): what ran after that module in the forward has its gradients on
  every rank, its peers fail in the module's backward collectives;
- ``host``: as ``window``, in every slot of ``RECOVERY_FAULT_SLOT`` (a comma-separated list:
  the ranks of one host), and each first removes the snapshots it kept in its node's memory
  (``InJobRecovery``'s sharded snapshots), as the loss of the host would.

Each death happens once per run folder (a file in ``RUN_DIR`` says it happened), so that a
restart in place runs clean.
"""

import os
import signal
import sys
from pathlib import Path

FAULT = os.environ.get("RECOVERY_FAULT")


def _die(name: str, signum: int = signal.SIGKILL) -> None:
    done = Path(os.environ["RUN_DIR"]) / f"fault-{name}"
    if done.exists():
        return
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(f"{os.getpid()}\n")
    os.kill(os.getpid(), signum)


def _patch() -> None:
    from ddp_hpc.engine.checkpoint import files as checkpoint_files
    from ddp_hpc.engine import recovery as recovery_module

    step = int(os.environ["RECOVERY_FAULT_STEP"])
    generation = int(os.environ.get("DDP_HPC_RECOVERY_GENERATION", "0"))
    Recovery = recovery_module.InJobRecovery
    step_done, init, save_rank_part = Recovery.step_done, Recovery.__init__, checkpoint_files.save_rank_part
    run = Recovery.run

    def faulty_step_done(self, *args, **kwargs):
        if generation == 0 and FAULT in ("window", "replacement", "frozen-replacement") and self.step + 1 == step:
            _die("rank")
        if generation == 0 and FAULT == "host" and self.step + 1 == step:
            if self._snapshots is not None:  # its swaps done first: nothing of it is written after
                self._snapshots.wait()
                self._snapshots.files.remove(self._kept_slots())
            _die(f"rank-{self.slot}")
        return step_done(self, *args, **kwargs)

    def faulty_save_rank_part(directory, global_step, rank, part):
        path = save_rank_part(directory, global_step, rank, part)
        if generation == 0 and FAULT == "save" and global_step == step:
            _die("rank")
        return path

    def faulty_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        ranks.append(self)
        if FAULT == "replacement" and generation == 1:
            _die("replacement")

    ranks: list = []
    if FAULT == "backward":
        import torch

        backward = torch.Tensor.backward

        def faulty_backward(tensor, *args, **kwargs):
            if generation == 0 and ranks and ranks[0].step + 1 == step:
                _die("rank")
            return backward(tensor, *args, **kwargs)

        torch.Tensor.backward = faulty_backward

    def faulty_run(self, train, *, model, **kwargs):
        if generation == 0 and FAULT == "mid-backward":
            def die_in_backward(_grad):
                if self.step + 1 == step:
                    _die("rank")

            def on_forward(_module, _inputs, output):
                if self.step + 1 == step and output.requires_grad:
                    output.register_hook(die_in_backward)

            model.get_submodule(os.environ["RECOVERY_FAULT_MODULE"]).register_forward_hook(on_forward)
        return run(self, train, model=model, **kwargs)

    Recovery.step_done, Recovery.__init__, Recovery.run = faulty_step_done, faulty_init, faulty_run
    checkpoint_files.save_rank_part = faulty_save_rank_part


# `ddp-hpc run` runs the script through its script runner: the script is the last argument.
if FAULT and os.environ.get("RANK") in os.environ.get("RECOVERY_FAULT_SLOT", "").split(",") and \
        sys.argv[-1].endswith("recovering_loop.py"):
    if FAULT == "frozen-replacement" and os.environ.get("DDP_HPC_RECOVERY_GENERATION") == "1":
        _die("replacement", signal.SIGSTOP)
    _patch()
