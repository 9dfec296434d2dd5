"""Zip structure that torch's reader refuses but Python's zipfile lets through.

torch reads checkpoints with miniz (through caffe2's inline_container.cc), which checks
fields that ``zipfile`` ignores. ckptkit reads with ``zipfile`` and its own parsing, so without
these checks ``verify`` would pass, and ``convert`` would copy, files that torch cannot load.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointFormatError, UnsupportedCheckpointError

LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory, 22 bytes
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory, 56 bytes
_SIG = b"PK\x05\x06"  # starts the end of central directory record
_DOS_FOLDER = 0x10  # external attribute: miniz then treats the record as a folder, not a file
_UNSUPPORTED_FLAGS = 0x0001 | 0x0020 | 0x0040 | 0x2000  # encrypted, patch data, strong encryption, masked


def check_like_torch(path: Path, f: BinaryIO, size: int, infos: list[zipfile.ZipInfo]) -> None:
    """Refuse what torch's zip reader (miniz) refuses but Python's zipfile lets through.

    Without this, verify would pass and convert would copy records torch then cannot read.
    """
    for i in infos:
        unreadable = (
            f"has flags 0x{i.flag_bits:04x} (encrypted or patch data)" if i.flag_bits & _UNSUPPORTED_FLAGS
            else f"uses compression method {i.compress_type} (torch reads 0, stored, and 8, deflate)"
            if i.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) else None
        )  # fmt: skip
        if unreadable:  # a zip torch cannot read, not necessarily a damaged one
            raise UnsupportedCheckpointError(
                f"{path}: zip record {i.filename} {unreadable}; torch cannot read it. If another zip tool "
                "repacked the file, save it again with torch.save"
            )
        why = (
            f"is stored but its sizes differ ({i.compress_size} vs {i.file_size})"
            if i.compress_type == zipfile.ZIP_STORED and i.compress_size != i.file_size
            else f"claims to start on disk {i.volume} of a multi-disk archive" if i.volume not in (0, 1)
            else "is marked as a folder" if i.external_attr & _DOS_FOLDER or i.filename.endswith("/")
            else None
        )  # fmt: skip
        if why:
            raise CheckpointFormatError(f"{path}: zip record {i.filename} {why}; the file is damaged")
    tail, at = _end_record(f, size)
    _, disk, cd_disk, here, total, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
    locator = tail[at - 20 : at] if at >= 20 else b""
    if locator[:4] == b"PK\x06\x07":
        # Python's zipfile looks for the zip64 end record just before the locator; torch
        # follows the locator's offset, so that offset has to be right too.
        f.seek(min(struct.unpack_from("<Q", locator, 8)[0], size))
        record = f.read(_EOCD64.size)
        if len(record) < _EOCD64.size or record[:4] != b"PK\x06\x06":
            raise CheckpointFormatError(f"{path}: the zip64 locator points at no zip64 end record; the file is damaged")
        _, _, _, _, disk, cd_disk, here, total, cd_size, cd_offset = _EOCD64.unpack(record)
    f.seek(min(cd_offset, size))
    directory = f.read(min(cd_size, size))
    if (disk, cd_disk) not in ((0, 0), (1, 1)) or here != total:
        raise CheckpointFormatError(
            f"{path}: the zip's end record describes a multi-disk archive (disk {disk}, central directory on "
            f"disk {cd_disk}, {here} of {total} entries here); torch cannot read it, the file is damaged"
        )
    # zipfile reads each header's name, extra field and comment even past the directory's end;
    # torch requires every header to fit within the size the end record gives.
    pos = 0
    for _ in range(total):
        if directory[pos : pos + 4] != b"PK\x01\x02" or pos + CENTRAL.size > len(directory):
            raise CheckpointFormatError(f"{path}: the zip's central directory is damaged at byte {cd_offset + pos}")
        pos += CENTRAL.size + sum(struct.unpack_from("<HHH", directory, pos + 28))
        if pos > len(directory):
            raise CheckpointFormatError(f"{path}: a zip central directory header runs past the directory's end")


def _end_record(f: BinaryIO, size: int) -> tuple[bytes, int]:
    """The bytes that end the zip and where the last end-record signature in them starts.

    A zip without a comment ends in its end record: when the last 22 bytes start with the
    signature and hold no later one, that is also the last signature in the 64 KiB a comment
    may take, so only those bytes and the 20 of a zip64 locator before them are read.
    """
    f.seek(max(0, size - (_EOCD.size + 20)))
    tail = f.read()
    at = len(tail) - _EOCD.size
    if at >= 0 and tail[at : at + 4] == _SIG and _SIG not in tail[at + 1 :]:
        return tail, at
    f.seek(max(0, size - (_EOCD.size + 0xFFFF)))
    tail = f.read()
    return tail, tail.rfind(_SIG)
