"""The recovery fuzzer (``python -m ddp_hpc.bench.recovery_fuzz``): ``cases.py`` draws a
case (model shape, loop shape, faults) from one seed, ``loop.py`` is the rank that trains it
and fires its faults, ``runner.py`` runs each case with and without its faults under
``ddp-hpc launch --recover`` and compares the ends bit for bit."""
