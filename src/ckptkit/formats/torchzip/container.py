"""torch's zip checkpoint container, read without torch (``zipwrite`` writes it).

A torch zip holds ``<archive>/data.pkl`` (the pickle: names, structure, tensor metadata),
``<archive>/data/<key>`` (raw storage bytes, stored uncompressed, each aligned to
``.storage_alignment`` bytes, 64 by default, so they can be memory-mapped) and a few small
records. Renaming keys only changes data.pkl, so a rewrite copies every other record's bytes,
with their CRC-32s, kernel-side (``copy_file_range``), never through Python memory.
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
from collections import Counter
from pathlib import Path
from typing import BinaryIO, NamedTuple

from ...errors import PARSE_ERRORS, CheckpointFormatError, CkptkitError, summarize
from ...io.fileio import crc32, open_regular, pread
from .directory import LOCAL as _LOCAL
from .directory import read_directory

MAX_FORMAT_VERSION = 10  # kMaxSupportedFileFormatVersion of torch's reader (10 in torch 2.13)


class Record(NamedTuple):  # a tuple: a torch zip opened in a DCP folder makes hundreds
    """One zip member: where its (stored or compressed) bytes are and what the zip says of them."""

    name: str
    data_offset: int
    compressed_size: int
    size: int
    crc: int
    method: int


_SMALL = 1 << 16  # a record outside data/ up to this size is read whole when the zip is opened


class TorchZip:
    """The records of a torch zip checkpoint, in file order, with their data offsets.

    Everything is read through one open file (``file``): if the path is atomically replaced
    meanwhile (a trainer saving ``latest``), this object still describes, and reads, the one
    version it opened. Callers copying records must read them from ``file`` too.
    """

    def __init__(self, path: str | os.PathLike[str], *, file: BinaryIO | None = None) -> None:
        self.path = Path(path)
        self._owns_file = file is None
        self.file = file if file is not None else open_regular(self.path)  # lives with self
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
        if len(self.by_name) != len(self.records):  # readers would disagree on which record holds the bytes
            counts = Counter(r.name for r in self.records)
            twice = sorted(n for n, c in counts.items() if c > 1)
            raise CheckpointFormatError(
                f"{self.path}: the zip directory names {summarize(twice)} more than once; torch.save writes each "
                "record once, and readers disagree on which copy to use, so ckptkit reads none: re-save it from "
                "the program that wrote it"
            )
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
            raise CheckpointFormatError(
                f"{self.path}: records outside the archive folder {self.prefix!r}: {summarize(stray)}"
            )
        self._small = {  # the small records torch reads and obeys: read and CRC-checked here, once
            rec.name: self.read(rec.name)
            for rec in self.records
            if not rec.name.startswith(f"{self.prefix}data/") and rec.size <= _SMALL
        }
        version = self._record(".data/version")
        version = self._record("version") if version is None else version
        if version is None:
            raise CheckpointFormatError(f"{self.path}: the zip has no {self.prefix}version record")
        number = re.match(rb"\s*(\d+)", version)  # parsed as torch's stoull does: leading digits
        if number is None or not 1 <= int(number.group(1)) <= MAX_FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{self.path}: version record says {version[:20]!r}; torch reads versions 1 to {MAX_FORMAT_VERSION}"
            )
        # an empty record is not a missing one: torch refuses b"" as a byte order and as a number
        byteorder = self._record("byteorder")
        self.byteorder = "little" if byteorder is None else byteorder.decode("latin-1")
        if self.byteorder not in ("little", "big"):
            raise CheckpointFormatError(f"{self.path}: byteorder record says {self.byteorder!r}, not little or big")
        try:  # torch decodes it when it loads
            (self._record(".data/serialization_id") or b"").decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointFormatError(f"{self.path}: .data/serialization_id is not text ({e})") from e
        alignment = self._record(".storage_alignment")
        alignment = b"64" if alignment is None else alignment
        try:
            self.alignment = max(1, int(alignment))
        except ValueError as e:  # torch.load fails on it the same way
            raise CheckpointFormatError(
                f"{self.path}: .storage_alignment record says {alignment[:20]!r}, not a number"
            ) from e

    def _record(self, name: str) -> bytes | None:
        """The bytes of record ``<archive>/name``, or None if the zip has none."""
        rec = self.by_name.get(self.prefix + name)
        return None if rec is None else self.read(rec.name)

    def read(self, name: str) -> bytes:
        """A small record's bytes, CRC-checked (those read at open, from then on without reading again)."""
        small = self.__dict__.get("_small", {})
        if name in small:
            return small[name]  # type: ignore[no-any-return]
        rec = self.by_name[name]
        if rec.method != zipfile.ZIP_STORED:
            try:
                return zipfile.ZipFile(self.file).read(name)
            except CkptkitError:
                raise  # the store's failure (a URL's object): not the record's damage
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
            self._head = pread(f, length if whole else window, start)
            self._tail = b"" if whole else pread(f, window, start + length - window)
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
            data = pread(self._f, end - pos, self.start + pos)
        self._pos += len(data)
        return data

    def seekable(self) -> bool:
        return True
