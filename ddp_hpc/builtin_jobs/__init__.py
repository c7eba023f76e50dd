"""Example jobs that ship with ddp_hpc; each trains on data that needs no download."""
