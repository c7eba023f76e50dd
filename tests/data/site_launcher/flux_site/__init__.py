"""A site's launcher for ddp_hpc, from outside the package (a test fixture): a fake Flux."""
