"""torch's zip checkpoint container, read and written without torch.

A torch zip holds ``<archive>/data.pkl`` (the pickle: names, structure, tensor metadata),
``<archive>/data/<key>`` (raw storage bytes, stored uncompressed, each aligned to
``.storage_alignment`` bytes, 64 by default, so they can be memory-mapped) and a few small
records. Renaming keys only changes data.pkl, so a rewrite copies every other record's bytes,
with their CRC-32s, kernel-side (``copy_file_range``), never through Python memory.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from ..errors import PARSE_ERRORS, CheckpointFormatError, summarize
from .fileio import Progress, copy_range, crc32, write_checked
from .pages import page_pad
from .zipcheck import CENTRAL as _CENTRAL
from .zipcheck import LOCAL as _LOCAL
from .zipcheck import U32, read_directory

ZIP64_AT = U32  # sizes/offsets from here on need zip64 (tests lower it to exercise that path)
MAX_FORMAT_VERSION = 10  # kMaxSupportedFileFormatVersion of torch's reader (10 in torch 2.13)


class Record(NamedTuple):  # a tuple: a torch zip opened in a DCP folder makes hundreds
    """One zip member: where its (stored or compressed) bytes are and what the zip says of them."""

    name: str
    data_offset: int
    compressed_size: int
    size: int
    crc: int
    method: int


class TorchZip:
    """The records of a torch zip checkpoint, in file order, with their data offsets.

    Everything is read through one open file (``file``): if the path is atomically replaced
    meanwhile (a trainer saving ``latest``), this object still describes, and reads, the one
    version it opened. Callers copying records must read them from ``file`` too.
    """

    def __init__(self, path: str | os.PathLike[str], *, file: BinaryIO | None = None) -> None:
        self.path = Path(path)
        self._owns_file = file is None
        self.file = file if file is not None else open(self.path, "rb")  # noqa: SIM115 - lives with self
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the file this object opened (a file passed in stays open: its owner closes it)."""
        if self._owns_file:
            self.file.close()

    @property
    def compressed_storages(self) -> bool:
        """True when a storage record is compressed: torch can read it, but not memory-map it."""
        return any(r.method != zipfile.ZIP_STORED for r in self.records if r.name.startswith(f"{self.prefix}data/"))

    def __enter__(self) -> TorchZip:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        f = self.file
        size = f.seek(0, os.SEEK_END)  # not fstat: ``file`` may be a SliceReader, a zip inside another file
        central = read_directory(self.path, f, size)
        pkl = [e.name for e in central if e.name.endswith("/data.pkl") or e.name == "data.pkl"]
        if len(pkl) != 1:
            raise CheckpointFormatError(f"{self.path}: a torch checkpoint has one data.pkl, this zip has {len(pkl)}")
        self.prefix = pkl[0][: -len("data.pkl")]
        self.records: list[Record] = []
        for e in sorted(central, key=lambda e: e.header_offset):
            if not 0 <= e.header_offset < size:
                raise CheckpointFormatError(f"{self.path}: zip directory points {e.name} outside the file")
            f.seek(e.header_offset)
            head = f.read(_LOCAL.size)
            if len(head) < _LOCAL.size or head[:4] != b"PK\x03\x04":
                raise CheckpointFormatError(f"{self.path}: local header of {e.name} is damaged")
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            start = e.header_offset + _LOCAL.size + name_len + extra_len
            if start + e.compressed_size > size:
                raise CheckpointFormatError(f"{self.path}: record {e.name} runs past the end of the file (truncated?)")
            self.records.append(Record(e.name, start, e.compressed_size, e.size, e.crc, e.method))
        self.by_name = {r.name: r for r in self.records}
        self._check_archive(central[0].name if central else "")

    def _check_archive(self, first: str) -> None:
        """What torch's reader requires of the archive and its small records (inline_container.cc,
        torch.serialization); sets ``byteorder`` and ``alignment``."""
        if "/" not in first or first[: first.index("/") + 1] != self.prefix:
            raise CheckpointFormatError(
                f"{self.path}: torch reads the folder of the first zip record ({first!r}), but data.pkl is in "
                f"{self.prefix or 'the top level'!r}; every record must sit in one folder, data.pkl included"
            )
        stray = [r.name for r in self.records if not r.name.startswith(self.prefix)]
        if stray:
            raise CheckpointFormatError(f"{self.path}: records outside the archive folder {self.prefix!r}: {summarize(stray)}")
        version = self._record(".data/version")
        version = self._record("version") if version is None else version
        if version is None:
            raise CheckpointFormatError(f"{self.path}: the zip has no {self.prefix}version record")
        number = re.match(rb"\s*(\d+)", version)  # parsed as torch's stoull does: leading digits
        if number is None or not 1 <= int(number.group(1)) <= MAX_FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{self.path}: version record says {version[:20]!r}; torch reads versions 1 to {MAX_FORMAT_VERSION}"
            )
        self.byteorder = (self._record("byteorder") or b"little").decode("latin-1")
        if self.byteorder not in ("little", "big"):
            raise CheckpointFormatError(f"{self.path}: byteorder record says {self.byteorder!r}, not little or big")
        try:  # torch decodes it when it loads
            (self._record(".data/serialization_id") or b"").decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointFormatError(f"{self.path}: .data/serialization_id is not text ({e})") from e
        alignment = self._record(".storage_alignment") or b"64"
        try:
            self.alignment = max(1, int(alignment))
        except ValueError as e:  # torch.load fails on it the same way
            raise CheckpointFormatError(f"{self.path}: .storage_alignment record says {alignment[:20]!r}, not a number") from e

    def _record(self, name: str) -> bytes | None:
        """The bytes of record ``<archive>/name``, or None if the zip has none."""
        rec = self.by_name.get(self.prefix + name)
        return None if rec is None else self.read(rec.name)

    def read(self, name: str) -> bytes:
        """A small record's bytes, CRC-checked."""
        rec = self.by_name[name]
        if rec.method != zipfile.ZIP_STORED:
            try:
                return zipfile.ZipFile(self.file).read(name)
            except PARSE_ERRORS as e:
                raise CheckpointFormatError(f"{self.path}: cannot read record {name} ({type(e).__name__}: {e})") from e
        self.file.seek(rec.data_offset)
        data = self.file.read(rec.compressed_size)
        if crc32(data) != rec.crc:
            raise CheckpointFormatError(f"{self.path}: record {name} fails its CRC-32 check (the file is damaged)")
        return data

    def storage(self, key: str) -> Record:
        rec = self.by_name.get(f"{self.prefix}data/{key}")
        if rec is None:
            raise CheckpointFormatError(f"{self.path}: the pickle refers to storage {key}, which the zip lacks")
        return rec


