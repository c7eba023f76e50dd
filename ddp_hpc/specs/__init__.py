"""What to submit, as data (as torchx's ``specs``): ``request.py`` (``SubmitRequest``: a
payload, a training config or a command, plus a cluster profile and the job's shape; the one
shell-quoting function ``shell_quote``), ``profiles.py`` (cluster profiles, the YAML files in
``ddp_hpc/clusters/``, and their loader) and ``sweep.py`` (``--sweep``: one array element per
combination). Nothing here renders a script, starts a process or imports torch; the
scheduler families (``ddp_hpc/schedulers/``) and the launch (``ddp_hpc/launch/``) read it."""
