"""ddp_hpc: one config takes a PyTorch DDP job from a laptop to a supercomputer."""

__version__ = "0.1.0"
