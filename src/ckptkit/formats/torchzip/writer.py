"""torch's zip checkpoint, written without torch: :func:`write_torch_zip`, the one torch zip writer
of an object tree with :class:`~.entry.Entry` tensors, over :class:`ZipWriter`, the container
(stored records with torch's alignment padding, zip64 where sizes need it, every CRC-32 computed
as the bytes are written), which ``ckptkit.formats.torchzip.torch`` also feeds from torch's own pickler."""

from __future__ import annotations

import hashlib
import io
import os
import struct
import zipfile
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO, cast

from ...errors import CheckpointFormatError
from ...io.fileio import Progress, crc32, write_checked
from ..entry import Entry, map_entries
from ..pickles.dump import dumps, new_tensor
from .directory import CENTRAL as _CENTRAL
from .directory import LOCAL as _LOCAL
from .directory import U32, UTF8_NAME

ZIP64_AT = U32  # sizes/offsets from here on need zip64 (tests lower it to exercise that path)


def write_torch_zip(
    f: BinaryIO,
    obj: Any,
    *,
    records: Mapping[str, Entry] | None = None,
    prefix: str = "archive/",
    byteorder: str = "little",
    progress: Progress | None = None,
) -> int:
    """The one torch zip writer: ``obj`` as the checkpoint ``torch.load`` reads; returns the bytes stored.

    ``obj``'s tensors are :class:`~.entry.Entry` leaves, each stored as a new storage (entries
    with one ident once, so ties load tied), or torch's own stand-ins (``TensorRef``, views and
    all) over ``records``: a torch zip's storages by key, copied as they are.

    Example:
        >>> write_torch_zip(f, {"w": memory_entry("float32", (2,), buf)})  # doctest: +SKIP
    """
    table: dict[str, Entry] = dict(records or {})
    made: dict[Any, Any] = {}

    def stand_in(e: Entry, _: str) -> Any:
        if e.ident not in made:
            key = str(len(table))
            while key in table:
                key += "_"
            table[key] = e
            made[e.ident] = new_tensor(key, e.dtype, e.shape)
        return made[e.ident]

    pickled, keys = dumps(map_entries(obj, stand_in, lambda v: isinstance(v, Entry)))
    w = ZipWriter(f, alignment=64)
    w.start_torch_archive(pickled, prefix, byteorder=byteorder)
    for key in keys:
        w.add_entry(f"{prefix}data/{key}", table[key], progress)
    w.finish_torch_archive(prefix)
    w.close()
    return sum(table[k].nbytes for k in keys)


