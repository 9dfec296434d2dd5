"""Checkpoint rewriting without torch: names change, tensor bytes are copied as they are.

A source is opened as its containers with leaf references (:class:`TensorRef` for torch zip,
:class:`StRef` for safetensors) that know where their bytes lie. Writers for either output
format copy those byte ranges kernel-side. Anything this path does not model raises
:class:`NeedsTorch` (or :class:`UnsupportedGlobal`) before a byte is written, and the caller
falls back to torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ArgumentError, CheckpointFormatError, summarize
from . import torchpickle as lp
from .bounds import check_tensors
from .detect import SAFETENSORS, ZIP
from .dtypes import BY_NAME, BY_SAFETENSORS
from .fileio import Progress, copy_range, crc_of_range
from .safetensors import (
    ALIASES_KEY,
    CRC_KEY,
    crc_metadata,
    encode_header,
    insert_aliases,
    parse_aliases,
    parse_crcs,
    read_header,
    write_with_crcs,
)
from .torchzip import TorchZip, ZipWriter


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
    meanwhile (``os.replace`` by a running trainer) is still read as the version opened.
    """

    path: Path
    fmt: str
    obj: Any
    file: BinaryIO
    zip: TorchZip | None = None
    metadata: dict[str, str] | None = None
    data_start: int = 0

    def close(self) -> None:
        self.file.close()


def is_leaf(value: Any) -> bool:
    return lp.is_tensor(value) or isinstance(value, StRef)


def open_source(path: Path, fmt: str) -> Source:
    """Read a torch zip's pickle (through stand-ins) or a safetensors header; no tensor bytes."""
    if fmt not in (ZIP, SAFETENSORS):
        raise NeedsTorch(f"{fmt} input")
    f = open(path, "rb")  # noqa: SIM115 - owned by the Source, closed by its user
    try:
        return _read_source(path, fmt, f)
    except BaseException:
        f.close()
        raise


def _read_source(path: Path, fmt: str, f: BinaryIO) -> Source:
    if fmt == ZIP:
        z = TorchZip(path, file=f)
        pickled = lp.loads(z.read(f"{z.prefix}data.pkl"))
        check_tensors(pickled, z, str(path))  # storages are copied as they are: refuse broken views now
        return Source(path, fmt, pickled, f, zip=z)
    # SAFETENSORS (open_source admits no other format)
    header, start = read_header(f, source=str(path))
    meta = dict(header.pop("__metadata__", None) or {})
    crcs = parse_crcs(meta, str(path))
    obj: OrderedDict[str, Any] = OrderedDict(
        (name, StRef(e["dtype"], tuple(e["shape"]), start + e["data_offsets"][0],
                     e["data_offsets"][1] - e["data_offsets"][0], crcs.get(name)))  # fmt: skip
        for name, e in header.items()
    )
    obj = insert_aliases(obj, parse_aliases(meta, obj, str(path)))
    return Source(path, fmt, obj, f, metadata=meta, data_start=start)


def _locate(src: Source, ref: Any, name: str) -> tuple[str, tuple[int, ...], int, int, Any, int | None]:
    """``(safetensors dtype, shape, absolute offset, length, identity, known CRC-32)`` of a leaf's bytes."""
    if isinstance(ref, StRef):
        return ref.dtype, ref.shape, ref.start, ref.length, ref, ref.crc
    t = lp.tensor_of(ref)
    if t is None or src.zip is None:
        raise NeedsTorch(f"{name} is not a plain tensor")
    if src.zip.byteorder != "little":  # safetensors is little-endian: torch swaps the bytes on load
        raise NeedsTorch(f"{src.path} was saved big-endian")
    st = BY_NAME[t.dtype].safetensors if t.dtype in BY_NAME else None
    if st is None:
        raise ArgumentError(f"{src.path}: tensor {name} has dtype {t.dtype}, which safetensors cannot store; use a .pt output")
    if not t.is_contiguous():
        raise NeedsTorch(f"tensor {name} is not contiguous")
    rec = src.zip.storage(t.storage.key)
    if rec.method != 0:
        raise NeedsTorch(f"storage of {name} is compressed")
    start, length = t.byte_range()
    if start < 0 or start + length > rec.size:
        raise CheckpointFormatError(f"{src.path}: tensor {name} reaches past the end of its storage record")
    known = rec.crc if start == 0 and length == rec.size else None  # the zip's CRC covers exactly these bytes
    return st, t.shape, rec.data_offset + start, length, (t.storage.key, t.offset, t.shape, t.stride, t.dtype), known


def write_safetensors(f: BinaryIO, src: Source, state: Mapping[str, Any], progress: Progress | None) -> int:
    """Write ``state`` (leaves of ``src``) as safetensors; returns tensor bytes written."""
    bad = [f"{k} ({type(v).__name__})" for k, v in state.items() if not is_leaf(v)]
    if bad:
        raise ArgumentError(f"{src.path}: safetensors holds only tensors; not tensors: {summarize(bad)}")
    entries: list[Any] = []
    copies: list[tuple[str, int, int, int | None]] = []
    aliases: dict[str, list[Any]] = {}
    first: dict[Any, str] = {}
    position = {k: i for i, k in enumerate(state)}
    for name, ref in state.items():
        st, shape, offset, length, ident, known = _locate(src, ref, name)
        if ident in first and length:
            aliases[name] = [first[ident], position[name]]
            continue
        first[ident] = name
        entries.append((name, st, list(shape), length))
        copies.append((name, offset, length, known))
    meta = dict(src.metadata or {}) if src.fmt == SAFETENSORS else {"format": "pt"}
    meta.pop(ALIASES_KEY, None)
    meta.pop(CRC_KEY, None)
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases)
    fs = src.file

    def write_data(crcs: dict[str, int]) -> None:
        for name, offset, length, known in copies:
            crcs[name] = known if known is not None else crc_of_range(fs, offset, length)
            copy_range(fs, f, offset, length, progress)

    write_with_crcs(f, entries, meta, write_data)
    return sum(c[2] for c in copies)


