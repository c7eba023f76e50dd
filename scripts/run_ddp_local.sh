#!/usr/bin/env bash
# Train the main job (configs/digits.yaml) on NPROC local ranks with torchrun (CPU works;
# no cluster needed).
#
#   scripts/run_ddp_local.sh [NPROC] [ARGS...]
#
# ARGS go to `ddp-hpc train`: config overrides (training.epochs=5) or another config file
# as the first of them (scripts/run_ddp_local.sh 2 configs/preference.yaml).
# Sets up .venv on first use (scripts/bootstrap.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NPROC=${1:-2}
shift || true
case "$NPROC" in
  ''|*[!0-9]*|0) echo "run_ddp_local.sh: NPROC must be a positive integer, got '$NPROC'" >&2; exit 2 ;;
esac
CONFIG="$ROOT/configs/digits.yaml"
if [ $# -gt 0 ] && [[ "$1" == *.yaml || "$1" == *.yml ]]; then CONFIG=$1; shift; fi
VENV=$("$ROOT/scripts/bootstrap.sh" examples)
exec "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  -m ddp_hpc train "$CONFIG" "$@"
