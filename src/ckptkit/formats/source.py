"""A checkpoint file opened without torch: its object tree, with leaves that know where their bytes are.

A torch zip's pickle is read through stand-ins (:class:`~.torchpickle.TensorRef` leaves), a
safetensors header becomes :class:`StRef` leaves, and Hugging Face shards become one tree over
every shard's leaves, each leaf's own file at hand (:meth:`Source.part`). Nothing reads tensor
bytes here: :meth:`Source.entry` turns a leaf into the :class:`~.entry.Entry` a writer copies
(and :meth:`Source.records`, a torch zip's storages, for a torch zip written from one), each
byte checked against the CRC-32 the source records for it as it is copied; a mismatch goes to
:attr:`Source.damage`, raised once the output is written. What this path does not model raises
:class:`NeedsTorch` before a byte is written, and the caller falls back to torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import CheckpointFormatError
from ..io.fileio import copy_range, open_regular
from .dtypes import BY_SAFETENSORS
from .entry import Bytes, Entry
from .hf.detect import HF, shard_format
from .hf.index import HfIndex, check_shard_keys, read_index
from .integrity import Damage, record_crc, record_tensors, tensors_named
from .pickles import reader as lp
from .pickles.scan import sharded_tensor_error
from .producers import Producer
from .safetensors.codec import insert_aliases, parse_aliases, parse_crcs, read_header, shown_metadata
from .safetensors.detect import SAFETENSORS
from .spec import Info, TensorInfo
from .torchzip import modulepickle as mp
from .torchzip.bounds import check_tensors, tensor_problem
from .torchzip.container import Record, TorchZip
from .torchzip.detect import ZIP


class NeedsTorch(Exception):
    """This source cannot be rewritten without loading it with torch (the reason is the message)."""


@dataclass(eq=False)  # identity matters: aliases are the same object
class StRef:
    """A tensor in a safetensors file: dtype, shape, absolute byte range, recorded CRC-32."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    length: int
    crc: int | None = None