def rename_safetensors(f: BinaryIO, src: Source, state: Mapping[str, Any], progress: Progress | None) -> int:
    """safetensors -> safetensors: a new header over the untouched data section."""
    header: dict[str, Any] = {}
    aliases: dict[str, list[Any]] = {}
    named: dict[int, str] = {}
    for i, (name, ref) in enumerate(state.items()):
        if id(ref) in named:
            aliases[name] = [named[id(ref)], i]
            continue
        named[id(ref)] = name
        begin = ref.start - src.data_start
        header[name] = {"dtype": ref.dtype, "shape": list(ref.shape), "data_offsets": [begin, begin + ref.length]}
    meta = {k: v for k, v in (src.metadata or {}).items() if k not in (ALIASES_KEY, CRC_KEY)}
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases)
    kept = [state[name] for name in header]
    if kept and all(r.crc is not None for r in kept):  # the bytes do not change: their CRCs carry over
        meta[CRC_KEY] = crc_metadata(header, {n: state[n].crc for n in header})
    out = {"__metadata__": meta, **header} if meta else header
    f.write(encode_header(out))
    size = os.fstat(src.file.fileno()).st_size - src.data_start
    copy_range(src.file, f, src.data_start, size, progress)
    return size


def write_torch_zip(f: BinaryIO, src: Source, obj: Any, progress: Progress | None) -> int:
    """Write ``obj`` (containers with leaves of ``src``) as a torch zip checkpoint."""
    if src.zip is not None:
        data, keys = lp.dumps(obj)
        used = set(keys)
        z = src.zip
        w = ZipWriter(f, alignment=z.alignment)
        total = 0
        for rec in z.records:
            if rec.name == f"{z.prefix}data.pkl":
                w.add_bytes(rec.name, data)
            elif rec.name.startswith(f"{z.prefix}data/") and rec.name[len(z.prefix) + 5 :] not in used:
                continue  # a storage only dropped entries used (e.g. the optimizer's, with weights_only)
            else:
                w.add_copy(rec.name, src.file, rec, progress)
                total += rec.compressed_size
        w.close()
        return total
    return _safetensors_to_zip(f, src, obj, progress)


def _safetensors_to_zip(f: BinaryIO, src: Source, obj: Any, progress: Progress | None) -> int:
    rebuild_v2 = lp.Global("torch._utils", "_rebuild_tensor_v2")
    rebuild_v3 = lp.Global("torch._utils", "_rebuild_tensor_v3")
    untyped = lp.Global("torch.storage", "UntypedStorage")
    made: dict[int, lp.TensorRef] = {}
    ranges: list[tuple[int, int, int | None]] = []

    def to_tensor(ref: StRef) -> lp.TensorRef:
        if id(ref) in made:
            return made[id(ref)]  # the same object again: pickled once, tied on load
        key, numel = str(len(ranges)), math.prod(ref.shape)
        stride = tuple(math.prod(ref.shape[i + 1 :]) for i in range(len(ref.shape)))
        hooks: OrderedDict[str, Any] = OrderedDict()
        dtype = BY_SAFETENSORS[ref.dtype]
        if dtype.storage is not None:
            storage = lp.StorageRef(("storage", lp.Global("torch", dtype.storage), key, "cpu", numel))
            t = lp.TensorRef(rebuild_v2, (storage, 0, ref.shape, stride, False, hooks))
        else:
            storage = lp.StorageRef(("storage", untyped, key, "cpu", ref.length))
            t = lp.TensorRef(rebuild_v3, (storage, 0, ref.shape, stride, False, hooks, lp.Global("torch", dtype.name)))
        ranges.append((ref.start, ref.length, ref.crc))
        made[id(ref)] = t
        return t

    if not isinstance(obj, Mapping):
        raise NeedsTorch("safetensors source is not a mapping")
    converted = OrderedDict((k, to_tensor(v)) for k, v in obj.items())
    data, _ = lp.dumps(converted)
    w = ZipWriter(f, alignment=64)
    prefix = "archive/"
    for name, payload in ((f"{prefix}data.pkl", data), (f"{prefix}.format_version", b"1"),
                          (f"{prefix}.storage_alignment", b"64"), (f"{prefix}byteorder", b"little")):  # fmt: skip
        w.add_bytes(name, payload)
    digest = hashlib.sha1(data)
    for i, (offset, length, known) in enumerate(ranges):
        # Zip records carry a CRC-32: the recorded one if the source has it, else one read.
        crc = known if known is not None else crc_of_range(src.file, offset, length)
        digest.update(crc.to_bytes(4, "little"))
        w.add_range(f"{prefix}data/{i}", src.file, offset, length, crc, progress)
    w.add_bytes(f"{prefix}version", b"3\n")
    w.add_bytes(f"{prefix}.data/serialization_id", str(int.from_bytes(digest.digest()[:16], "big")).zfill(40).encode())
    w.close()
    return sum(r[1] for r in ranges)
