"""Copies the kernel does between two files: ``copy_file_range``, or ``splice`` through a pipe.

On ext4, ``copy_file_range`` copies through the page cache 64 KiB at a time. When the bytes
land at another offset within a page than in their source (a safetensors shard packs tensors
that a zip kept apart; a DCP chunk starts anywhere), each batch begins and ends on a part page,
and a checked 1 GiB copy to disk takes 1.16-1.18x as long as one kept in step; ``splice`` through a
1 MiB pipe writes 1 MiB batches and takes 0.98-1.06x (BENCHMARKS.md, bench_kcopy.py). So such
ranges go through a pipe on ext4, the one filesystem where that was measured. On tmpfs the two
measured level, and elsewhere ``copy_file_range`` may do better than any pipe (NFS copies on
the server; XFS and btrfs share blocks where the offsets allow): it stays.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Generator
from typing import Any

from .pages import PAGE

try:
    import fcntl
except ImportError:  # Windows: no pipes to splice through either
    fcntl = None  # type: ignore[assignment]

Move = Callable[[int, int], int]  # (bytes, source offset) -> bytes appended at the destination's position
_PIPE = 1 << 20  # the default /proc/sys/fs/pipe-max-size: what an unprivileged process may ask for
_SPLICE_FROM = 1 << 20  # shorter ranges: a pipe's set-up costs more than the batches save
_EXT4 = 0xEF53  # statfs f_type of ext2/3/4, one driver since Linux 4.3


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


@contextlib.contextmanager
def mover(inp: int, out: int, *, src_at: int, dst_at: int, length: int) -> Generator[Move, None, None]:
    """How to copy ``length`` bytes of ``inp`` from ``src_at`` to ``out``'s position ``dst_at``:
    through a pipe where they would land at another offset within a page and both files are on
    ext4, else by :func:`copy_file_range`.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as s, tempfile.TemporaryFile() as d:
        ...     _ = s.write(b"123456789")
        ...     s.flush()
        ...     with mover(s.fileno(), d.fileno(), src_at=2, dst_at=0, length=7) as move:
        ...         n = move(7, 2)
        ...     n, os.pread(d.fileno(), 9, 0)
        (7, b'3456789')
    """

    def kernel(n: int, at: int) -> int:
        return copy_file_range(inp, out, n, at)

    if length < _SPLICE_FROM or (src_at - dst_at) % PAGE == 0 or not (hasattr(os, "splice") and _on_ext4(inp, out)):
        yield kernel
        return
    pipe = _pipe()
    if pipe is None:
        yield kernel
        return
    r, w, size = pipe
    refused = False

    def through_pipe(n: int, at: int) -> int:
        nonlocal refused
        if refused:
            return kernel(n, at)
        moved = 0
        while moved < n:
            try:
                got = os.splice(inp, w, min(size, n - moved), offset_src=at + moved)
            except OSError:
                if moved:  # a short step: the next one meets the error again, with nothing in flight
                    return moved
                refused = True  # this pair of files takes no splice: copy_file_range may still work
                return kernel(n, at)
            if got == 0:  # past the source's end: a short step, which the caller reports
                return moved
            left = got
            while left:
                try:
                    left -= os.splice(r, out, left)
                except OSError:
                    wrote = moved + got - left
                    _drain(r, left)  # bytes that never reached ``out`` must not reach it later
                    if wrote:
                        return wrote
                    raise NoKernelCopy from None  # e.g. an O_APPEND destination: Python copies it
            moved += got
        return moved

    try:
        yield through_pipe
    finally:
        os.close(r)
        os.close(w)


def _pipe() -> tuple[int, int, int] | None:
    """``(read end, write end, size)`` of a pipe of :data:`_PIPE` bytes, or None where one
    cannot be had (descriptors or the user's pipe quota spent: a small pipe saves nothing)."""
    try:
        r, w = os.pipe()
    except OSError:
        return None
    try:
        assert fcntl is not None  # only called where os.splice exists: Linux
        return r, w, fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE)
    except OSError:
        os.close(r)
        os.close(w)
        return None


def _drain(r: int, n: int) -> None:
    while n > 0:
        data = os.read(r, n)
        if not data:
            return
        n -= len(data)


def _libc(name: str, argtypes: list[Any]) -> Any:
    """libc's function ``name``, taking ``argtypes``, or None where libc has none."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    return fn


_fstatfs = _libc("fstatfs", [ctypes.c_int, ctypes.c_void_p])
_sync_file_range = _libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


def fs_type(fd: int) -> int | None:
    """Linux's ``fstatfs(fd).f_type`` (the filesystem's magic number), or None where libc cannot say."""
    buf = ctypes.create_string_buffer(512)  # struct statfs (120 bytes on x86-64): f_type, a C long, first
    if _fstatfs is None or _fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def _on_ext4(*fds: int) -> bool:
    return all(fs_type(fd) == _EXT4 for fd in fds)


def start_writeback(fd: int, offset: int, n: int) -> None:
    """``sync_file_range(SYNC_FILE_RANGE_WRITE)`` where libc has it, else nothing.

    Starting writeback of each chunk as soon as it is copied lets the disk work while the copy
    goes on, so the fsync at the end (durability) waits for the tail only, not the whole file.
    A failure here costs only that head start: the fsync still reports any error.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, n, 2)
