"""What a check of a torch zip reads of it, found as its bytes pass (a zip streamed to a store).

:func:`~ckptkit.formats.integrity.check_written` opens the zip (its directory and each record's
local header) and reads the records that describe the tensors (``data.pkl``, ``version``, ...),
never a tensor storage's bytes. :class:`RecordsKept` keeps exactly those, walking the local
headers as the writer appends them, so the local image of a streamed zip holds its headers,
pickle and directory, and holes where the storages are.

Example:
    >>> def record(name: bytes, data: bytes) -> bytes:  # a stored record's local header, then its bytes
    ...     return LOCAL.pack(0x04034B50, 20, 0, 0, 0, 0x21, 0, len(data), len(data), len(name), 0) + name + data
    >>> zipped = record(b"archive/data.pkl", b".") + record(b"archive/data/0", b"abc") + b"PK\x01\x02"
    >>> RecordsKept().feed(0, zipped)  # all but the storage's 3 bytes (at 91)
    [(0, 91), (94, 98)]
"""

from __future__ import annotations

import struct

from .directory import LOCAL, U32


class RecordsKept:
    """A torch zip's bytes a check reads: every local header, the records that are not tensor
    storages, and all from the central directory on (see the module)."""

    def __init__(self) -> None:
        self.begin(0)

    def begin(self, offset: int) -> None:
        """A zip starts at ``offset`` (a file of torch zips one after another, as a DCP ``.distcp``
        is, begins each): its bytes are kept as the first one's were."""
        self.at = offset  # where the next appended byte goes
        self.header = bytearray()  # the local header being gathered
        self.payload_end = 0  # the end of the record whose bytes are passing
        self.keep_payload = True
        self.tail = False  # in the central directory (or what follows the last record)
        self.storages: str | None = None  # "archive/data/": the first record names the archive's folder

    def feed(self, offset: int, data: bytes | memoryview) -> list[tuple[int, int]]:
        end = offset + len(data)
        if offset != self.at:  # a write back into what was written: kept (a header's field)
            return [(offset, end)]
        ranges: list[tuple[int, int]] = []
        view, pos = memoryview(data), offset
        while pos < end:
            if self.tail:
                ranges.append((pos, end))
                break
            if pos < self.payload_end:  # a record's bytes
                stop = min(end, self.payload_end)
                if self.keep_payload:
                    ranges.append((pos, stop))
                pos = stop
                continue
            take = min(end - pos, self._needed() - len(self.header))
            self.header += view[pos - offset : pos - offset + take]
            ranges.append((pos, pos + take))
            pos += take
            if len(self.header) >= 4 and self.header[:4] != b"PK\x03\x04":
                self.tail = True  # the central directory: kept to the end
            elif len(self.header) >= LOCAL.size and len(self.header) == self._needed():
                self._record(pos)
        self.at = end
        return _merged(ranges)

    def _needed(self) -> int:
        if len(self.header) < LOCAL.size:
            return LOCAL.size
        *_, name_len, extra_len = LOCAL.unpack_from(self.header)
        return LOCAL.size + name_len + extra_len

    def _record(self, pos: int) -> None:
        """A local header is complete at ``pos``: its record's bytes follow."""
        fields = LOCAL.unpack_from(self.header)
        compressed, name_len = fields[7], fields[9]
        name = bytes(self.header[LOCAL.size : LOCAL.size + name_len]).decode("utf-8", "replace")
        if compressed == U32:  # zip64: the sizes are in the extra field (uncompressed, then compressed)
            compressed = _zip64_compressed(bytes(self.header[LOCAL.size + name_len :]), compressed)
        self.payload_end = pos + compressed
        if self.storages is None:  # torch's first record is <folder>/data.pkl, whatever the folder's name
            folder = name.rpartition("/")[0]
            self.storages = f"{folder}/data/" if folder else "data/"
        storage = name.startswith(self.storages) and "/" not in name[len(self.storages) :]
        self.keep_payload = not storage
        self.header = bytearray()


def _zip64_compressed(extra: bytes, default: int) -> int:
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        if tag == 1 and size >= 16:
            return int(struct.unpack_from("<Q", extra, at + 12)[0])
        at += 4 + size
    return default


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in ranges:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        elif end > start:
            out.append((start, end))
    return out
