"""Environment staging: run the ranks from a node-local copy of the Python environment.

Importing torch from a shared file system on every rank at once is slow at scale (ezpz
measured 70 s at 8 nodes, 750 s at 4,096). :func:`pack_environment` packs the environment
once into a relocatable tar file; :func:`stage_on_node`, run once per node, copies it to
node-local disk over a tree of the nodes. ``ddp-hpc stage`` and ``--stage-env`` of the
rendered scripts use them.
"""

from ddp_hpc.staging.fanout import (
    NodeSlot,
    StagedCopy,
    StageError,
    compare_import,
    node_slot,
    stage_on_node,
    staged_path,
)
from ddp_hpc.staging.pack import PackedEnvironment, pack_environment

__all__ = ["NodeSlot", "PackedEnvironment", "StageError", "StagedCopy", "compare_import", "node_slot",
           "pack_environment", "stage_on_node", "staged_path"]
