"""A DCP folder's tensors as byte ranges of its ``.distcp`` files, copied piece by piece, no torch.

FileSystemWriter stores each tensor chunk as a whole ``torch.save`` zip at ``_StorageInfo.offset``
of a ``.distcp`` file, its bytes in one stored record whose CRC-32 the zip records. A chunk that
spans every dimension but the first (FSDP2's ``Shard(0)``, or an unsharded tensor) is a
contiguous run of the full tensor's bytes, so the full tensor is its chunks' bytes in offset
order. :func:`open_dcp` describes each tensor as those pieces (:class:`DcpTensor`, an
:class:`~..entry.Entry` every writer takes), which it copies kernel-side, checking each piece
against its CRC-32 as it is copied and combining them into the tensor's. What this does not
model (chunks split along another dimension, transforms, non-tensor values beyond plain ones)
raises :class:`~..source.NeedsTorch` when that tensor's pieces are found: at :func:`open_dcp`,
or, opened ``lazy`` (convert), when the writer reaches it; the writer's atomic output is then
dropped and convert falls back to torch.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, NoReturn

from ...errors import CheckpointFormatError, CheckpointNotFoundError, summarize
from ...io.crcmath import crc32_combine
from ...io.fileio import (
    Progress,
    copy_range,
    crc32,
    crc_in_background,
    crc_of_range,
    file_size,
    open_regular,
    pread_into,
    write_checked,
)
from ..dtypes import BY_NAME
from ..entry import Entry
from ..integrity import Check, Damage
from ..pickles import reader as lp
from ..producers import Producer
from ..source import NeedsTorch, checkpoint_bytes
from ..spec import EntryView, Info
from ..torchzip.bounds import storage_problem
from ..torchzip.container import SliceReader, TorchZip
from .detect import DCP
from .megatron import megatron_producer, unstack
from .meta import (
    BytesEntry,
    Chunk,
    DcpMetadata,
    Stored,
    TensorEntry,
    Tiling,
    chunks_in_order,
    read_metadata,
    set_element,
)

__all__ = ["DcpSource", "DcpTensor", "Piece", "chunk_crc_check", "is_leaf", "open_dcp"]

_MAX_VALUE = 64 << 20  # a non-tensor value's pickle read into memory; larger ones go through torch
_WINDOW = 4096  # bytes read up front at each end of a chunk's zip: its headers, small records and directory
_Seen = dict[tuple[bytes, str, tuple[int, ...], str], lp.TensorRef]  # checked chunk layouts: see _chunk_tensor


class Piece(NamedTuple):
    """``length`` bytes at ``offset`` of ``file`` (a ``.distcp`` name), whose CRC-32 is ``crc``."""

    file: str
    offset: int
    length: int
    crc: int
    where: str  # "chunk at [19, 0] in __1_0.distcp", for messages


@dataclass(eq=False)
class DcpTensor(Entry):
    """A full tensor as the pieces of its bytes, in order. Where :func:`open_dcp` was ``lazy``,
    they are found when first asked for (:meth:`write`), so an error in them is raised in the
    writer's order."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    find: Callable[[], tuple[tuple[Piece, ...], Tiling | None]] = field(repr=False)
    src: DcpSource = field(repr=False)
    _found: tuple[Piece, ...] | None = field(default=None, repr=False)
    _tiling: Tiling | None = field(default=None, repr=False)
    zip = None
    complete = True

    @property
    def ident(self) -> DcpTensor:  # each tensor its own storage
        return self

    storage = ident

    # Entry declares storage_size, crc and nbytes as plain attributes; here they are computed, read-only
    # (no user of an Entry writes them): hence ignore[override], as in cast.py and deepspeed/stream.py.
    @property
    def storage_size(self) -> int:  # type: ignore[override]
        return self.nbytes

    def write(self, f: BinaryIO, progress: Progress | None = None) -> int:
        return self.src.copy(self, f, progress)

    def find_crc(self) -> int | None:
        self.pieces  # noqa: B018 - found now: they are copied next
        return self.crc

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """Its chunks' bytes, whole, in offset order."""
        if self._found is None:
            self._found, self._tiling = self.find()
        return self._found

    @property
    def tiling(self) -> Tiling | None:
        """Where its chunks interleave (split along a dim other than 0), how they tile it, in
        elements (:func:`~.meta.chunks_in_order`); None: the pieces follow one another."""
        self.pieces  # noqa: B018 - found with them
        return self._tiling

    @property
    def crc(self) -> int | None:  # type: ignore[override]
        """The CRC-32 its bytes have where each chunk's match the CRC-32 its zip records; None
        until its pieces are found (a writer does not wait for them), or where its chunks
        interleave (then it is known once copied)."""
        if self._found is None or self._tiling is not None:
            return None
        crc = 0
        for p in self._found:
            crc = crc32_combine(crc, p.crc, p.length)
        return crc

    @property
    def nbytes(self) -> int:  # type: ignore[override]  # what the pieces add up to: each chunk was checked against .metadata
        return math.prod(self.shape) * BY_NAME[self.dtype].itemsize


