#!/usr/bin/env bash
# Run the main job on NPROC local ranks with torchrun (CPU works; no cluster needed).
#
#   scripts/run_ddp_local.sh [NPROC] [ARGS...]
#
# Sets up .venv on first use (scripts/bootstrap.sh). ARGS go to `ddp-hpc doctor`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NPROC=${1:-2}
shift || true
case "$NPROC" in
  ''|*[!0-9]*|0) echo "run_ddp_local.sh: NPROC must be a positive integer, got '$NPROC'" >&2; exit 2 ;;
esac
VENV=$("$ROOT/scripts/bootstrap.sh" examples)
exec "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  -m ddp_hpc doctor "$@"
