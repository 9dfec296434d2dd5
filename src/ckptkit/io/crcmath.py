"""CRC-32 arithmetic: the CRC of joined byte runs from the CRCs of the runs (zlib's crc32_combine).

A tensor copied piece by piece (a DCP checkpoint's chunks) gets the CRC-32 of its whole record
from its pieces' CRC-32s, each computed while that piece is copied (:func:`.fileio.copy_range`),
so no byte is read twice. The CRC-32 function itself is :func:`.fileio.crc32`.

ISA-L's ``crc32_combine`` is used where the ``isal`` package has it (~0.6 us); the zlib
arithmetic below is the fallback, with each length's shift computed once (a DCP folder's
chunks come in a few lengths), so a combine costs one multiplication, not ~20 (~40 us).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

_POLY = 0xEDB88320  # the zip CRC-32's polynomial, bit-reversed


def _multmodp(a: int, b: int) -> int:  # a x b modulo the polynomial (zlib's multmodp); a != 0
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^n) modulo the polynomial, n = 0..31 (zlib's x2n_table)
while len(_X2N) < 32:
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=4096)
def _shift(length: int) -> int:
    """x^(8 * length) modulo the polynomial: what appending ``length`` zero bytes multiplies a CRC by."""
    p, k = 1 << 31, 3  # x^0; 2^3 = 8 bits a byte
    while length:
        if length & 1:
            p = _multmodp(_X2N[k & 31], p)
        length >>= 1
        k += 1
    return p


def python_crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """zlib's ``crc32_combine`` in Python: the fallback of :func:`crc32_combine`."""
    return _multmodp(_shift(length2), crc1) ^ crc2


try:
    from isal.isal_zlib import crc32_combine as _combine
except ImportError:  # no isal wheel here, or a version without it
    _combine: Callable[[int, int, int], int] = python_crc32_combine  # type: ignore[no-redef]


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's crc32_combine):
    a tensor copied piece by piece gets its whole CRC without reading its bytes twice.

    Example:
        >>> from zlib import crc32
        >>> crc32_combine(crc32(b"1234"), crc32(b"56789"), 5) == crc32(b"123456789")
        True
    """
    return _combine(crc1, crc2, length2)