@dataclass
class DcpSource(EntryView):
    """An opened DCP folder: ``obj``, the nested state dict with :class:`DcpTensor` leaves and
    plain values, and the open ``.distcp`` files its pieces are read from."""

    folder: Path
    obj: dict[str, Any]
    meta: DcpMetadata | None = None  # its .metadata, once read
    files: dict[str, BinaryIO] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # each file's size when opened: checked once, not per chunk
    copied: set[str] = field(default_factory=set)  # the tensors a copy read (the rest: unread)
    producer: Producer | None = None  # megatron-core, where it wrote the folder
    lazy: bool = False  # its chunks' headers are read as their tensors are first copied (open_dcp's lazy)
    damage: Damage = field(init=False)
    _band: memoryview | None = field(default=None, repr=False)  # the band buffer (:meth:`_bands`), once needed
    _shapes: dict[tuple[int, int, int, int], list[memoryview]] = field(default_factory=dict, repr=False)
    leaf_type = DcpTensor

    def __post_init__(self) -> None:
        self.damage = Damage(str(self.folder), lambda key: f"tensor {key[0]} ({key[1].where})")

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    @property
    def nbytes(self) -> int:
        return checkpoint_bytes(self.folder, DCP)

    def unread(self) -> list[str]:
        """After a copy: the tensors it did not read (a model-only copy's optimizer state), whose
        chunks were never CRC-checked; ``verify`` checks them."""
        return sorted(t.fqn for t in _tensors(self.obj) if t.fqn not in self.copied)

    def describe(self) -> tuple[Info, dict[str, Any], Producer | None]:
        """Shapes, dtypes and where the bytes are, from ``.metadata`` and each chunk's zip header."""
        return self.entry_info, {}, self.producer

    def copy(self, t: DcpTensor, dst: BinaryIO, progress: Progress | None = None) -> int:
        """Append ``t``'s bytes to ``dst``; returns their CRC-32. A piece that differs from its
        recorded CRC-32 goes to :attr:`damage` (raised once everything was read)."""
        crc = 0
        self.copied.add(t.fqn)
        pieces, tiling = t.pieces, t.tiling
        if tiling is None:
            for p in pieces:
                read = copy_range(self.files[p.file], dst, p.offset, p.length, progress, crc=True)
                self.damage.check((t.fqn, p), p.crc, read)
                crc = crc32_combine(crc, read, p.length)
            return crc
        # A chunk's stretches come in its own order (its rows in the tensor's order), so its CRC-32
        # builds up as they pass. Rows go in bands of at most BAND bytes: each chunk's share of a
        # band is one read, and the band is assembled in memory and written once.
        chunk_crcs = [0] * len(pieces)
        unit = BY_NAME[t.dtype].itemsize
        row_bytes = tiling.width * unit

        def stretch(k: int, start: int, length: int) -> int:  # copied in the kernel: beyond a band
            p = pieces[k]
            got = copy_range(self.files[p.file], dst, p.offset + start, length, progress, crc=True)
            chunk_crcs[k] = crc32_combine(chunk_crcs[k], got, length)
            return got

        for g in tiling.groups:
            parts = [(k, first * unit, width * unit) for k, first, width in g.parts]
            if len(parts) == 1:  # one chunk spans these rows: they follow one another in it
                k, start, width = parts[0]
                crc = crc32_combine(crc, stretch(k, start, g.rows * width), g.rows * width)
            elif row_bytes > BAND:  # a row beyond a band: stretch by stretch
                for r in range(g.rows):
                    for k, start, width in parts:
                        crc = crc32_combine(crc, stretch(k, start + r * width, width), width)
            else:
                crc = crc32_combine(
                    crc, self._bands(pieces, g.rows, parts, row_bytes, dst, progress, chunk_crcs), g.rows * row_bytes
                )
        for p, got in zip(pieces, chunk_crcs, strict=True):
            self.damage.check((t.fqn, p), p.crc, got)
        return crc

    def _bands(
        self,
        pieces: tuple[Piece, ...],
        rows: int,
        parts: list[tuple[int, int, int]],
        row_bytes: int,
        dst: BinaryIO,
        progress: Progress | None,
        chunk_crcs: list[int],
    ) -> int:
        """A group's ``rows`` rows, each ``parts`` side by side (``(chunk, first byte, width)``),
        appended to ``dst`` band by band; returns their CRC-32, and adds each chunk's rows to its
        CRC-32 in ``chunk_crcs``.

        Rows at least as wide as the band has rows (at most about ``sqrt(BAND)`` of them) are
        read straight into their places: a local chunk's run of rows is CRC'd on a helper thread
        meanwhile (no call per row), an object in a store's row by row as read. Narrower rows go
        through :func:`_place_narrow`. The band's buffer, and the places of its rows, serve every
        band of that shape."""
        step, crc = BAND // row_bytes, 0
        whole = self._buffer()
        runs = {}  # part -> the CRC-32 of its chunk's rows here, read alongside
        try:
            for i, (k, start, width) in enumerate(parts):
                p = pieces[k]
                if step <= width and (run := crc_in_background(self.files[p.file], p.offset + start, rows * width)):
                    runs[i] = run
            for r in range(0, rows, step):
                n, col = min(step, rows - r), 0
                for i, (k, start, width) in enumerate(parts):
                    p = pieces[k]
                    at = p.offset + start + r * width
                    if n <= width:  # wide rows: each read straight into its place
                        places = self._places(n, row_bytes, col, width)
                        if pread_into(self.files[p.file], places, at) < n * width:
                            _truncated(p.where)
                        if i not in runs:  # an object in a store: CRC'd as read
                            got = 0
                            for v in places:
                                got = crc32(v, got)
                            chunk_crcs[k] = crc32_combine(chunk_crcs[k], got, n * width)
                    else:
                        got = _place_narrow(self.files[p.file], at, p.where, whole[: n * row_bytes], n, col, width)
                        chunk_crcs[k] = crc32_combine(chunk_crcs[k], got, n * width)
                    col += width
                crc = crc32_combine(
                    crc, write_checked(dst, whole[: n * row_bytes], progress, writeback=True), n * row_bytes
                )
        except BaseException:
            for run in runs.values():  # they read files the caller closes next
                with contextlib.suppress(Exception):
                    run()
            raise
        for i, run in runs.items():
            k, _, width = parts[i]
            chunk_crcs[k] = crc32_combine(chunk_crcs[k], run(), rows * width)
        return crc

    def _buffer(self) -> memoryview:
        if self._band is None:
            self._band = memoryview(bytearray(BAND))
        return self._band

    def _places(self, rows: int, row_bytes: int, col: int, width: int) -> list[memoryview]:
        """Where ``rows`` rows of ``width`` bytes go in the band buffer, from byte column ``col``."""
        key = (rows, row_bytes, col, width)
        places = self._shapes.get(key)
        if places is None:
            whole = self._buffer()
            places = [whole[i * row_bytes + col : i * row_bytes + col + width] for i in range(rows)]
            if len(self._shapes) >= _SHAPES:
                self._shapes.clear()
            self._shapes[key] = places
        return places