@dataclass
class Source:
    """An opened checkpoint: its object tree with byte-locating leaves.

    ``file`` is the one open file everything is read from, so that a source replaced on disk
    meanwhile (``os.replace`` by a running trainer) is still read as the version opened. A
    sharded source has one such Source per shard in ``parts``; ``part(leaf)`` is the leaf's.
    """

    path: Path
    fmt: str
    obj: Any
    file: BinaryIO | None
    zip: TorchZip | None = None
    metadata: dict[str, str] | None = None
    data_start: int = 0
    parts: list[Source] = field(default_factory=list)
    owner: dict[int, Source] = field(default_factory=dict)  # id(leaf) -> the part holding it
    index: HfIndex | None = None
    module: str = ""  # a whole pickled module's class (``DataParallel(ToyCNN)``): obj is its state_dict()
    damage: Damage = field(init=False)
    _checked: set[Any] = field(default_factory=set)  # views' storages whose whole record was CRC'd
    _read: set[tuple[int, str]] = field(default_factory=set)  # (id(part), record name) copied

    def __post_init__(self) -> None:
        self.damage = Damage(str(self.path), self._name)

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def nbytes(self) -> int:
        if self.index is not None:  # the index it was opened from, whatever its name
            return self.index.total_bytes()
        return checkpoint_bytes(self.path, self.fmt)

    @property
    def notes(self) -> list[str]:
        return []

    @property
    def pickled_module(self) -> str:
        return self.module

    def output_metadata(self) -> dict[str, str]:
        if self.fmt == SAFETENSORS:
            return self.metadata or {}
        if self.index is None:
            return {"format": "pt"}
        # Shards: what their headers say, each key as the first shard saying it has it (writers such as
        # transformers put the same entries, torchao's description of each tensor among them, in every shard).
        out: dict[str, str] = {"format": "pt"}
        for part in self.parts:
            for k, v in (part.metadata or {}).items():
                if k in self.obj and v in self.obj:  # huggingface_hub's tie (dropped name: kept name), not carried
                    continue
                out[k] = out[k] if k in out and k != "format" else v
        return out

    def is_leaf(self, value: Any) -> bool:
        return is_leaf(value)

    def describe(self) -> tuple[Info, dict[str, Any], Producer | None]:
        """Names, shapes, dtypes and storages from the pickle or header alone."""

        def info(name: str, ref: Any) -> tuple[TensorInfo, Any, int]:
            if isinstance(ref, StRef):  # an alias is the same object as its target
                dtype = BY_SAFETENSORS[ref.dtype].name if ref.dtype in BY_SAFETENSORS else ref.dtype
                return TensorInfo(name, list(ref.shape), dtype, "cpu", ref.length), id(ref), ref.length
            t = lp.tensor_of(ref)
            if t is None:
                raise CheckpointFormatError(f"{self.path}: entry {name} is not a tensor")
            storage = (id(self.part(ref)), t.storage.key)  # keys repeat across shards
            return TensorInfo(name, list(t.shape), t.dtype, t.device, t.nbytes), storage, lp.storage_nbytes(t.storage)

        return info, shown_metadata(self.metadata or {}), None

    def part(self, leaf: Any) -> Source:
        """The (single-file) Source whose file holds ``leaf``'s bytes."""
        return self.owner.get(id(leaf), self)

    def entry(self, leaf: Any, name: str) -> Bytes:
        """Leaf ``name`` as an entry: its bytes as safetensors (and a new torch storage) store them.

        Raises:
            NeedsTorch: a view that is not contiguous, compressed or big-endian bytes.
        """
        part = self.part(leaf)
        if isinstance(leaf, StRef):
            return Bytes(
                BY_SAFETENSORS[leaf.dtype].name,
                leaf.shape,
                leaf.length,
                self._copier(part, leaf.start, leaf.length, leaf.crc, leaf),
                crc=leaf.crc,
                ident=leaf,
            )
        t = lp.tensor_of(leaf)
        if t is None or part.zip is None:
            raise NeedsTorch(f"{name} is not a plain tensor")
        if part.zip.byteorder != "little":  # safetensors is little-endian: torch swaps the bytes on load
            raise NeedsTorch(f"{part.path} was saved big-endian")
        if not t.is_contiguous():
            raise NeedsTorch(f"tensor {name} is not contiguous")
        rec = part.zip.storage(t.storage.key)
        if rec.method != 0:
            raise NeedsTorch(f"storage of {name} is compressed")
        start, length = t.byte_range()
        if tensor_problem(t, rec.size) is not None:  # verify's rule: an empty tensor's offset is no bound
            raise CheckpointFormatError(f"{part.path}: tensor {name} reaches past the end of its storage record")
        storage = (id(part), t.storage.key)  # storage keys repeat across shards
        whole = start == 0 and length == rec.size  # the zip's CRC covers exactly these bytes
        copy = self._copier(part, rec.data_offset + start, length, rec.crc if whole else None, (part, rec))
        return Bytes(
            t.dtype,
            t.shape,
            length,
            copy,
            crc=rec.crc if whole else None,
            ident=(*storage, t.offset, t.shape, t.stride, t.dtype),
            storage=storage,
            storage_size=rec.size,
            complete=whole,
        )

    def records(self) -> tuple[dict[str, Entry], str, str] | None:
        """A torch zip's storage records by key, as entries that copy each record as it is, with
        the zip's record prefix and byte order; None for other formats."""
        if self.zip is None:
            return None
        z, out = self.zip, dict[str, Entry]()
        data = f"{z.prefix}data/"
        for rec in z.records:
            if not rec.name.startswith(data):
                continue
            key = rec.name[len(data) :]
            if rec.method == 0:
                out[key] = Bytes(
                    "uint8",
                    (rec.size,),
                    rec.size,
                    self._copier(self, rec.data_offset, rec.size, rec.crc, (self, rec)),
                    crc=rec.crc,
                )
            else:
                out[key] = Bytes(
                    "uint8",
                    (rec.size,),
                    rec.compressed_size,
                    self._inflated(rec),
                    crc=rec.crc,
                    zip=(rec.method, rec.size),
                )
        return out, z.prefix, z.byteorder

    def _copier(self, part: Source, offset: int, length: int, crc: int | None, key: Any) -> Any:
        def copy(f: BinaryIO, progress: Any) -> int:
            if (
                crc is None
                and isinstance(key, tuple)
                and (id(part), key[1].name) not in self._checked
                and part.zip is not None
            ):
                self._checked.add(
                    (id(part), key[1].name)
                )  # a view: the zip's CRC-32 is its whole storage's, checked once
                self.damage.check(key, key[1].crc, record_crc(part.zip, key[1]))
            assert part.file is not None  # a part is one open file
            if isinstance(key, tuple):
                self._read.add((id(part), key[1].name))
            read = copy_range(part.file, f, offset, length, progress, crc=True)
            if crc is not None:
                self.damage.check(key, crc, read)
            return read

        return copy

    def _inflated(self, rec: Record) -> Any:
        def copy(f: BinaryIO, progress: Any) -> None:
            assert self.zip is not None and self.file is not None
            self._read.add((id(self), rec.name))
            copy_range(self.file, f, rec.data_offset, rec.compressed_size, progress)
            self.damage.check((self, rec), rec.crc, record_crc(self.zip, rec))  # None: bytes that do not inflate

        return copy

    def unread(self) -> list[str]:
        """The zip storage records no copy read (``file:record`` in a sharded source)."""
        return [
            rec.name if part is self else f"{part.path.name}:{rec.name}"
            for part in self.parts or [self]
            if part.zip is not None
            for rec in part.zip.records
            if rec.name.startswith(f"{part.zip.prefix}data/") and (id(part), rec.name) not in self._read
        ]

    def _name(self, key: StRef | tuple[Source, Record]) -> str:
        """A mismatch named by where its tensors are (``fc1.weight``, and the shard of a sharded
        source), for a StRef or a zip Record."""
        if isinstance(key, StRef):
            part, text = (
                self.part(key),
                tensors_named([n for n, ref in self.obj.items() if ref is key]),
            )  # aliases share one StRef
        else:
            part, rec = key
            text = record_tensors(part.zip, part.obj, rec.name) if part.zip is not None else rec.name
        return text if part is self else f"{text} of shard {part.path.name}"

    def close(self) -> None:
        for p in self.parts:
            p.close()
        if self.file is not None:
            self.file.close()


