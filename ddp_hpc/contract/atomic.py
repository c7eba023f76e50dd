"""The one way a file is replaced: a reader sees the old content or the whole new one,
never a part."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` survive a crash of the machine."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], content: bytes | str | Callable[[BinaryIO], None], *,
                 durable: bool = True) -> None:
    """Replace ``path`` with ``content`` in one rename: a reader sees the old file or the
    whole new one, whatever happens meanwhile.

    ``content`` is bytes, text (UTF-8) or a function that writes to the open binary file
    (``torch.save``, ``figure.savefig``). The temporary file lies in the same folder (a
    rename does not cross file systems) and is removed if anything goes wrong.

    ``durable`` also fsyncs the file before the rename and the folder after it, so the new
    content survives a crash of the machine, not only of the process. It matters where
    the file is the only copy of something: checkpoints, the exit file, the preempted
    marker, the run's config, summary and record, the submission record. It costs a disk
    flush each time, so files that are rebuilt or rewritten often skip it: the CSV
    metrics (re-read and rewritten at each start), curves, rendered scripts.
    """
    path = Path(path)
    # O_EXCL on a random name: two writers of the same file (threads, ranks on a shared
    # folder) never share a temporary. Mode 0o666 under the umask, as open() would give.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "wb", closefd=True) as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content.encode() if isinstance(content, str) else content)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:  # also KeyboardInterrupt: the temporary never becomes visible
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_directory(path.parent)
