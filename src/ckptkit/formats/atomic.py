"""Atomic, durable file (and folder) replacement.

A crash at any moment leaves either the old file or the complete new one at the target path:
data goes to a temp file in the same folder (same filesystem, so the rename is atomic), is
flushed and fsynced, renamed over the target with ``os.replace``, and the folder is fsynced so
the rename itself survives a power cut. Temp files carry the writer's host and pid, so a later
writer can remove the debris of a writer that was killed (kill -9 runs no cleanup code).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointWriteError

TMP_SUFFIX = ".ckptkit-tmp"
_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:16] or "host"


def _temp_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.{_HOST}-{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(dest: Path) -> list[Path]:
    """Delete temp files for ``dest`` left by dead writers on this host; return what was removed.

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
                if entry.is_dir(follow_symlinks=False):  # a folder output's (atomic_folder)
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


def _describe(e: OSError, dest: Path) -> str:
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
    tmp = _temp_path(dest)
    try:
        # 0o666 lets the umask decide, as a plain open() would (mkstemp would force 0o600).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise CheckpointWriteError(_describe(e, dest)) from e
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
            raise CheckpointWriteError(_describe(e, dest)) from e
        raise
    try:
        fsync_dir(folder)
    except OSError as e:
        raise CheckpointWriteError(_describe(e, dest)) from e


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike[str], *, replace: bool = False) -> Iterator[Path]:
    """A temp folder beside ``path`` that becomes ``path``, complete and durable, when the block
    succeeds: every file in it is fsynced, then the folder, then it is renamed into place and the
    parent fsynced. On any exception it is removed and ``path`` is left as it was.

    ``replace``: an existing folder at ``path`` is swapped out atomically (``renameat2``'s
    RENAME_EXCHANGE where the kernel has it; else renamed aside first) and then removed.

    Example:
        >>> with atomic_folder("out.dcp") as tmp:  # doctest: +SKIP
        ...     (tmp / "data").write_bytes(payload)
    """
    dest = Path(path)
    if not dest.parent.is_dir():
        what = "is not a folder" if dest.parent.exists() else "does not exist"
        raise CheckpointWriteError(f"cannot write {dest}: {dest.parent} {what}; create the folder first")
    remove_stale_temps(dest)
    tmp = _temp_path(dest)
    try:
        os.mkdir(tmp, 0o777)
    except OSError as e:
        raise CheckpointWriteError(_describe(e, dest)) from e
    try:
        yield tmp
        for folder, _, files in os.walk(tmp):
            for name in files:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(Path(folder))
        if not (replace and dest.is_dir()):
            if dest.exists() or dest.is_symlink():
                raise CheckpointWriteError(f"cannot write {dest}: it exists" + ("" if replace else " (not replacing it)"))
            os.rename(tmp, dest)
        elif not _exchange(tmp, dest):
            aside = _temp_path(dest)
            os.rename(dest, aside)  # (killed now: the next writer's remove_stale_temps takes it)
            os.rename(tmp, dest)
            tmp = aside
        fsync_dir(dest.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, CheckpointWriteError):
            raise CheckpointWriteError(_describe(e, dest)) from e
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # the replaced folder, if there was one


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), str(b))
