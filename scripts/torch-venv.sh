#!/usr/bin/env bash
# Print the path of a venv holding torch==VERSION and ddp_hpc's dependencies (its examples
# extra too), for the torch-version smoke tests (tests/test_stacks.py); build it first where
# it is missing, stale or broken. The project's own venv and its torch are never touched.
#
#   scripts/torch-venv.sh VERSION           e.g. scripts/torch-venv.sh 2.5.1
#   scripts/torch-venv.sh --check VERSION   print the path where it is built, else exit 1
#
# The venv holds no ddp_hpc: each checkout under test puts itself first on PYTHONPATH (which
# every launcher passes to its ranks), so one cached venv serves any number of clones at once
# and a rank that misses the checkout fails to import ddp_hpc instead of running another copy.
# Its bin/ddp-hpc is the console script pip would write.
#
# Cached in $DDP_HPC_STACK_CACHE (default /var/cache/ddp_hpc/stacks)/torch-VERSION between
# runs. The stamp, written last, holds a key over this script, the interpreter's version, the
# torch version and ddp_hpc's dependency lists in pyproject.toml: when any of them changes, or
# a build stopped half-way, the venv is built again, into a temporary folder renamed into
# place. A lock per version serialises builders (two pytest workers, two clones).
# Costs on the 2-core VM: docs/test-world.md.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CHECK=0
if [ "${1:-}" = --check ]; then CHECK=1; shift; fi
VERSION=${1:?usage: scripts/torch-venv.sh [--check] VERSION}
[[ "$VERSION" =~ ^[0-9]+(\.[0-9]+)+$ ]] || { echo "torch-venv.sh: VERSION must look like 2.5.1, got '$VERSION'" >&2; exit 2; }
CACHE=${DDP_HPC_STACK_CACHE:-/var/cache/ddp_hpc/stacks}
PYTHON=${PYTHON:-python3}
VENV="$CACHE/torch-$VERSION"

# ddp_hpc's requirements: [project] dependencies plus the examples extra (configs/digits.yaml
# reads scikit-learn's data file; the examples import scikit-learn).
requirements=$("$PYTHON" - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib

with open(sys.argv[1], "rb") as file:
    project = tomllib.load(file)["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["examples"]))
PY
)
key=$( { cat "${BASH_SOURCE[0]}"; "$PYTHON" -VV; echo "torch==$VERSION"; echo "$requirements"; } \
       | sha256sum | cut -c1-16)
stamp="$VENV/.ddp_hpc-stack-stamp"
ready() { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$VENV/bin/python" ]; }

if [ "$CHECK" = 1 ]; then
  ready && { echo "$VENV"; exit 0; }
  exit 1
fi
mkdir -p "$CACHE"
exec 9>"$CACHE/torch-$VERSION.lock"
flock 9
if ! ready; then
  started=$SECONDS
  tmp="$CACHE/.torch-$VERSION.tmp-$$"
  trap 'rm -rf "$tmp" "$tmp.old"' EXIT
  echo "torch-venv.sh: building $VENV (torch==$VERSION)" >&2
  "$PYTHON" -m venv "$tmp"
  mapfile -t reqs <<<"$requirements"
  # --no-compile and compileall afterwards, as in scripts/bootstrap.sh: pip compiles one file
  # at a time, and with PYTHONDONTWRITEBYTECODE no import would write the .pyc files.
  "$tmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile "torch==$VERSION" "${reqs[@]}"
  "$tmp/bin/python" - "$VERSION" <<'PY'
import compileall, importlib.util, os, sys, sysconfig

for folder in sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}):
    compileall.compile_dir(folder, quiet=2, workers=0)
import torch
import torch.distributed as dist

if torch.__version__.split("+")[0] != sys.argv[1]:
    sys.exit(f"torch-venv.sh: asked for torch {sys.argv[1]}, got {torch.__version__}")
if not (dist.is_available() and dist.is_gloo_available()):
    sys.exit(f"torch-venv.sh: torch {torch.__version__} has no gloo backend")
if not os.path.exists(importlib.util.cache_from_source(torch.__file__)):
    sys.exit("torch-venv.sh: byte-compiling left no .pyc for torch")
PY
  cat >"$tmp/bin/ddp-hpc" <<EOF
#!$VENV/bin/python
# The console script pip writes for ddp_hpc; ddp_hpc itself comes from PYTHONPATH.
import sys
from ddp_hpc.cli import main
if __name__ == "__main__":
    sys.exit(main())
EOF
  chmod +x "$tmp/bin/ddp-hpc"
  # A venv names its own folder in its scripts' first lines and in activate: point them at
  # the place it is renamed to.
  grep -rlIF --null "$tmp" "$tmp/bin" | xargs -0 -r sed -i "s|$tmp|$VENV|g"
  if [ -e "$VENV" ]; then mv "$VENV" "$tmp.old"; fi
  mv "$tmp" "$VENV"
  rm -rf "$tmp.old"
  echo "$key" >"$stamp"
  echo "torch-venv.sh: built $VENV in $((SECONDS - started)) s ($(du -sh "$VENV" | cut -f1))" >&2
fi
echo "$VENV"
