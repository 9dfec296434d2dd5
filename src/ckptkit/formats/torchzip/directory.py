"""A zip's central directory, read the way torch's reader reads it.

torch reads checkpoints with miniz (through caffe2's inline_container.cc), which differs from
Python's ``zipfile``: it takes the last end-record signature with a whole record after it,
follows a zip64 locator's offset, counts entries as the (zip64) end record says, takes offsets as
written, and refuses fields ``zipfile`` ignores. ckptkit reads every directory here, in one read,
with those rules, so that ``verify`` does not pass, and ``convert`` does not copy, a file torch
cannot load, and opening a zip costs a few ``struct`` calls a record (a DCP folder holds hundreds).
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import BinaryIO, NamedTuple

from ...errors import CheckpointFormatError, UnsupportedCheckpointError

LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory, 22 bytes
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory, 56 bytes
_SIG = b"PK\x05\x06"  # starts the end of central directory record
U32 = 0xFFFFFFFF  # a size or offset in the zip64 extra field instead (and the largest 32-bit field)
UTF8_NAME = 0x0800  # flag: the name is UTF-8 (torch.save sets it; ckptkit's writer too)
_DOS_FOLDER = 0x10  # external attribute: miniz then treats the record as a folder, not a file
_UNSUPPORTED_FLAGS = 0x0001 | 0x0020 | 0x0040 | 0x2000  # encrypted, patch data, strong encryption, masked
_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)  # what torch's reader inflates


class DirectoryEntry(NamedTuple):
    """One central directory header, with zip64 sizes and offset resolved."""

    name: str
    header_offset: int
    compressed_size: int
    size: int
    crc: int
    method: int


def read_directory(path: Path, f: BinaryIO, size: int) -> list[DirectoryEntry]:
    """The records the central directory of the zip in ``f`` (``size`` bytes) lists, in its order.

    Raises:
        UnsupportedCheckpointError: a record torch cannot read (encrypted, or compressed other
            than by deflate), not necessarily a damaged one.
        CheckpointFormatError: the end records or the directory are damaged, or describe what
            torch refuses (several disks, a header past the directory's end).
    """
    cd_offset, cd_size, total = _locate(path, f, size)
    f.seek(cd_offset)
    directory = f.read(cd_size)
    entries, pos = [], 0
    for _ in range(total):
        if directory[pos : pos + 4] != b"PK\x01\x02" or pos + CENTRAL.size > len(directory):
            raise CheckpointFormatError(f"{path}: the zip's central directory is damaged at byte {cd_offset + pos}")
        (_, _, _, flags, method, _, _, crc, csize, usize, n, e, c, volume, _, external, offset) = CENTRAL.unpack_from(
            directory, pos
        )
        start, pos = pos + CENTRAL.size, pos + CENTRAL.size + n + e + c
        if pos > len(directory):
            raise CheckpointFormatError(f"{path}: a zip central directory header runs past the directory's end")
        try:
            # UTF-8 whatever the flag says: torch.load decodes every record's name so (zipfile would
            # take an unflagged one as code page 437, and read a name torch refuses)
            name = directory[start : start + n].decode("utf-8")
        except UnicodeDecodeError as err:
            raise CheckpointFormatError(
                f"{path}: damaged zip archive (a record name is not UTF-8, which torch.load requires: {err})"
            ) from err
        if U32 in (csize, usize, offset):
            usize, csize, offset = _zip64(path, name, directory[start + n : start + n + e], usize, csize, offset)
        _check(path, name, flags, method, csize, usize, volume, external)
        entries.append(DirectoryEntry(name, offset, csize, usize, crc, method))
    return entries


def _locate(path: Path, f: BinaryIO, size: int) -> tuple[int, int, int]:
    """The central directory's offset, size and entry count, from the end records, as miniz reads them."""
    eocd, block = _end_record(f, size)
    if eocd < 0:
        raise CheckpointFormatError(f"{path}: damaged zip archive (no end of central directory record; truncated?)")
    _, disk, cd_disk, here, total, cd_size, cd_offset, _ = _EOCD.unpack_from(block, len(block) - _EOCD.size)
    locator = block[-_EOCD.size - 20 : -_EOCD.size] if eocd >= 20 + _EOCD64.size else b""
    if locator[:4] == b"PK\x06\x07":
        # zipfile looks for the zip64 end record just before the locator; torch follows its offset.
        record_at, disks = struct.unpack_from("<QI", locator, 8)
        if record_at > size - _EOCD64.size:
            raise CheckpointFormatError(
                f"{path}: the zip64 locator points past the end of the file; the file is damaged"
            )
        f.seek(record_at)
        record = f.read(_EOCD64.size)
        if record[:4] == b"PK\x06\x06":  # else torch ignores the locator and reads the 32-bit record
            _, record_size, _, _, disk, cd_disk, here, total, cd_size, cd_offset = _EOCD64.unpack(record)
            if record_size < _EOCD64.size - 12:
                raise CheckpointFormatError(
                    f"{path}: the zip64 end record says it is {record_size} bytes long; the file is damaged"
                )
            if disks != 1:
                raise CheckpointFormatError(
                    f"{path}: the zip64 locator describes {disks} disks; torch reads one, the file is damaged"
                )
            if max(total, here, cd_size) > U32:
                raise UnsupportedCheckpointError(
                    f"{path}: the zip's directory is over 4 GiB or 2**32 entries, beyond torch's reader"
                )
    if (disk, cd_disk) not in ((0, 0), (1, 1)) or here != total:
        raise CheckpointFormatError(
            f"{path}: the zip's end record describes a multi-disk archive (disk {disk}, central directory on "
            f"disk {cd_disk}, {here} of {total} entries here); torch cannot read it, the file is damaged"
        )
    if cd_offset + cd_size > size:
        raise CheckpointFormatError(f"{path}: the zip's central directory runs past the end of the file (truncated?)")
    return cd_offset, cd_size, total


def _zip64(path: Path, name: str, extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    """Sizes and offset from the zip64 extra field: each one whose 32-bit field is 0xFFFFFFFF, in
    that order (a 64-bit value may be 0xFFFFFFFF itself: torch writes zip64 from that size on)."""
    pos = 0
    while pos + 4 <= len(extra):
        kind, n = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + n > len(extra):
            break
        if kind == 1:
            values, at, end = [usize, csize, offset], pos + 4, pos + 4 + n
            for i in range(3):
                if values[i] == U32:
                    if at + 8 > end:
                        break
                    values[i], at = struct.unpack_from("<Q", extra, at)[0], at + 8
            else:
                return values[0], values[1], values[2]
            break
        pos += 4 + n
    raise CheckpointFormatError(
        f"{path}: zip record {name} lacks the zip64 sizes its header calls for; the file is damaged"
    )


def _check(path: Path, name: str, flags: int, method: int, csize: int, usize: int, volume: int, external: int) -> None:
    """Refuse a record torch's reader refuses (or misreads) but Python's zipfile lets through."""
    unreadable = (
        f"has flags 0x{flags:04x} (encrypted or patch data)"
        if flags & _UNSUPPORTED_FLAGS
        else f"uses compression method {method} (torch reads 0, stored, and 8, deflate)"
        if method not in _METHODS
        else None
    )
    if unreadable:  # a zip torch cannot read, not necessarily a damaged one
        raise UnsupportedCheckpointError(
            f"{path}: zip record {name} {unreadable}; torch cannot read it. If another zip tool "
            "repacked the file, save it again with torch.save"
        )
    why = (
        f"is stored but its sizes differ ({csize} vs {usize})"
        if method == zipfile.ZIP_STORED and csize != usize
        else f"claims to start on disk {volume} of a multi-disk archive"
        if volume > 1
        else "is marked as a folder"
        if external & _DOS_FOLDER or name.endswith("/")
        else None
    )
    if why:
        raise CheckpointFormatError(f"{path}: zip record {name} {why}; the file is damaged")


def _end_record(f: BinaryIO, size: int) -> tuple[int, bytes]:
    """Where the zip's end record starts (-1: none), and the bytes from 20 before it (a zip64
    locator's place) to its end.

    That is, as miniz finds it: the last signature with a whole 22-byte record after it, scanning
    back from the end in 4 KiB blocks until 64 KiB (the longest comment) and the end record are
    covered. A zip without a comment ends in its end record, so the last 42 bytes are read first,
    and mostly suffice.
    """
    f.seek(max(0, size - (_EOCD.size + 20)))
    block = f.read()
    if len(block) >= _EOCD.size and block[-_EOCD.size : 4 - _EOCD.size] == _SIG:
        return size - _EOCD.size, block
    start = max(size - 4096, 0)
    while start and size - start < 0xFFFF + _EOCD.size:
        start = max(start - (4096 - 3), 0)  # miniz's blocks overlap by 3 bytes
    f.seek(start)
    tail = f.read()
    at = tail.rfind(_SIG, 0, max(0, len(tail) - _EOCD.size + len(_SIG)))
    if at < 0:
        return -1, b""
    if at < 20 <= start + at:  # the locator's place lies before the bytes searched
        f.seek(start + at - 20)
        return start + at, f.read(20 + _EOCD.size)
    return start + at, tail[max(0, at - 20) : at + _EOCD.size]
