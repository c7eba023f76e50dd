"""One module per launcher (``ddp-hpc launch --launcher NAME``), each a ``Launcher``
(base.py), found through the ``ddp_hpc.launchers`` entry points (launch/registry.py)."""
