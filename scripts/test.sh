#!/usr/bin/env bash
# Run the test suite with everything it needs: the venv, Debian's Open MPI and MPICH, the
# two-node SLURM test cluster and the two-host test world (both started here; left running
# for the next run).
#
#   scripts/test.sh [PYTEST ARGS...]      e.g. scripts/test.sh -m "not slow"
#
# Without root (no apt-get, no daemons, no namespaces) the MPI, SLURM and multihost tests
# skip with their reason, unless DDP_HPC_REQUIRE_ALL=1 is set (.ci/run sets it): then a
# missing part fails.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [ "$(id -u)" = 0 ]; then
  for p in openmpi-bin mpich; do
    dpkg -s "$p" >/dev/null 2>&1 || {
      echo "test.sh: installing Debian's openmpi-bin and mpich" >&2
      DEBIAN_FRONTEND=noninteractive apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openmpi-bin mpich >/dev/null
      break
    }
  done
  scripts/dev-cluster.sh up
  scripts/dev-cluster.sh up --hosts 2  # network namespaces h1, h2 (docs/test-world.md)
  # Everything is installed and running: a test that finds a tool missing fails.
  export DDP_HPC_REQUIRE_ALL=1
elif [ "${DDP_HPC_REQUIRE_ALL:-0}" = 1 ]; then
  echo "test.sh: not root: nothing installed or started here; DDP_HPC_REQUIRE_ALL=1, so a test whose" \
       "Open MPI, MPICH, SLURM cluster or qsub is missing fails" >&2
else
  echo "test.sh: not root: MPI/SLURM packages and the test cluster are not set up here" >&2
fi
VENV=$(scripts/bootstrap.sh test,examples)
export PATH="$VENV/bin:$PATH"
exec "$VENV/bin/python" -m pytest "$@"