BAND = 1 << 20  # bytes of an interleaved tensor assembled at once: memory holds this, never a tensor
_SHAPES = 64  # band shapes whose row places are kept (a model has a few)


def _place_narrow(f: BinaryIO, at: int, where: str, band: memoryview, rows: int, col: int, width: int) -> int:
    """A chunk's ``rows`` rows of ``width`` bytes (narrower than there are rows), read from ``f``
    at ``at`` as one run, placed in ``band`` (rows of ``len(band) // rows`` bytes) from byte
    column ``col`` byte column by byte column with strided copies in C, so a band of narrow rows
    holds no object per row; returns their CRC-32."""
    row_bytes = len(band) // rows
    data = bytearray(rows * width)
    if pread_into(f, [memoryview(data)], at) < len(data):
        _truncated(where)
    for j in range(width):
        band[col + j :: row_bytes] = data[j::width]
    return crc32(data)


def _truncated(where: str) -> NoReturn:
    raise CheckpointFormatError(f"{where}: the file ends before the chunk does (truncated while read?)")


def is_leaf(value: Any) -> bool:
    return isinstance(value, DcpTensor)


def _tensors(obj: Any) -> Iterator[DcpTensor]:
    """Every tensor of an opened folder's nested state dict."""
    todo = [obj]
    while todo:
        node = todo.pop()
        if isinstance(node, DcpTensor):
            yield node
        elif isinstance(node, Mapping):
            todo += list(node.values())
        elif isinstance(node, list):
            todo += node


