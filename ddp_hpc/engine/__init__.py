"""The parts any training loop can use; the Trainer is built from the same ones.

- ``Checkpointer``: save a dict of objects at a step cadence (atomically, optionally in
  the background, ``keep_last`` kept; one file, or a sharded folder every rank writes its
  part of) and restore the newest readable checkpoint, every rank's RNG streams included.
- ``ResumableSampler``: the data order, resumable mid-epoch and on another world size.
- ``StopAgreement``: a stop every rank agrees on, after a signal or ahead of the job's
  deadline, then the requeue exit status.
- ``watchdog``: a context manager that ends a rank making no progress, naming silent ranks.
- ``consistency``: the bit-exact weights check across ranks.

Import them from ``ddp_hpc`` (``ddp_hpc.Checkpointer``, ...); docs/api.md shows a loop.
This package never imports ``ddp_hpc.training``.
"""