class ZipWriter:
    """Writes stored records with torch's alignment padding, zip64 where sizes need it."""

    def __init__(self, f: BinaryIO, *, alignment: int = 64) -> None:
        self.f = f
        self.alignment = alignment
        # Offsets are the archive's own, from where it begins in ``f``: a DCP file holds one archive
        # after another, each read by torch.load as a file of its own.
        self.base = f.tell()
        self.entries: list[tuple[bytes, int, int, int, int, int]] = []  # name, crc, csize, size, method, offset
        try:  # a header's CRC-32 is patched in place after its bytes, through the file's descriptor
            f.fileno()
            self.patchable = True
        except (AttributeError, OSError):  # a stream to a store: each header goes out with its CRC-32 known
            self.patchable = False

    def _header(self, name: bytes, crc: int, csize: int, size: int, method: int) -> None:
        """The local header of a record whose bytes follow."""
        offset = self.f.tell() - self.base
        zip64 = csize >= ZIP64_AT or size >= ZIP64_AT
        extra = struct.pack("<HHQQ", 1, 16, size, csize) if zip64 else b""
        # "FB" extra field padding so the data starts on an alignment boundary, as torch does.
        at = offset + _LOCAL.size + len(name) + len(extra) + 4
        pad = -at % self.alignment
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        sizes = (U32, U32) if zip64 else (csize, size)
        self.f.write(
            _LOCAL.pack(0x04034B50, 45 if zip64 else 20, UTF8_NAME, method, 0, 0x21, crc, *sizes, len(name), len(extra))
        )
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
        known = None if self.patchable else crc32(buf)  # a stream cannot go back: one pass more, in memory
        write = lambda: write_checked(self.f, buf, progress)  # noqa: E731
        return self.add_written(name, memoryview(buf).nbytes, write, crc=known, ours=True)

    def add_written(
        self, name: str, size: int, write: Callable[[], int], *, crc: int | None = None, ours: bool = False
    ) -> int:
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
        if got != crc and not self.patchable:  # the header went out with the CRC-32 the bytes were to have
            if not ours:  # the source's recorded CRC-32: its reader reports the damage, and nothing is committed
                return got
            raise CheckpointFormatError(
                f"record {name}: its bytes were read with CRC-32 {got:08x}, not {crc or 0:08x} as a first read "
                "found (changed while copied); nothing was written"
            )
        if got != crc:  # a write into a header already written back costs the disk a second write
            os.pwrite(self.f.fileno(), struct.pack("<I", got), self.base + offset + 14)  # the local header's CRC-32
        return got

    def start_torch_archive(self, pickled: bytes, prefix: str = "archive/", *, byteorder: str = "little") -> str:
        """torch's opening records: ``data.pkl`` and the small ones before the storages; returns
        ``prefix``, under which ``data/<key>`` records then go."""
        for name, payload in (
            ("data.pkl", pickled),
            (".format_version", b"1"),
            (".storage_alignment", b"64"),
            ("byteorder", byteorder.encode()),
        ):
            self.add_bytes(f"{prefix}{name}", payload)
        return prefix

    def finish_torch_archive(self, prefix: str) -> None:
        """torch's closing records: ``version`` and an id derived from every record written."""
        digest = hashlib.sha1()
        for name, crc, *_ in self.entries:
            digest.update(name + crc.to_bytes(4, "little"))
        self.add_bytes(f"{prefix}version", b"3\n")
        self.add_bytes(
            f"{prefix}.data/serialization_id", str(int.from_bytes(digest.digest()[:16], "big")).zfill(40).encode()
        )

    def add_entry(self, name: str, e: Entry, progress: Progress | None = None) -> int | None:
        """Store an entry's bytes (a compressed zip record as it is); returns their CRC-32 as
        written, which the entry's source holds against what it records (None: compressed)."""
        if e.zip is None:
            crc, ours = e.find_crc(), False
            if crc is None and not self.patchable:  # no CRC-32 recorded, and a stream cannot go back: read twice
                crc, ours = e.write(cast(BinaryIO, _Counted()), None) or 0, True
            return self.add_written(name, e.nbytes, lambda: e.write(self.f, progress) or 0, crc=crc, ours=ours)
        method, size = e.zip
        self._header(name.encode(), e.crc or 0, e.nbytes, size, method)
        return e.write(self.f, progress)

    def close(self) -> None:
        self.f.flush()
        start = self.f.tell() - self.base
        for name, crc, csize, size, method, offset in self.entries:
            big = [v for v in (size, csize, offset) if v >= ZIP64_AT]
            extra = struct.pack("<HH", 1, 8 * len(big)) + b"".join(struct.pack("<Q", v) for v in big) if big else b""
            self.f.write(
                _CENTRAL.pack(
                    0x02014B50,
                    45 if big else 20,
                    45 if big else 20,
                    UTF8_NAME,
                    method,
                    0,
                    0x21,
                    crc,
                    U32 if csize >= ZIP64_AT else csize,
                    U32 if size >= ZIP64_AT else size,
                    len(name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    U32 if offset >= ZIP64_AT else offset,
                )
            )
            self.f.write(name + extra)
        end = self.f.tell() - self.base
        count, cd_size = len(self.entries), end - start
        if count >= 0xFFFF or start >= ZIP64_AT or cd_size >= ZIP64_AT:
            self.f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, start))
            self.f.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
        self.f.write(
            struct.pack(
                "<IHHHHIIH",
                0x06054B50,
                0,
                0,
                min(count, 0xFFFF),
                min(count, 0xFFFF),
                U32 if cd_size >= ZIP64_AT else cd_size,
                U32 if start >= ZIP64_AT else start,
                0,
            )
        )


class _Counted(io.RawIOBase):
    """A sink that keeps nothing: an entry written to it gives its bytes' CRC-32 (in Python: no descriptor)."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        with memoryview(data) as view:
            return view.nbytes
