"""Pack a Python environment (a venv or a conda environment) into one relocatable tar file.

The archive is written once, on the shared file system, and reused while the environment
is unchanged (a fingerprint of every file's path, size and modification time decides).

Relocation: a venv's ``bin/python`` finds its ``site-packages`` from where it is started
(``pyvenv.cfg`` beside ``bin/``), so a copied venv works under any path once the scripts in
``bin/`` (``ddp-hpc``, ``torchrun``: ``#!/old/prefix/bin/python`` lines) find their
interpreter beside themselves. The archive holds those scripts rewritten to do that, the
way pip's own launcher does for long shebangs, and links into the old prefix made
relative, so unpacking is a plain ``tar -x`` anywhere. The interpreter the venv was
made from (``home`` in ``pyvenv.cfg``) must exist on every node. Conda environments get
the same treatment of ``bin/``; other files with the old prefix written into them are
left as they are (conda-pack rewrites those).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.contract import atomic_write
from ddp_hpc.errors import UserError

log = logging.getLogger(__name__)

#: Inside the archive (and so in every node-local copy): what was packed, from where.
MANIFEST_NAME = ".ddp_hpc-stage.json"

#: A ``bin/`` script's first lines once relocated: ``sh`` runs it again with the python
#: beside the script; Python reads the second line as a string and goes on.
_RELOCATED_SHEBANG = (
    "#!/bin/sh\n"
    "'''exec' \"$(dirname -- \"$(realpath -- \"$0\")\")/{python}\" \"$0\" \"$@\"\n"
    "' '''\n"
)


@dataclass(frozen=True)
class PackedEnvironment:
    """An environment's archive on the shared file system."""

    archive: Path
    #: The environment's own path (``sys.prefix``) when it was packed.
    prefix: Path
    kind: str  # "venv" or "conda"
    fingerprint: str
    size_bytes: int
    #: False when an up-to-date archive was found and reused.
    written: bool


def active_environment() -> Path:
    """The venv or conda environment running this Python; an error outside of one."""
    if sys.prefix != sys.base_prefix or (Path(sys.prefix) / "conda-meta").is_dir():
        return Path(sys.prefix)
    raise UserError(f"no virtual or conda environment is active ({sys.prefix} is a system Python): "
                    "activate the environment to stage, or give --env PREFIX")


def environment_kind(prefix: Path) -> str:
    if (prefix / "pyvenv.cfg").is_file():
        return "venv"
    if (prefix / "conda-meta").is_dir():
        return "conda"
    raise UserError(f"{prefix} is neither a venv (no pyvenv.cfg) nor a conda environment (no conda-meta/)")


def default_archive(prefix: Path) -> Path:
    """``~/.cache/ddp_hpc/stage/<name>-<hash of the path>.tar`` (``$XDG_CACHE_HOME`` wins)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddp_hpc" / "stage"
    digest = hashlib.sha1(str(prefix).encode()).hexdigest()[:10]
    return cache / f"{prefix.name or 'env'}-{digest}.tar"


def _files(prefix: Path) -> list[Path]:
    found = []
    for root, dirs, files in os.walk(prefix):
        dirs.sort()
        here = Path(root)
        found += [here / name for name in sorted(files)]
        # Links to folders are not walked into: the archive holds the link itself.
        found += [here / name for name in dirs if (here / name).is_symlink()]
    return found


def fingerprint(prefix: Path, files: list[Path]) -> str:
    digest = hashlib.sha1(str(prefix).encode())
    for path in files:
        st = path.lstat()
        digest.update(f"{path.relative_to(prefix)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def relocated_script(content: bytes, prefix: Path) -> bytes | None:
    """A ``bin/`` script whose ``#!`` names an interpreter in ``prefix/bin``, made to use
    the one beside it; None for any other file."""
    if not content.startswith(b"#!"):
        return None
    first, _, rest = content.partition(b"\n")
    interpreter = first[2:].strip().split(b" ")[0].decode(errors="replace")
    if Path(interpreter).parent != prefix / "bin":
        return None
    return _RELOCATED_SHEBANG.format(python=Path(interpreter).name).encode() + rest


def _relative_link(member: tarfile.TarInfo, prefix: Path) -> None:
    target = Path(member.linkname)
    if member.issym() and target.is_absolute() and target.is_relative_to(prefix):
        member.linkname = os.path.relpath(target, (prefix / member.name).parent)


def _write_archive(handle, prefix: Path, files: list[Path], manifest: dict) -> None:
    with tarfile.open(fileobj=handle, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            name = str(path.relative_to(prefix))
            member = tar.gettarinfo(str(path), arcname=name)
            if member.isreg():
                with open(path, "rb") as source:
                    content = source.read() if path.parent == prefix / "bin" else None
                    relocated = relocated_script(content, prefix) if content is not None else None
                    if relocated is not None:
                        member.size = len(relocated)
                        tar.addfile(member, io.BytesIO(relocated))
                    else:
                        source.seek(0)
                        tar.addfile(member, source)
            else:
                _relative_link(member, prefix)
                tar.addfile(member)
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        info = tarfile.TarInfo(MANIFEST_NAME)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def read_manifest(archive: Path) -> dict | None:
    """The manifest of an archive (read from its end: it is the last member), or None."""
    try:
        with tarfile.open(archive, "r") as tar:
            member = tar.getmember(MANIFEST_NAME)
            return json.loads(tar.extractfile(member).read())
    except (OSError, KeyError, tarfile.TarError, ValueError):
        return None


def pack_environment(prefix: str | os.PathLike[str] | None = None,
                     archive: str | os.PathLike[str] | None = None) -> PackedEnvironment:
    """Pack ``prefix`` (default: the active environment) into ``archive`` (default: under
    ``~/.cache/ddp_hpc/stage``), unless the archive already holds it unchanged."""
    prefix = Path(prefix).resolve() if prefix is not None else active_environment()
    if not prefix.is_dir():
        raise UserError(f"--env {prefix}: no such folder")
    kind = environment_kind(prefix)
    archive = Path(archive) if archive is not None else default_archive(prefix)
    files = _files(prefix)
    stamp = fingerprint(prefix, files)
    existing = read_manifest(archive) if archive.is_file() else None
    if existing is not None and existing.get("fingerprint") == stamp:
        log.info("%s is up to date with %s", archive, prefix)
        return PackedEnvironment(archive, prefix, kind, stamp, archive.stat().st_size, written=False)
    archive.parent.mkdir(parents=True, exist_ok=True)
    manifest = {"prefix": str(prefix), "kind": kind, "fingerprint": stamp, "files": len(files)}
    # Not durable: the archive is rebuilt from the environment whenever it is missing.
    atomic_write(archive, lambda handle: _write_archive(handle, prefix, files, manifest), durable=False)
    log.info("packed %s (%d files) into %s", prefix, len(files), archive)
    return PackedEnvironment(archive, prefix, kind, stamp, archive.stat().st_size, written=True)
