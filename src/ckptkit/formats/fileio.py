"""File primitives every format shares: bounded reads, kernel-side copies, CRC-32.

The CRC-32 function lives here alone, so every reader and writer checks bytes the same way.
"""

from __future__ import annotations

import ctypes
import os
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO

from ..errors import CheckpointFormatError

_CHUNK = 64 << 20
Progress = Callable[[int], None]


def crc32(data: Any, value: int = 0) -> int:
    """CRC-32 (the zip polynomial) of ``data``, continuing from ``value``."""
    return zlib.crc32(data, value)


class ClampedReader:
    """A read-only file view whose reads never ask for more than is left.

    ``file.read(n)`` allocates ``n`` bytes before reading, so a pickle length field flipped to
    2**40 would ask for a terabyte; every pickle read from a file goes through this instead.
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._end = os.fstat(f.fileno()).st_size

    def _left(self, n: int | None) -> int:
        left = max(0, self._end - self._f.tell())
        return left if n is None or n < 0 else min(n, left)

    def read(self, n: int | None = -1) -> bytes:
        return self._f.read(self._left(n))

    def readline(self, limit: int | None = -1) -> bytes:
        return self._f.readline(self._left(limit))

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf)
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)


def _writeback_starter() -> Callable[[int, int, int], None]:
    """``sync_file_range(SYNC_FILE_RANGE_WRITE)`` where libc has it, else a no-op.

    Starting writeback of each chunk as soon as it is copied lets the disk work while the copy
    goes on, so the fsync at the end (durability) waits for the tail only, not the whole file.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return lambda fd, offset, n: None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, n: None if fn(fd, offset, n, 2) == 0 else None


_start_writeback = _writeback_starter()


def copy_range(src: BinaryIO, dst: BinaryIO, offset: int, length: int, progress: Progress | None = None) -> None:
    """Append ``length`` bytes of ``src`` from ``offset`` to ``dst``, in the kernel when it can."""
    dst.flush()
    out, inp = dst.fileno(), src.fileno()
    written_at = os.lseek(out, 0, os.SEEK_CUR)
    done = 0
    use_kernel = hasattr(os, "copy_file_range")
    while done < length:
        step = min(_CHUNK, length - done)
        n = 0
        if use_kernel:
            try:
                n = os.copy_file_range(inp, out, step, offset + done)
            except OSError:  # cross-device on old kernels, or a filesystem without support
                use_kernel = False
        if not use_kernel:
            src.seek(offset + done)
            chunk = src.read(step)
            dst.write(chunk)
            dst.flush()
            n = len(chunk)
        if n <= 0:
            raise CheckpointFormatError(f"{getattr(src, 'name', 'source')}: ended early at byte {offset + done}")
        _start_writeback(out, written_at + done, n)
        done += n
        if progress is not None:
            progress(n)


def crc_of_range(src: BinaryIO, offset: int, length: int, progress: Progress | None = None) -> int:
    """CRC-32 of a byte range, read in bounded chunks (``progress(n)`` after each)."""
    crc = 0
    src.seek(offset)
    left = length
    while left:
        chunk = src.read(min(8 << 20, left))  # small chunks: verify keeps little memory
        if not chunk:
            raise CheckpointFormatError(f"{getattr(src, 'name', 'source')}: ended early at byte {offset + length - left}")
        crc = crc32(chunk, crc)
        left -= len(chunk)
        if progress is not None:
            progress(len(chunk))
    return crc
