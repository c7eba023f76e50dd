"""Launching: ``ddp-hpc launch``, the whole of it, and the pieces of the rendered scripts.

- ``spec.py``: ``LaunchSpec``, the arguments checked once, holding the launcher object;
  ``entry.py``: ``launch(spec)``, the one ``Supervisor`` (``supervisor.py``) over what the
  launcher plans, its signal table and its end.
- ``launchers/``: one ``Launcher`` per ``--launcher NAME`` (its flags, plan, stop signals, dry
  run), found through the ``ddp_hpc.launchers`` entry points (``registry.py``).
- ``attempts.py``: the ``Attempts`` interface, one implementation per way of starting ranks:
  ``local.py`` (``LocalRanks``: ddp-hpc itself with torchrun's variables; ``MpiexecHere``),
  ``hosts.py`` (``launch --hostfile``: mpiexec over listed hosts), ``srun.py`` (one srun
  step per attempt); ``mpi.py`` builds the mpiexec lines. Wrappers around any of them:
  ``attempts.MarkedAttempts`` (each attempt's outcome) and ``node.NodeSupervisors`` (a node
  supervisor per node under ``--recover``); ``recovering.py`` recovers a node's ranks.
- ``outcome.py``: what an attempt ended as (finished, stopped, failed on which rank and host,
  the host left out), decided in one function from the launcher's status, the preempted
  marker and the failed-rank evidence each launcher gives.
- ``restart.py``: the one restart policy and exit-status contract, the one writer of exit
  files and the one requeue, and ``LaunchEnd``.
- The rendered scripts: ``script.py`` (the pieces every family renders; each script ends in
  ``exec ddp-hpc launch``, and the rank wrappers the launch uses), ``left_out.py`` (nodes
  left out after a failure).

What is submitted (the request, cluster profiles, sweeps) is in ``ddp_hpc/specs/``; the
scheduler families that submit it are in ``ddp_hpc/schedulers/``, above this package.
"""
