"""Atomic, durable file replacement.

A crash at any moment leaves either the old file or the complete new one at the target path:
data goes to a temp file in the same folder (same filesystem, so the rename is atomic), is
flushed and fsynced, renamed over the target with ``os.replace``, and the folder is fsynced so
the rename itself survives a power cut. Temp files carry the writer's host and pid, so a later
writer can remove the debris of a writer that was killed (kill -9 runs no cleanup code).

A temp name is ``.{dest}.{host}-{pid}-{random}.ckptkit-tmp``. The host part is the whole host
name (or, where that is long or not filename-safe, a digest of it): on a shared filesystem a pid
means something only on the host that wrote it, so two hosts must never share a tag.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import platform
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from ..errors import CheckpointWriteError, CkptkitError
from .fileio import routed

TMP_SUFFIX = ".ckptkit-tmp"
# A host name kept as it is: RFC 1123's letters, digits and hyphens. No dot, so the last dot of a
# temp name always ends the destination's part; no underscore, so it never looks like a digest tag.
_PLAIN_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,39}")
_HOST_TAG_MAX = 40
# 255 bytes per name (ext4, xfs, btrfs, NFS): the destination's part gets what the rest leaves,
# 255 - 2 dots - host tag (<= 40) - "-" pid (<= 10 digits) "-" random (8) - suffix (12) = 181.
_STEM_MAX = 180


def host_tag(name: str) -> str:
    """The filename-safe tag for host ``name`` in temp names; different hosts get different tags.

    A short name of letters, digits and hyphens is kept whole. Any other name (a dotted FQDN, a
    long one, an empty one) becomes up to 16 of its safe characters, ``_``, and 20 hex digits of
    its SHA-256: never cut short, since ``llama-train-worker-0`` and ``-1`` cut to 16
    characters are one host, and one would delete the other's temp files as a dead pid's.

    Example:
        >>> host_tag("llama-train-worker-0")
        'llama-train-worker-0'
        >>> host_tag("node1.cluster.example.org")
        'node1clusterexam_305ec37ce95ae99438aa'
    """
    if _PLAIN_HOST.fullmatch(name):
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:20]
    return f"{re.sub(r'[^A-Za-z0-9-]', '', name)[:16]}_{digest}"


_HOST = host_tag(platform.node())  # platform, not socket: a lighter import


def name_stem(dest: Path) -> str:
    """``dest``'s name, or where it is too long to carry a temp name's additions within 255
    bytes, its start and a digest of the whole (so two long names still differ)."""
    if len(os.fsencode(dest.name)) <= _STEM_MAX:
        return dest.name
    digest = hashlib.sha256(os.fsencode(dest.name)).hexdigest()[:16]
    head = dest.name[: _STEM_MAX - 17]
    while len(os.fsencode(head)) > _STEM_MAX - 17:  # multi-byte characters: cut on a character
        head = head[:-1]
    return f"{head}~{digest}"


def temp_path(dest: Path) -> Path:
    return dest.with_name(f".{name_stem(dest)}.{_HOST}-{os.getpid()}-{os.urandom(4).hex()}{TMP_SUFFIX}")


def pid_alive(pid: int) -> bool:
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

    Only temps whose host tag is this host's and whose recorded pid is no longer alive here are
    touched, so a concurrent writer (another process, or another host sharing the folder) is
    never disturbed.
    """
    prefix = f".{name_stem(dest)}.{_HOST}-"
    # pid and random part only: a host whose tag merely starts with ours (``worker-1`` and
    # ``worker-1-a``) leaves one more ``-`` field, which this refuses.
    rest = re.compile(rf"(?P<pid>\d+)-[0-9a-f]+{re.escape(TMP_SUFFIX)}")
    removed: list[Path] = []
    try:
        entries = list(os.scandir(dest.parent))
    except OSError:
        return removed
    for entry in entries:
        m = rest.fullmatch(entry.name[len(prefix) :]) if entry.name.startswith(prefix) else None
        if m and not pid_alive(int(m["pid"])):
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


class Kept(Protocol):
    """Which bytes of a file written elsewhere (streamed to a store) its check needs, decided as
    they pass: :meth:`feed` gets each write at its offset, in order, and returns the ranges
    (``start``, ``end``) to keep of it. The check then reads a local file holding those ranges
    only (the rest a hole): a safetensors header, a zip's headers, pickle and directory."""

    def feed(self, offset: int, data: bytes | memoryview) -> list[tuple[int, int]]: ...


Opener = Callable[..., contextlib.AbstractContextManager[BinaryIO]]

