"""Checkpoint rewriting without torch: names change, tensor bytes are copied as they are.

A source is opened (:mod:`.source`) as its containers with leaf references (:class:`TensorRef`
for torch zip, :class:`StRef` for safetensors) that know where their bytes lie, in one file or,
for Hugging Face shards, in each leaf's own. Writers for either output
format copy those byte ranges kernel-side, checking each against the CRC-32 the source records
for it (zip records; ckptkit's ``ckptkit.crc32`` in safetensors) as it is copied: a damaged
source fails, naming its damaged tensors, instead of becoming a second damaged file. Anything
this path does not model raises :class:`NeedsTorch` (or :class:`UnsupportedGlobal`) before a
byte is written, and the caller falls back to torch.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import ArgumentError, CheckpointFormatError, summarize
from ..io.fileio import Progress, copy_range, crc_of_range
from ..io.pages import page_residue
from . import torchpickle as lp
from .detect import SAFETENSORS
from .dtypes import BY_NAME, BY_SAFETENSORS
from .integrity import Damage, record_crc, record_tensors, tensors_named
from .safetensors import ALIASES_KEY, CRC_KEY, write_with_crcs
from .source import NeedsTorch, Source, StRef, is_leaf, open_source
from .torchdump import dumps
from .torchzip import Record
from .zipwrite import ZipWriter

__all__ = ["NeedsTorch", "Source", "StRef", "is_leaf", "locate", "new_tensor", "open_source",
           "write_safetensors", "write_torch_zip"]  # fmt: skip

_GLOBALS: dict[tuple[str, str], lp.Global] = {}


def _global(module: str, name: str) -> lp.Global:
    """One stand-in a name, so a pickle written from new tensors memoizes each global once."""
    return _GLOBALS.setdefault((module, name), lp.Global(module, name))


def new_tensor(key: str, dtype: str, shape: tuple[int, ...]) -> lp.TensorRef:
    """A contiguous CPU tensor over all of storage ``key``, as ``torch.save`` pickles one.

    Example:
        >>> t = new_tensor("0", "bfloat16", (2, 3))
        >>> t.dtype, t.stride, t.storage.numel
        ('bfloat16', (3, 1), 6)
    """
    d = BY_NAME[dtype]
    numel = math.prod(shape)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    hooks: OrderedDict[str, Any] = OrderedDict()
    if d.storage is not None:
        storage = lp.StorageRef(("storage", _global("torch", d.storage), key, "cpu", numel))
        return lp.TensorRef(_global("torch._utils", "_rebuild_tensor_v2"), (storage, 0, shape, stride, False, hooks))
    storage = lp.StorageRef(("storage", _global("torch.storage", "UntypedStorage"), key, "cpu", numel * d.itemsize))
    return lp.TensorRef(_global("torch._utils", "_rebuild_tensor_v3"), (storage, 0, shape, stride, False, hooks, _global("torch", d.name)))


@dataclass
class _Bytes:
    """Where a leaf's bytes are: in ``part``'s file (the source's own, or one shard's); ``crc``: the
    CRC-32 recorded for exactly them; ``key``: what a mismatch names (the StRef, or the zip record,
    CRC'd whole where the bytes are a view's); ``storage``, ``storage_size``: the storage they
    view (what huggingface_hub's split groups and counts), ``complete``: they are all of it."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    ident: Any
    crc: int | None
    key: StRef | tuple[Source, Record]
    part: Source
    storage: Any
    storage_size: int
    complete: bool


def locate(src: Source, ref: Any, name: str) -> _Bytes:
    """Where the bytes of leaf ``name`` are, as safetensors would store them."""
    part = src.part(ref)
    if isinstance(ref, StRef):
        return _Bytes(ref.dtype, ref.shape, ref.start, ref.length, ref, ref.crc, ref, part, ref, ref.length, True)
    t = lp.tensor_of(ref)
    if t is None or part.zip is None:
        raise NeedsTorch(f"{name} is not a plain tensor")
    if part.zip.byteorder != "little":  # safetensors is little-endian: torch swaps the bytes on load
        raise NeedsTorch(f"{part.path} was saved big-endian")
    st = BY_NAME[t.dtype].safetensors if t.dtype in BY_NAME else None
    if st is None:
        raise ArgumentError(f"{part.path}: tensor {name} has dtype {t.dtype}, which safetensors cannot store; use a .pt output")
    if not t.is_contiguous():
        raise NeedsTorch(f"tensor {name} is not contiguous")
    rec = part.zip.storage(t.storage.key)
    if rec.method != 0:
        raise NeedsTorch(f"storage of {name} is compressed")
    start, length = t.byte_range()
    if start < 0 or start + length > rec.size:
        raise CheckpointFormatError(f"{part.path}: tensor {name} reaches past the end of its storage record")
    storage = (id(part), t.storage.key)  # storage keys repeat across shards
    ident = (*storage, t.offset, t.shape, t.stride, t.dtype)
    if start == 0 and length == rec.size:  # the zip's CRC covers exactly these bytes
        return _Bytes(st, t.shape, rec.data_offset, length, ident, rec.crc, (part, rec), part, storage, rec.size, True)
    return _Bytes(st, t.shape, rec.data_offset + start, length, ident, None, (part, rec), part, storage, rec.size, False)


def _damage(src: Source) -> Damage:
    """Mismatches named by where their tensors are in the source (``fc1.weight``, and the shard for
    a sharded one), for a StRef or a zip Record; raised once the copy is done (the atomic
    writer's temp file goes with the error)."""

    def name(key: StRef | tuple[Source, Record]) -> str:
        if isinstance(key, StRef):
            part, text = src.part(key), tensors_named([n for n, ref in src.obj.items() if ref is key])  # aliases share one StRef
        else:
            part, rec = key
            text = record_tensors(part.zip, part.obj, rec.name) if part.zip is not None else rec.name
        return text if part is src else f"{text} of shard {part.path.name}"

    return Damage(str(src.path), name)


def write_safetensors(
    f: BinaryIO, src: Source, state: Mapping[str, Any], progress: Progress | None, *, metadata: dict[str, str] | None = None
) -> int:
    """Write ``state`` (leaves of ``src``) as safetensors; returns tensor bytes written.

    ``metadata``: the header's (default: a safetensors source's own, else ``{"format": "pt"}``).
    """
    bad = [f"{k} ({type(v).__name__})" for k, v in state.items() if not is_leaf(v)]
    if bad:
        raise ArgumentError(f"{src.path}: safetensors holds only tensors; not tensors: {summarize(bad)}")
    entries: list[Any] = []
    copies: list[tuple[str, _Bytes]] = []
    aliases: dict[str, list[Any]] = {}
    first: dict[Any, str] = {}
    position = {k: i for i, k in enumerate(state)}
    for name, ref in state.items():
        b = locate(src, ref, name)
        if b.ident in first and b.length:
            aliases[name] = [first[b.ident], position[name]]
            continue
        first[b.ident] = name
        entries.append((name, b.dtype, list(b.shape), b.length))
        copies.append((name, b))
    meta = dict(metadata if metadata is not None else src.metadata or {} if src.fmt == SAFETENSORS else {"format": "pt"})
    meta.pop(ALIASES_KEY, None)
    meta.pop(CRC_KEY, None)
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases)
    damage = _damage(src)

    def write_data(crcs: dict[str, int]) -> None:
        whole: set[Any] = set()
        for name, b in copies:
            if isinstance(b.key, tuple) and b.crc is None and b.storage not in whole and b.part.zip is not None:
                whole.add(b.storage)  # a view: the zip's CRC-32 is its whole storage's, checked once
                damage.check(b.key, b.key[1].crc, record_crc(b.part.zip, b.key[1]))
            assert b.part.file is not None  # a part is one open file
            crcs[name] = copy_range(b.part.file, f, b.offset, b.length, progress, crc=True)
            if b.crc is not None:
                damage.check(b.key, b.crc, crcs[name])
        damage.raise_if_any()

    known = {name: b.crc for name, b in copies if b.crc is not None}
    spans: list[tuple[int, int, int]] = []  # (offset in the data section, in the source, length)
    for _, b in copies:
        spans.append((spans[-1][0] + spans[-1][2] if spans else 0, b.offset, b.length))
    write_with_crcs(f, entries, meta, write_data, known=known, data_at=page_residue(spans))
    return sum(b.length for _, b in copies)


