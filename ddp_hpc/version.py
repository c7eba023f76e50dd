"""The package's version, at the bottom: every layer may read it (``import ddp_hpc`` from
inside the package would load the top of it, the public API)."""

__version__ = "0.1.0"
