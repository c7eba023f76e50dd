#!/usr/bin/env bash
# Every gpu test and the GPU figures, in one command, into one JSON file (issue 39):
#
#   scripts/gpu-check.sh [OUTPUT]         on a CUDA host (default OUTPUT: gpu-check.json)
#   scripts/gpu-check.sh --cpu [OUTPUT]   the dry run: the same steps on CPU, small sizes
#   scripts/gpu-check.sh --tests FILE...  other test files than those marking gpu tests
#
# From a fresh clone, with the machine's own torch: the package is found through PYTHONPATH
# (or an install made with `pip install -e . --no-deps`); nothing is installed and torch is
# never replaced. Python: $PYTHON, else the clone's .venv if there is one, else python3.
# pytest and the test extra's plugins (pytest-timeout) must be importable. What each step
# runs: scripts/gpu_check.py; what the figures mean: docs/performance.md ("GPUs").
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${PYTHON:-}" ]; then
  python=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then
  python=$ROOT/.venv/bin/python
else
  python=python3
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Tests start ranks as `ddp-hpc ...`: without an install there is no such command, so one on
# PATH runs this clone's package with this Python (named through the environment, not quoted).
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
export DDP_HPC_GPU_CHECK_PYTHON=$python
printf '#!/bin/sh\nexec "$DDP_HPC_GPU_CHECK_PYTHON" -m ddp_hpc "$@"\n' >"$shim/ddp-hpc"
chmod +x "$shim/ddp-hpc"
export PATH="$shim:$PATH"
status=0
"$python" "$ROOT/scripts/gpu_check.py" "$@" || status=$?
exit "$status"