def write_torch_zip(f: BinaryIO, src: Source, obj: Any, progress: Progress | None) -> int:
    """Write ``obj`` (containers with leaves of ``src``) as a torch zip checkpoint."""
    if src.zip is not None and src.file is not None:
        data, keys = dumps(obj)
        used = set(keys)
        z = src.zip
        w = ZipWriter(f, alignment=z.alignment)
        damage = _damage(src)
        total = 0
        for rec in z.records:
            if rec.name == f"{z.prefix}data.pkl":
                w.add_bytes(rec.name, data)
            elif rec.name.startswith(f"{z.prefix}data/") and rec.name[len(z.prefix) + 5 :] not in used:
                continue  # a storage only dropped entries used (e.g. the optimizer's, with weights_only)
            else:
                read = w.add_copy(rec.name, src.file, rec, progress)
                damage.check((src, rec), rec.crc, read if read is not None else record_crc(z, rec))  # None: compressed
                total += rec.compressed_size
        damage.raise_if_any()
        w.close()
        return total
    return _safetensors_to_zip(f, src, obj, progress)


def _safetensors_to_zip(f: BinaryIO, src: Source, obj: Any, progress: Progress | None) -> int:
    made: dict[int, lp.TensorRef] = {}
    ranges: list[StRef] = []

    def to_tensor(ref: StRef) -> lp.TensorRef:
        if id(ref) in made:
            return made[id(ref)]  # the same object again: pickled once, tied on load
        made[id(ref)] = new_tensor(str(len(ranges)), BY_SAFETENSORS[ref.dtype].name, ref.shape)
        ranges.append(ref)
        return made[id(ref)]

    if not isinstance(obj, Mapping):
        raise NeedsTorch("safetensors source is not a mapping")
    if any(p.fmt != SAFETENSORS for p in src.parts):
        raise NeedsTorch("torch zip shards into one torch zip")
    converted = OrderedDict((k, to_tensor(v)) for k, v in obj.items())
    w = ZipWriter(f, alignment=64)
    prefix = w.start_torch_archive(dumps(converted)[0])
    damage = _damage(src)
    for i, ref in enumerate(ranges):
        # A zip record's CRC-32 precedes its bytes: the recorded one if the source has it, else
        # one read first; either way the bytes are CRC'd again as copied, and must agree.
        file = src.part(ref).file
        assert file is not None  # a part is one open file
        crc = ref.crc if ref.crc is not None else crc_of_range(file, ref.start, ref.length)
        damage.check(ref, crc, w.add_range(f"{prefix}data/{i}", file, ref.start, ref.length, crc, progress))
    damage.raise_if_any()
    w.finish_torch_archive(prefix)
    w.close()
    return sum(r.length for r in ranges)
