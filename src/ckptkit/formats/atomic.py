"""Atomic, durable file replacement.

A crash at any moment leaves either the old file or the complete new one at the target path:
data goes to a temp file in the same folder (same filesystem, so the rename is atomic), is
flushed and fsynced, renamed over the target with ``os.replace``, and the folder is fsynced so
the rename itself survives a power cut. Temp files carry the writer's host and pid, so a later
writer can remove the debris of a writer that was killed (kill -9 runs no cleanup code).
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointWriteError

TMP_SUFFIX = ".ckptkit-tmp"
_HOST = re.sub(r"[^A-Za-z0-9]", "", platform.node())[:16] or "host"  # platform, not socket: a lighter import


def temp_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.{_HOST}-{os.getpid()}-{os.urandom(4).hex()}{TMP_SUFFIX}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(dest: Path) -> list[Path]:
    """Delete temp files (and temp folders, :mod:`.atomicdir`'s) for ``dest`` left by dead writers on
    this host; return what was removed.

    Only files whose recorded pid is no longer alive on this host are touched, so a concurrent
    writer (another process, or another host sharing the folder) is never disturbed.
    """
    pattern = re.compile(
        rf"^\.{re.escape(dest.name)}\.(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-[0-9a-f]+{re.escape(TMP_SUFFIX)}$"
    )
    removed: list[Path] = []
    try:
        entries = list(os.scandir(dest.parent))
    except OSError:
        return removed
    for entry in entries:
        m = pattern.match(entry.name)
        if m and m["host"] == _HOST and not _pid_alive(int(m["pid"])):
            with contextlib.suppress(FileNotFoundError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def fsync_dir(folder: Path) -> None:
    """fsync a folder so a rename inside it is durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems (and all of Windows) refuse fsync on a directory; the file itself is synced.
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def describe_error(e: OSError, dest: Path) -> str:
    folder = dest.parent
    if isinstance(e, PermissionError):
        return f"cannot write {dest}: permission denied in folder {folder}; choose a writable folder"
    if e.errno == errno.ENOSPC:
        return f"cannot write {dest}: no space left on the device holding {folder}; free space or save elsewhere"
    if e.errno == errno.EFBIG:
        return f"cannot write {dest}: file too large for this filesystem or process limit (RLIMIT_FSIZE)"
    if e.errno == errno.EROFS:
        return f"cannot write {dest}: folder {folder} is on a read-only filesystem"
    return f"cannot write {dest}: {e.strerror or e}"


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a temp file that replaces ``path`` atomically and durably when the block succeeds.

    On any exception (including KeyboardInterrupt) the temp file is removed and ``path`` is left
    as it was. OS errors are re-raised as :class:`CheckpointWriteError` naming the cause.

    Example:
        >>> with atomic_write("ckpt.pt") as f:  # doctest: +SKIP
        ...     f.write(payload)
    """
    dest = Path(path)
    folder = dest.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise CheckpointWriteError(f"cannot write {dest}: {folder} {what}; create the folder first")
    if dest.is_dir():
        raise CheckpointWriteError(f"cannot write {dest}: it is a folder; give a file path")
    remove_stale_temps(dest)
    tmp = temp_path(dest)
    try:
        # 0o666 lets the umask decide, as a plain open() would (mkstemp would force 0o600).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise CheckpointWriteError(describe_error(e, dest)) from e
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, CheckpointWriteError):
            raise CheckpointWriteError(describe_error(e, dest)) from e
        raise
    try:
        fsync_dir(folder)
    except OSError as e:
        raise CheckpointWriteError(describe_error(e, dest)) from e
