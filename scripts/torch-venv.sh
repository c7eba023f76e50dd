#!/usr/bin/env bash
# Print the path of a venv holding torch==VERSION and ddp_hpc's dependencies (its examples
# extra too), for the torch-version smoke tests (tests/test_stacks.py); build it first where
# it is missing, stale or broken. The project's own venv and its torch are never touched.
#
#   scripts/torch-venv.sh VERSION           e.g. scripts/torch-venv.sh 2.5.1
#   scripts/torch-venv.sh --check VERSION   print the path where it is built, else exit 1
#   scripts/torch-venv.sh --light VERSION   a light venv (torch-VERSION-light), for the one-rank
#                                           tests only (--check --light VERSION: its path)
#
# A light venv holds torch==VERSION without triton, ddp_hpc's [project] dependencies (not the
# examples extra), and the CUDA libraries torch pins, which a CUDA build needs to import even
# with no GPU (torch loads cuBLAS, NCCL... at import). Those come from a store shared by every
# light venv ($CACHE/cuda-libs): each requirement torch pins (cuda-toolkit's extras expanded
# to theirs) installed once, by pip, into a folder of its own, and hard-linked into each venv
# whose torch pins the same; torch finds them where pip would have put them. Versions whose
# pins match download and store them once.
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
LIGHT=0
while [ $# -gt 1 ]; do
  case "$1" in
    --check) CHECK=1 ;;
    --light) LIGHT=1 ;;
    *) break ;;
  esac
  shift
done
VERSION=${1:?usage: scripts/torch-venv.sh [--check] [--light] VERSION}
[[ "$VERSION" =~ ^[0-9]+(\.[0-9]+)+$ ]] || { echo "torch-venv.sh: VERSION must look like 2.5.1, got '$VERSION'" >&2; exit 2; }
CACHE=${DDP_HPC_STACK_CACHE:-/var/cache/ddp_hpc/stacks}
PYTHON=${PYTHON:-python3}
VENV="$CACHE/torch-$VERSION"
if [ "$LIGHT" = 1 ]; then VENV="$VENV-light"; fi
NAME=$(basename "$VENV")

# ddp_hpc's requirements: [project] dependencies plus the examples extra (configs/digits.yaml
# reads scikit-learn's data file; the examples import scikit-learn).
requirements=$("$PYTHON" - "$ROOT/pyproject.toml" "$LIGHT" <<'PY'
import re, sys, tomllib

with open(sys.argv[1], "rb") as file:
    project = tomllib.load(file)["project"]
light = sys.argv[2] == "1"
if light:  # torch is installed on its own, without the dependencies pip would add for it
    print("\n".join(r for r in project["dependencies"] if not re.match(r"torch\b", r)))
else:
    print("\n".join(project["dependencies"] + project["optional-dependencies"]["examples"]))
PY
)
key=$( { cat "${BASH_SOURCE[0]}"; "$PYTHON" -VV; echo "torch==$VERSION light=$LIGHT"; echo "$requirements"; } \
       | sha256sum | cut -c1-16)
stamp="$VENV/.ddp_hpc-stack-stamp"
ready() { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$VENV/bin/python" ]; }

# torch without its dependencies, then the ones it needs to import, the CUDA libraries from
# the shared store (hard links: the store and the venvs are on one file system).
light_venv() {
  local pip=("$tmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)
  "${pip[@]}" --no-deps "torch==$VERSION"
  local split
  split=$("$tmp/bin/python" - <<'PY'
import importlib.metadata as metadata, json, re, subprocess, sys, tempfile, zipfile
from pip._vendor.packaging.requirements import Requirement

def applies(req, extra=""):
    return req.marker is None or req.marker.evaluate({"extra": extra})

def cuda(req):
    return re.match(r"(nvidia-|cuda-toolkit$)", req.name) is not None

plain, libraries = [], []
for line in metadata.requires("torch") or []:
    req = Requirement(line)
    if not applies(req) or req.name in ("triton", "cuda-bindings"):  # neither is needed to import torch
        continue
    if not cuda(req):
        plain.append(str(req).split(";")[0])
    elif req.name != "cuda-toolkit":
        libraries.append(f"{req.name}{req.specifier}")
    else:  # a meta-package: the libraries its extras pin
        with tempfile.TemporaryDirectory() as folder:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", folder,
                            f"{req.name}{req.specifier}"], check=True)
            import pathlib
            wheel = next(pathlib.Path(folder).glob("*.whl"))
            with zipfile.ZipFile(wheel) as archive:
                name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
                lines = [v.strip() for k, _, v in (l.partition(":") for l in archive.read(name).decode().splitlines())
                         if k == "Requires-Dist"]
        for line in lines:
            sub = Requirement(line)
            if any(applies(sub, extra) for extra in req.extras) and not applies(sub):
                libraries.append(f"{sub.name}{sub.specifier}")
print(json.dumps({"plain": plain, "libraries": sorted(set(libraries))}))
PY
)
  mapfile -t plain < <(echo "$split" | "$tmp/bin/python" -c 'import json, sys; print("\n".join(json.load(sys.stdin)["plain"]))')
  mapfile -t libraries < <(echo "$split" | "$tmp/bin/python" -c 'import json, sys; print("\n".join(json.load(sys.stdin)["libraries"]))')
  "${pip[@]}" "${plain[@]}" "${reqs[@]}"
  local site store="$CACHE/cuda-libs" folder library name
  site=$("$tmp/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
  mkdir -p "$store/.locks"
  for library in "${libraries[@]}"; do
    name=$(echo "$library" | tr -c 'A-Za-z0-9.\n-' '_')
    folder="$store/$name"
    (
      flock 8
      if [ ! -f "$folder/.complete" ]; then
        rm -rf "$folder"
        "${pip[@]}" --no-deps --target "$folder" "$library"
        touch "$folder/.complete"
      fi
    ) 8>"$store/.locks/$name"
    cp -al --remove-destination "$folder/." "$site/"
    rm -f "$site/.complete"
  done
}

if [ "$CHECK" = 1 ]; then
  ready && { echo "$VENV"; exit 0; }
  exit 1
fi
mkdir -p "$CACHE"
exec 9>"$CACHE/$NAME.lock"
flock 9
if ! ready; then
  started=$SECONDS
  tmp="$CACHE/.$NAME.tmp-$$"
  trap 'rm -rf "$tmp" "$tmp.old"' EXIT
  echo "torch-venv.sh: building $VENV (torch==$VERSION$([ "$LIGHT" = 1 ] && echo ", light"))" >&2
  "$PYTHON" -m venv "$tmp"
  mapfile -t reqs <<<"$requirements"
  # --no-compile and compileall afterwards, as in scripts/bootstrap.sh: pip compiles one file
  # at a time, and with PYTHONDONTWRITEBYTECODE no import would write the .pyc files.
  if [ "$LIGHT" = 0 ]; then
    "$tmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile "torch==$VERSION" "${reqs[@]}"
  else
    light_venv
  fi
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