class SliceReader:
    """A read-only view of ``length`` bytes of ``f`` from ``start``: a file embedded in another
    (each tensor chunk of a DCP ``.distcp`` file is a whole torch zip), read as if it were alone.

    With ``window``, the first and last ``window`` bytes are read up front, in one or two preads,
    and reads within them are served from memory: a torch zip's local headers, small records and
    central directory lie there, so opening one costs two reads, not the ~20 zipfile makes.

    Example:
        >>> view = SliceReader(open("a.distcp", "rb"), 4096, 1 << 20, window=4096)  # doctest: +SKIP
    """

    def __init__(self, f: BinaryIO, start: int, length: int, *, window: int = 0) -> None:
        self._f, self.start, self.length = f, start, length
        self._pos = 0
        self._head = self._tail = b""
        if window:
            whole = length <= 2 * window
            self._head = os.pread(f.fileno(), length if whole else window, start)
            self._tail = b"" if whole else os.pread(f.fileno(), window, start + length - window)
            if len(self._head) + len(self._tail) != min(length, 2 * window):  # the file shrank: read as it is now
                self._head = self._tail = b""
        self._tail_at = length - len(self._tail) if self._tail else length  # past the end, reads are empty anyway

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = max(0, offset + (0 if whence == 0 else self._pos if whence == 1 else self.length))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        pos = self._pos
        end = self.length if n is None or n < 0 else min(pos + n, self.length)
        if end <= len(self._head):
            data = self._head[pos:end]
        elif pos >= self._tail_at:
            data = self._tail[pos - self._tail_at : end - self._tail_at]
        else:
            data = os.pread(self._f.fileno(), end - pos, self.start + pos)
        self._pos += len(data)
        return data

    def seekable(self) -> bool:
        return True