# Paths whose writes go elsewhere (io.streamed: a staging path standing for a URL): the opener
# gives the file to write, and publishes it (or nothing) when its block ends. Folders: each new
# file's name routed to an opener, or None (written locally).
_ELSEWHERE: dict[str, Opener] = {}
_FOLDERS: dict[str, Callable[[Path], Opener | None]] = {}


def written_elsewhere(path: Path, opener: Opener) -> contextlib.AbstractContextManager[None]:
    """Within the block, :func:`atomic_write` of ``path`` writes through ``opener(check=, kept=)``."""
    return routed(_ELSEWHERE, path, opener)


def folder_written_elsewhere(
    folder: Path, route: Callable[[Path], Opener | None]
) -> contextlib.AbstractContextManager[None]:
    """Within the block, a new file of the folder output ``folder`` (:func:`streamed_file`, in the
    temp folder :mod:`.atomicdir` writes it in) writes through ``route(path)`` where that is not None."""
    return routed(_FOLDERS, folder, route)


def folder_route(folder: Path) -> Callable[[Path], Opener | None] | None:
    """The route :func:`folder_written_elsewhere` set for ``folder``, if any."""
    return _FOLDERS.get(os.path.abspath(folder))


def streamed_file(
    path: Path, *, check: Callable[[Path], None] | None = None, kept: Callable[[], Kept] | None = None
) -> contextlib.AbstractContextManager[BinaryIO] | None:
    """Where ``path``, a new file of a folder output, stands for an object streamed to a store
    (:func:`folder_written_elsewhere`): the file to write, ``check`` ed and committed as its block
    ends (nothing committed on error). None: write it locally, as usual.

    Example:
        >>> streamed_file(Path("out/model.safetensors")) is None  # no store behind this folder
        True
    """
    route = folder_route(path.parent)
    opener = route(path) if route is not None else None
    return opener(check=check, kept=kept) if opener is not None else None


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str], *, check: Callable[[Path], None] | None = None, kept: Callable[[], Kept] | None = None
) -> Iterator[BinaryIO]:
    """Open a temp file that replaces ``path`` atomically and durably when the block succeeds.

    On any exception (including KeyboardInterrupt) the temp file is removed and ``path`` is left
    as it was. OS errors are re-raised as :class:`CheckpointWriteError` naming the cause.

    Args:
        path: the file to write; its folder must exist.
        check: called with the temp file's path once the data is flushed, fsynced and closed,
            before it replaces ``path``: verify what was written there. If it raises, the temp
            file is removed, ``path`` keeps its old bytes, and the exception propagates unchanged.
        kept: where ``path`` stands for an object streamed to a store (:func:`written_elsewhere`),
            what ``check`` needs of the bytes (None: all of them, a whole local copy).

    Example:
        >>> def nonempty(tmp: Path) -> None:  # doctest: +SKIP
        ...     if tmp.stat().st_size == 0:
        ...         raise CheckpointWriteError(f"{tmp}: nothing was written; ckpt.pt keeps its old contents")
        >>> with atomic_write("ckpt.pt", check=nonempty) as f:  # doctest: +SKIP
        ...     f.write(payload)
    """
    opener = _ELSEWHERE.get(os.path.abspath(path))
    if opener is not None:
        try:
            with opener(check=check, kept=kept) as f:
                yield f
        except OSError as e:  # the local image's (a full disk): named as a local write's are
            if isinstance(e, CkptkitError):
                raise
            raise CheckpointWriteError(describe_error(e, Path(path))) from e
        return
    dest = Path(path)
    folder = dest.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise CheckpointWriteError(f"cannot write {dest}: {folder} {what}; create the folder first")
    if dest.is_dir():
        raise CheckpointWriteError(f"cannot write {dest}: it is a folder; give a file path")
    remove_stale_temps(dest)
    tmp = temp_path(dest)
    mine = True  # whether a file at ``tmp`` can only be this call's
    checking = False
    # The temp file is created inside this try: a signal the CLI turns into an exception can land
    # just after os.open returns, and the file it made must go too. A file at ``tmp`` is ours
    # unless os.open failed: the name is unique (host, pid, random bits) and O_EXCL.
    try:
        try:
            # 0o666 lets the umask decide, as a plain open() would (mkstemp would force 0o600).
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError:  # nothing created (another writer's name, a read-only or full filesystem)
            mine = False
            raise
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if check is not None:
            checking = True
            check(tmp)
            checking = False
        os.replace(tmp, dest)
    except BaseException as e:
        if mine:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, CkptkitError) and not checking:  # ours say their own cause
            raise CheckpointWriteError(describe_error(e, dest)) from e
        raise
    try:
        fsync_dir(folder)
    except OSError as e:
        raise CheckpointWriteError(describe_error(e, dest)) from e
