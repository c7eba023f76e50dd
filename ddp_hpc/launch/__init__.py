"""Launching: starting a job's ranks and restarting them under the one restart policy.

- ``ddp-hpc launch`` on this machine: ``supervisor.py`` (the supervisor that owns the ranks'
  processes, passes stop signals on, ends the others when one fails), ``local.py`` (the ranks:
  ``ddp-hpc`` itself with torchrun's variables, or one ``mpiexec`` per attempt, built by
  ``mpi.py``), ``recovering.py`` (``--recover``: in-job recovery, the launch side) and
  ``hosts.py`` (``launch --hostfile``: mpiexec over listed hosts).
- The rendered scripts: ``script.py`` (the pieces every family renders; each script ends in
  ``exec ddp-hpc launch``, and the rank wrappers the launch uses), ``left_out.py`` (nodes
  left out after a failure).
- ``restart.py``: the one restart policy and exit-status contract, asked by all of them.

What is submitted (the request, cluster profiles, sweeps) is in ``ddp_hpc/specs/``; the
scheduler families that submit it are in ``ddp_hpc/schedulers/``, above this package.
"""
