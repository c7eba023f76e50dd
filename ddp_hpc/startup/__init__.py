"""Process-group start-up on every rank, and what checks it: ``distributed.py``
(``process_group()`` -> ``DistContext``, the one teardown ``end_process_group``),
``rendezvous.py`` (the TCPStore and the handshake under its own deadline), ``fail_fast.py``
(a failing rank ends the job: the launcher's abort), ``doctor.py`` (``ddp-hpc doctor``: start
a group and test it) and ``links.py`` (``doctor --links``: the link plan, measurement and
verdict). Where the rank sits in the job (which launcher, rank, sizes, the network checks
before the rendezvous) is read by ``ddp_hpc/environment/``, below this package."""