def chunk_crc_check(src: DcpSource, progress: Progress | None = None) -> Check:
    """Every chunk's bytes against the CRC-32 its embedded zip records (what ``verify`` reports)."""
    bad, count = [], 0
    for node in _tensors(src.obj):
        for p in node.pieces:
            count += 1
            if crc_of_range(_file(src, p.file), p.offset, p.length, progress) != p.crc:
                bad.append(f"{node.fqn} ({p.where})")
    detail = f"damaged: {summarize(sorted(bad), 4)}" if bad else f"{count} chunks match"
    return Check("CRC-32 of every chunk", "integrity", not bad, detail)


def open_dcp(folder: str | os.PathLike[str], *, lazy: bool = False, unstack_layers: bool = False) -> DcpSource:
    """Describe a DCP folder's tensors as pieces (reads ``.metadata`` and each chunk's zip header).

    ``lazy``: read ``.metadata`` now and each tensor's chunk headers when its pieces are first
    asked for. A writer copying tensors in order (convert) then reads them while the disk
    writes back what it copied; the errors below may then come from :attr:`DcpTensor.pieces`.
    ``unstack_layers``: each layer of megatron-core's stacked tensors under its own key
    (:func:`~.megatron.unstack`).

    Raises:
        NeedsTorch, UnsupportedGlobal: something here is not modelled; torch's reader may read it.
        CheckpointFormatError: chunks leave gaps or overlap, or a chunk is not what the metadata says.
    """
    src = DcpSource(Path(folder), {}, lazy=lazy)
    try:
        src.meta = meta = read_metadata(src.folder)
        src.producer = megatron_producer(src.folder, meta)
        if unstack_layers:
            meta = unstack(src.folder, meta)[0]
        seen: _Seen = {}
        for fqn, entry in meta.entries.items():
            if isinstance(entry, TensorEntry):
                if entry.dtype not in BY_NAME:
                    raise NeedsTorch(f"tensor {entry.fqn} has dtype {entry.dtype}")
                value: Any = DcpTensor(entry.fqn, entry.dtype, entry.shape, lambda e=entry: _pieces(src, e, seen), src)  # type: ignore[misc]
                if not lazy:
                    value.pieces  # noqa: B018 - found now: errors come from open_dcp
            else:
                value = _value(src, entry)
            set_element(src.obj, meta.paths.get(fqn, (fqn,)), value)
        return src
    except BaseException:
        src.close()
        raise


def _file(src: DcpSource, name: str) -> BinaryIO:
    if name not in src.files:
        path = src.folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointFormatError(f"{src.folder}/.metadata: stores bytes in {name!r}, outside the folder")
        try:
            src.files[name] = open_regular(path, folder=src.folder)  # owned by the source, closed by its user
        except CheckpointNotFoundError as e:
            raise CheckpointFormatError(f"{src.folder}: .metadata stores bytes in {name}, which is missing") from e
        src.sizes[name] = file_size(src.files[name])
    return src.files[name]


def _zip(src: DcpSource, stored: Stored, what: str) -> tuple[TorchZip, SliceReader]:
    f = _file(src, stored.file)
    if stored.offset + stored.length > src.sizes[stored.file]:
        raise CheckpointFormatError(f"{src.folder}/{stored.file}: {what} runs past the end of the file (truncated?)")
    view = SliceReader(f, stored.offset, stored.length, window=_WINDOW)
    if view.read(4) != b"PK\x03\x04":
        raise NeedsTorch(f"{what} is not stored as torch.save's zip")
    try:
        return TorchZip(f"{src.folder}/{stored.file}@{stored.offset}", file=view), view  # type: ignore[arg-type]
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{what}: {e}") from e


