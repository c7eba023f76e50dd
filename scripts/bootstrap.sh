#!/usr/bin/env bash
# Create or refresh the project's virtual environment: torch 2.13.0 first (so pip never
# replaces it with a CUDA build from the registry), then this package with EXTRAS.
#
#   scripts/bootstrap.sh [EXTRAS]     e.g. scripts/bootstrap.sh test,examples
#
# The venv is $DDP_HPC_VENV (default: .venv in the repository). A stamp file skips the
# pip step when pyproject.toml has not changed and the venv already has EXTRAS (or more).
# Prints the venv path.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
EXTRAS=${1:-examples}
VENV=${DDP_HPC_VENV:-$ROOT/.venv}
TORCH_VERSION=${DDP_HPC_TORCH_VERSION:-2.13.0}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.ddp_hpc-stamp"
project=$(sha256sum <"$ROOT/pyproject.toml" | cut -c1-16)

# The stamp says "PROJECT-HASH EXTRAS TORCH-VERSION"; it covers EXTRAS when each of them is
# among its extras (so `run_ddp_local.sh` in the test venv installs nothing).
stamp_covers() {
  local s_project s_extras s_torch extra
  [ -f "$stamp" ] && read -r s_project s_extras s_torch <"$stamp" || return 1
  [ "$s_project" = "$project" ] && [ "$s_torch" = "$TORCH_VERSION" ] || return 1
  for extra in ${EXTRAS//,/ }; do
    [[ ",$s_extras," == *",$extra,"* ]] || return 1
  done
}

if ! stamp_covers; then
  # pip byte-compiles one file at a time (torch: 25 s of a 35 s install); compileall does
  # the same on every core afterwards. The .pyc files must exist: where
  # PYTHONDONTWRITEBYTECODE is set (this VM, CI), nothing caches what a run compiles, and
  # every `import torch` would compile torch again (5 s of CPU instead of 2).
  pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)
  if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    echo "bootstrap: installing torch==$TORCH_VERSION" >&2
    "${pip[@]}" "torch==$TORCH_VERSION"
  fi
  echo "bootstrap: installing ddp_hpc[$EXTRAS]" >&2
  "${pip[@]}" -e "$ROOT[$EXTRAS]"
  echo "bootstrap: byte-compiling the installed packages" >&2
  # As pip does, a file that does not compile (some packages ship Python 2 test data) is
  # skipped; anything else (compileall itself failing) stops here, before the stamp.
  "$VENV/bin/python" - <<'PY'
import compileall, importlib.util, os, sys, sysconfig

for folder in sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}):
    compileall.compile_dir(folder, quiet=2, workers=0)
torch_pyc = importlib.util.cache_from_source(importlib.util.find_spec("torch").origin)
if not os.path.exists(torch_pyc):
    sys.exit(f"bootstrap: byte-compiling left no {torch_pyc}")
PY
  echo "$project $EXTRAS $TORCH_VERSION" >"$stamp"
fi
echo "$VENV"
