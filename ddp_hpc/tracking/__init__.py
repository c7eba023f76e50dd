"""What users watch and keep: experiment trackers, progress lines, the run record, curves."""

from ddp_hpc.tracking.hub import RunShape, Tracking

__all__ = ["RunShape", "Tracking"]