def _pickle_bytes(z: TorchZip, what: str) -> bytes:
    """The zip's data.pkl, CRC-checked."""
    rec = z.by_name[f"{z.prefix}data.pkl"]
    if rec.size > _MAX_VALUE:
        raise NeedsTorch(f"{what} is a {rec.size}-byte pickle")
    try:
        return z.read(rec.name)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{z.path}: {what}: {e}") from e


def _unpickled(z: TorchZip, data: bytes, what: str) -> Any:
    try:
        return lp.loads(data)
    except lp.UnsupportedGlobal as e:
        raise NeedsTorch(f"{what} needs global {e.name}") from e
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{z.path}: {what}: {e}") from e


def _pieces(src: DcpSource, e: TensorEntry, seen: _Seen) -> tuple[tuple[Piece, ...], Tiling | None]:
    pieces = []
    chunks, tiling = chunks_in_order(src.folder, e)
    for c in chunks:
        what = f"chunk at {list(c.offsets)} in {c.stored.file}"
        z, view = _zip(src, c.stored, f"tensor {e.fqn}'s {what}")
        t = _chunk_tensor(src, z, e, c, what, seen)
        rec = z.storage(t.storage.key)
        if (why := storage_problem(t.storage, z)) is not None:  # torch's reader refuses it too
            raise CheckpointFormatError(f"{src.folder}: tensor {e.fqn}'s {what}: {why}")
        if rec.method != 0 or t.byte_range() != (0, rec.size):
            raise NeedsTorch(
                f"tensor {e.fqn}'s {what} is {'compressed' if rec.method else 'a view of a larger storage'}"
            )
        pieces.append(Piece(c.stored.file, view.start + rec.data_offset, rec.size, rec.crc, what))
    return tuple(pieces), tiling


def _chunk_tensor(src: DcpSource, z: TorchZip, e: TensorEntry, c: Chunk, what: str, seen: _Seen) -> lp.TensorRef:
    """Chunk ``c``'s tensor (read-only), its dtype, shape, layout and byte order checked against
    ``.metadata``. That depends only on the data.pkl bytes, the metadata's dtype and sizes and the
    byte order, which chunks of one shape share: each such case is unpickled and checked once per
    :func:`open_dcp` (``seen``); every chunk's data.pkl is still read and CRC-checked."""
    data = _pickle_bytes(z, f"tensor {e.fqn}'s {what}")
    sizes = c.sizes if c.saved is None else c.saved
    known = seen.get((data, e.dtype, sizes, z.byteorder))
    if known is not None:
        return known
    t = lp.tensor_of(_unpickled(z, data, f"tensor {e.fqn}'s {what}"))
    if t is None:
        raise CheckpointFormatError(f"{src.folder}: tensor {e.fqn}'s {what} holds no tensor")
    if t.dtype != e.dtype or t.shape != sizes:
        raise CheckpointFormatError(
            f"{src.folder}: tensor {e.fqn}'s {what} is {t.dtype}{list(t.shape)}; .metadata says {e.dtype}{list(sizes)}"
        )
    if z.byteorder != "little" or not t.is_contiguous():
        raise NeedsTorch(f"tensor {e.fqn}'s {what} is {'big-endian' if z.byteorder != 'little' else 'not contiguous'}")
    seen[(data, e.dtype, sizes, z.byteorder)] = t
    return t


def _value(src: DcpSource, e: BytesEntry) -> Any:
    what = f"value {e.fqn}"
    z = _zip(src, e.stored, what)[0]
    value = _unpickled(z, _pickle_bytes(z, what), what)
    if _holds_tensor(value):
        raise NeedsTorch(f"{what} holds tensors")
    return value


def _holds_tensor(node: Any) -> bool:
    if lp.is_tensor(node) or isinstance(node, lp.StorageRef):
        return True
    if isinstance(node, Mapping):
        return any(_holds_tensor(v) for v in node.values())
    if isinstance(node, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in node)
    if isinstance(node, lp.Call):
        return _holds_tensor(node.args) or _holds_tensor(node.state)
    return False
