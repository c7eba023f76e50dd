"""``ddp-hpc bench``: ``runner.py`` (the plan, torchrun launches, the table, JSON, plot),
``worker.py`` (one process per rank: the Trainer, a hand-written loop, bare start-up,
all_reduce), ``scale.py`` and ``scale_client.py`` (``--scale``: a simulated world of many
ranks through the real handshake; ``scale_recovery.py``, ``scale_recovery_launch.py`` and
``scale_recovery_ranks.py``: in-job recovery's store, heartbeats and plan, at the same
sizes; ``scale_harness.py``: what both share), ``goodput_run.py``, ``goodput_loop.py`` and
``goodput.py`` (``--goodput``: the harness, its training loop, goodput from the ranks' logs),
``checkpoint_formats.py`` (``--checkpoints``, against one copy to host memory),
``device_run.py`` (``--mfu``: the loops on the ranks' device, fp32/TF32/bf16), ``peaks.py``
(the bench model's FLOPs, the cards' peaks, MFU), ``device_clock.py`` (waiting for the device,
the host-copy baseline), ``results_file.py`` (the ``--output`` file, checked before any
work). docs/performance.md has the figures; ``scripts/gpu-check.sh`` runs the GPU ones."""
