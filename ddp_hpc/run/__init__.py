"""``ddp-hpc run -- COMMAND``: run any command as one rank of a job, with torchrun's worker
variables (``torchrun_env.py``: ``command_environment``, the variables of whichever launcher
started this rank, turned into ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...). A Python
command is taken apart by ``python_command.py`` and run through ``script_runner.py``, a
stdlib-only file passed by path to the user's interpreter, which ends a process group the
script left open. Nothing here starts a process group itself."""