class ZipWriter:
    """Writes stored records with torch's alignment padding, zip64 where sizes need it."""

    def __init__(self, f: BinaryIO, *, alignment: int = 64) -> None:
        self.f = f
        self.alignment = alignment
        self.entries: list[tuple[bytes, int, int, int, int, int]] = []  # name, crc, csize, size, method, offset

    def _header(self, name: bytes, crc: int, csize: int, size: int, method: int, *, like: int | None = None) -> None:
        """The local header; ``like``: the source offset of the bytes that follow, if copied."""
        offset = self.f.tell()
        zip64 = csize >= ZIP64_AT or size >= ZIP64_AT
        extra = struct.pack("<HHQQ", 1, 16, size, csize) if zip64 else b""
        # "FB" extra field padding so the data starts on an alignment boundary, as torch does
        # (and at its source's offset within a page, for a long copy).
        at = offset + _LOCAL.size + len(name) + len(extra) + 4
        pad = -at % self.alignment if like is None else page_pad(at, like, csize, alignment=self.alignment)
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        sizes = (U32, U32) if zip64 else (csize, size)
        self.f.write(_LOCAL.pack(0x04034B50, 45 if zip64 else 20, 0, method, 0, 0x21, crc, *sizes, len(name), len(extra)))
        self.f.write(name + extra)
        self.entries.append((name, crc, csize, size, method, offset))

    def add_bytes(self, name: str, data: bytes) -> None:
        self._header(name.encode(), crc32(data), len(data), len(data), zipfile.ZIP_STORED)
        self.f.write(data)

    def add_buffer(self, name: str, buf: Any, progress: Progress | None = None) -> int:
        """Store a buffer's bytes (a tensor's storage, not copied into Python); returns its CRC-32.

        The CRC is computed while the bytes are written (fileio.write_checked), then patched into
        the local header written before them: one pass over the data.
        """
        return self.add_written(name, memoryview(buf).nbytes, lambda: write_checked(self.f, buf, progress))

    def add_written(self, name: str, size: int, write: Callable[[], int], *, crc: int | None = None) -> int:
        """Store ``size`` bytes that ``write()`` appends to ``self.f``, returning their CRC-32 (pieces
        of a tensor copied from several files). The header gets ``crc`` where the caller knows what
        the bytes' CRC should be (a DCP tensor's, from its chunks'), else it is patched in after;
        so it is where the bytes turned out otherwise (the caller reports that damage)."""
        self._header(name.encode(), crc or 0, size, size, zipfile.ZIP_STORED)
        start = self.f.tell()
        got = write()
        name_b, _, csize, size_, method, offset = self.entries[-1]
        self.entries[-1] = (name_b, got, csize, size_, method, offset)
        self.f.flush()  # the header must be on the file before its CRC field is patched there
        if self.f.tell() - start != size:  # the header's sizes came first: they must be what was written
            raise CheckpointFormatError(f"record {name}: {self.f.tell() - start} bytes written, its header says {size}")
        if got != crc:  # a write into a header already written back costs the disk a second write
            os.pwrite(self.f.fileno(), struct.pack("<I", got), offset + 14)  # the local header's CRC-32 field
        return got

    def start_torch_archive(self, pickled: bytes, prefix: str = "archive/") -> str:
        """torch's opening records: ``data.pkl`` and the small ones before the storages; returns
        ``prefix``, under which ``data/<key>`` records then go."""
        for name, payload in (("data.pkl", pickled), (".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")):
            self.add_bytes(f"{prefix}{name}", payload)
        return prefix

    def finish_torch_archive(self, prefix: str) -> None:
        """torch's closing records: ``version`` and an id derived from every record written."""
        digest = hashlib.sha1()
        for name, crc, *_ in self.entries:
            digest.update(name + crc.to_bytes(4, "little"))
        self.add_bytes(f"{prefix}version", b"3\n")
        self.add_bytes(f"{prefix}.data/serialization_id", str(int.from_bytes(digest.digest()[:16], "big")).zfill(40).encode())

    def add_copy(self, name: str, src: BinaryIO, rec: Record, progress: Progress | None = None) -> int | None:
        """Copy a record's bytes from another zip, keeping its CRC and compression as they were.

        Returns the CRC-32 of a stored record's bytes as copied, for the caller to hold against
        ``rec.crc`` (None for a compressed record, whose CRC covers the inflated bytes).
        """
        self._header(name.encode(), rec.crc, rec.compressed_size, rec.size, rec.method, like=rec.data_offset)
        stored = rec.method == zipfile.ZIP_STORED
        copied = copy_range(src, self.f, rec.data_offset, rec.compressed_size, progress, crc=stored)
        return copied if stored else None

    def add_range(self, name: str, src: BinaryIO, offset: int, length: int, crc: int, progress: Progress | None = None) -> int:
        """Store ``length`` bytes of ``src`` from ``offset`` under a CRC the caller knows; returns
        the CRC-32 of the bytes as copied, for the caller to hold against ``crc``."""
        self._header(name.encode(), crc, length, length, zipfile.ZIP_STORED, like=offset)
        return copy_range(src, self.f, offset, length, progress, crc=True)

    def close(self) -> None:
        self.f.flush()
        start = self.f.tell()
        for name, crc, csize, size, method, offset in self.entries:
            big = [v for v in (size, csize, offset) if v >= ZIP64_AT]
            extra = struct.pack("<HH", 1, 8 * len(big)) + b"".join(struct.pack("<Q", v) for v in big) if big else b""
            self.f.write(
                _CENTRAL.pack(
                    0x02014B50, 45 if big else 20, 45 if big else 20, 0, method, 0, 0x21, crc,
                    U32 if csize >= ZIP64_AT else csize, U32 if size >= ZIP64_AT else size,
                    len(name), len(extra), 0, 0, 0, 0, U32 if offset >= ZIP64_AT else offset,
                )  # fmt: skip
            )
            self.f.write(name + extra)
        end = self.f.tell()
        count, cd_size = len(self.entries), end - start
        if count >= 0xFFFF or start >= ZIP64_AT or cd_size >= ZIP64_AT:
            self.f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, start))
            self.f.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
        self.f.write(
            struct.pack(
                "<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                U32 if cd_size >= ZIP64_AT else cd_size, U32 if start >= ZIP64_AT else start, 0,
            )  # fmt: skip
        )