def is_leaf(value: Any) -> bool:
    return lp.is_tensor(value) or isinstance(value, StRef)


def open_source(path: Path, fmt: str) -> Source:
    """Read a torch zip's pickle (through stand-ins), a safetensors header, or every shard's of a
    Hugging Face checkpoint (checked against its index); no tensor bytes."""
    if fmt == HF:
        return _open_shards(read_index(path))
    if fmt not in (ZIP, SAFETENSORS):
        raise NeedsTorch(f"{fmt} input")
    f = open_regular(path)  # owned by the Source, closed by its user
    try:
        return _read_source(path, fmt, f)
    except BaseException:
        f.close()
        raise


def _read_source(path: Path, fmt: str, f: BinaryIO) -> Source:
    if fmt == ZIP:
        z = TorchZip(path, file=f)
        data, name = z.read(f"{z.prefix}data.pkl"), ""
        try:
            pickled = lp.loads(data)
        except lp.UnsupportedGlobal as e:
            if (sharded := sharded_tensor_error(data, str(path))) is not None:
                raise sharded from None  # as verify's zip_checks says it
            try:  # a whole pickled module (torch.save(model)): its state_dict(), nothing run
                module = mp.read_module(data)  # or UnsafeModulePickle, for the caller to refuse
            except mp.NotAModule:
                raise e from None
            except mp.Unmodelled as why:
                raise NeedsTorch(f"pickled module: {why}") from None
            except CheckpointFormatError as why:
                raise CheckpointFormatError(f"{path}: pickled module: {why}") from None
            pickled, name = module.state, module.description
        check_tensors(pickled, z, str(path))  # storages are copied as they are: refuse broken views now
        return Source(path, fmt, pickled, f, zip=z, module=name)
    # SAFETENSORS (open_source admits no other format)
    header, start = read_header(f, source=str(path))
    meta = dict(header.pop("__metadata__", None) or {})
    crcs = parse_crcs(meta, str(path))
    obj: OrderedDict[str, Any] = OrderedDict(
        (
            name,
            StRef(
                e["dtype"],
                tuple(e["shape"]),
                start + e["data_offsets"][0],
                e["data_offsets"][1] - e["data_offsets"][0],
                crcs.get(name),
            ),
        )
        for name, e in header.items()
    )
    obj = insert_aliases(obj, parse_aliases(meta, obj, str(path)))
    return Source(path, fmt, obj, f, metadata=meta, data_start=start)


def _open_shards(index: HfIndex) -> Source:
    """One Source over every shard: tensors in the index's order, then the tied ones it dropped
    (each the same leaf as the tensor it is tied to)."""
    merged = Source(index.folder, HF, OrderedDict(), None, metadata=dict(index.metadata), index=index)
    try:
        for shard in index.shards:
            path = index.folder / shard
            part = open_source(path, shard_format(index.path, index.folder, shard))
            merged.parts.append(part)
            if not isinstance(part.obj, Mapping) or not all(is_leaf(v) for v in part.obj.values()):
                raise CheckpointFormatError(f"{path}: a shard of {index.path} must hold a flat mapping of tensors")
        check_shard_keys(index, {p.path.name: list(p.obj) for p in merged.parts})
        leaves = {k: (p, v) for p in merged.parts for k, v in p.obj.items()}
        for name in [*index.weight_map, *index.tied()]:
            part, leaf = leaves[index.tied().get(name, name)]
            merged.obj[name] = leaf
            merged.owner[id(leaf)] = part
    except BaseException:
        merged.close()
        raise
    return merged


def checkpoint_bytes(path: Path, fmt: str) -> int:
    """Bytes a checkpoint takes on disk: a file's size, a Hugging Face index's and its shards', or
    every file of a folder (DCP). What progress is measured against, and what inspect reports.

    Raises:
        CheckpointFormatError: a folder that cannot be listed.
    """
    if fmt == HF:
        return read_index(path).total_bytes()
    if path.is_file():
        return path.stat().st_size
    try:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read folder ({e})") from e
