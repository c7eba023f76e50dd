"""``ddp-hpc cluster probe|check|which``: a cluster profile from the scheduler's own answers
(``probe.py``: the family's reading is its ``ClusterReader``, ``SchedulerFamily.reader``:
``slurm/probe.py``, ``pbs/probe.py`` or a site family's; the node's in ``node.py``), a profile checked against them (``check.py``), and the profile that fits this
machine (``which.py``). Read-only: nothing here submits."""
