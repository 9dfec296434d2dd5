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


def start_writeback(fd: int, offset: int, n: int) -> None:
    """``sync_file_range(SYNC_FILE_RANGE_WRITE)`` where libc has it, else nothing.

    Starting writeback of each chunk as soon as it is copied lets the disk work while the copy
    goes on, so the fsync at the end (durability) waits for the tail only, not the whole file.
    A failure here costs only that head start: the fsync still reports any error.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, n, 2)
