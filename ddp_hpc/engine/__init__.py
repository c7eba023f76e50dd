"""The public parts any training loop can use (checkpointing, data order, stop agreement, consistency checks)."""
