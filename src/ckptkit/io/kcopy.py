"""Copies the kernel does between two files (``copy_file_range``), and early writeback.

``copy_file_range`` copies every range, and on NFS, XFS or btrfs may do better still (a copy on
the server, shared blocks). Devices around it that were measured end to end in convert and did
not gain 10% were removed (a ``splice`` pipe, padding to keep a source's page offset, finding
DCP chunks on a helper thread): git history has their A/Bs.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any


class NoKernelCopy(Exception):
    """The kernel refused the copy (nothing copied): the caller copies through Python instead.

    Not a ``CkptkitError``: control flow inside :func:`.fileio.copy_range`, never raised past it
    (and not an OSError, so a read error of the CRC thread cannot pass for it).
    """


def copy_file_range(inp: int, out: int, n: int, at: int) -> int:
    """Up to ``n`` bytes of ``inp`` from ``at``, appended at ``out``'s position, by ``copy_file_range``.

    Raises:
        NoKernelCopy: across filesystems on older kernels, or on a filesystem without it.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as s, tempfile.TemporaryFile() as d:
        ...     _ = s.write(b"123456789")
        ...     s.flush()
        ...     copy_file_range(s.fileno(), d.fileno(), 4, 2), os.pread(d.fileno(), 9, 0)
        (4, b'3456')
    """
    try:
        return os.copy_file_range(inp, out, n, at)
    except OSError as e:
        raise NoKernelCopy from e


def _libc(name: str, argtypes: list[Any]) -> Any:
    """libc's function ``name``, taking ``argtypes``, or None where libc has none."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    return fn


_sync_file_range = _libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


_BEHIND = 64 << 20  # how far behind the write end drop_behind works: the disk's slack, in bytes


def drop_behind(fd: int, offset: int, n: int) -> None:
    """Wait for the writeback of the ``n`` bytes :data:`_BEHIND` bytes before ``offset``, then
    drop them from the page cache (where libc has ``sync_file_range``; else nothing).

    For a long stream written in steps whose writeback each step started (a DCP tensor's bands):
    the writer keeps pace with the disk with a bounded window of dirty pages, and recycles the
    pages it wrote instead of taking fresh ones. A convert larger than memory would otherwise
    evict what others cache, and a VM that returns free memory to its host pays a fault on
    every fresh page. Only whole pages are dropped; the closing fsync still makes it durable.
    """
    start, end = max(0, offset - _BEHIND) & ~4095, max(0, offset + n - _BEHIND) & ~4095
    if _sync_file_range is not None and end > start:
        _sync_file_range(fd, start, end - start, 7)  # WAIT_BEFORE | WRITE | WAIT_AFTER
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)


def start_writeback(fd: int, offset: int, n: int) -> None:
    """``sync_file_range(SYNC_FILE_RANGE_WRITE)`` where libc has it, else nothing.

    Starting writeback of each chunk as soon as it is copied lets the disk work while the copy
    goes on, so the fsync at the end (durability) waits for the tail only, not the whole file.
    A failure here costs only that head start: the fsync still reports any error.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, n, 2)
