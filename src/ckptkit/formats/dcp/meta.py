"""A torch.distributed.checkpoint (DCP) folder's ``.metadata``, read without torch or running it.

torch pickles a ``Metadata`` dataclass: ``state_dict_metadata`` (each key's
``TensorStorageMetadata``, with dtype, full size and chunks, or ``BytesStorageMetadata``),
``storage_data`` (``MetadataIndex(fqn, offset)`` -> ``_StorageInfo(relative_path, offset,
length, transform_descriptors)``: where each chunk's bytes lie in the ``.distcp`` files) and
``planner_data`` (each flattened key's path in the nested state dict). Unpickled here with the
pure-Python unpickler and inert stand-ins for DCP's own classes (:func:`ckptkit.formats.dcp.is_dcp_class`), it
becomes the plain records below. A global outside those classes raises
:class:`~ckptkit.formats.pickles.reader.UnsupportedGlobal`; a structure this reader does not model raises
:class:`~..source.NeedsTorch`: torch's reader then decides (and applies ckptkit's safety rules).
Two rules on those records live here too: where a key goes in the nested state dict
(:func:`set_element`, as torch's reader places it) and how a tensor's chunks tile it, along any
dims (:func:`chunks_in_order`).

Example:
    >>> meta = read_metadata("fixtures/fsdp2_dcp")  # doctest: +SKIP
    >>> meta.entries["embed.weight"].chunks[1].offsets  # doctest: +SKIP
    (19, 0)
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import PARSE_ERRORS, CheckpointFormatError
from ..dtypes import BY_NAME
from ..pickles import reader as lp
from ..source import NeedsTorch
from . import is_dcp_class
from .detect import DCP_METADATA

_META = "torch.distributed.checkpoint.metadata."


@dataclass(frozen=True)
class Stored:
    """Where one item's bytes are: ``length`` bytes at ``offset`` of ``file`` (a ``.distcp`` name)."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a tensor: its position and size in the full tensor, and its bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stored: Stored


@dataclass(frozen=True)
class TensorEntry:
    """A tensor key: torch dtype name (``"float32"``), full shape, chunks in metadata order."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class BytesEntry:
    """A non-tensor key: a ``torch.save`` d object at ``stored``."""

    fqn: str
    stored: Stored


@dataclass(frozen=True)
class DcpMetadata:
    """``entries`` in the metadata's order; ``paths``: each key's path in the nested state dict."""

    entries: dict[str, TensorEntry | BytesEntry]
    paths: dict[str, tuple[str | int, ...]]


class _Stand:
    """An inert instance of one of DCP's classes: constructor arguments and pickled state."""

    global_name = ""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str, *, optional: bool = False) -> Any:
        state = getattr(self, "state", None)
        if isinstance(state, dict) and optional:
            return state.get(name)  # pickled only when set (a bytes item's index has no offset)
        if not isinstance(state, dict) or name not in state:
            raise NeedsTorch(f".metadata's {self.global_name} has no field {name!r} this reader knows")
        return state[name]


class _Unpickler(lp._Unpickler):  # the torch pickle reader's guards (no protocol-5 buffers), other globals
    def __init__(self, file: Any, on_storage: Any = None) -> None:
        super().__init__(file, on_storage)
        self._classes: dict[str, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if not is_dcp_class(full):
            raise lp.UnsupportedGlobal(full)
        if module == "torch" and name in BY_NAME:
            return full  # a dtype: pickled as the global itself, never called
        if full == "torch.Size":
            return tuple
        if full in ("collections.OrderedDict", "builtins.set", "builtins.frozenset"):
            return super().find_class(module, name)
        if full not in self._classes:
            self._classes[full] = type(name, (_Stand,), {"global_name": full})
        return self._classes[full]

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(f"unexpected persistent id {pid!r:.80} in .metadata")


def read_metadata(folder: str | os.PathLike[str]) -> DcpMetadata:
    """Read ``folder/.metadata`` into :class:`DcpMetadata`.

    Raises:
        UnsupportedGlobal: it names a global beyond DCP's own classes (nothing was run).
        NeedsTorch: it holds something this reader does not model (torch's reader may).
        CheckpointFormatError: it is not a well-formed pickle.
    """
    with open(Path(folder) / DCP_METADATA, "rb") as f:
        meta = lp.loads(f.read(), unpickler=_Unpickler)  # its size on disk: read whole, as torch's reader does
    try:
        return _interpret(meta)
    except CheckpointFormatError as e:  # what no reader may accept (torch's would allocate for it)
        raise CheckpointFormatError(f"{folder}/{e}") from None
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as e:  # DCP's classes, in a shape not modelled
        raise NeedsTorch(f".metadata is laid out in a way this reader does not model ({type(e).__name__}: {e})") from e


def _interpret(meta: Any) -> DcpMetadata:
    if not isinstance(meta, _Stand) or meta.global_name != _META + "Metadata":
        raise NeedsTorch(f".metadata holds a {type(meta).__name__}, not DCP's Metadata")
    stored: dict[tuple[str, tuple[int, ...]], Stored] = {}
    for index, info in _mapping(meta.field("storage_data"), "storage_data").items():
        if getattr(info, "global_name", "") != "torch.distributed.checkpoint.filesystem._StorageInfo":
            raise NeedsTorch("storage_data is not FileSystemWriter's (another storage writer)")
        if info.state.get("transform_descriptors"):
            raise NeedsTorch(f"{index.field('fqn')} is stored through transforms {info.state['transform_descriptors']}")
        fqn, at, length = _str(index.field("fqn")), info.field("offset"), info.field("length")
        if isinstance(at, int) and isinstance(length, int) and (at < 0 or length <= 0):  # torch's reader fails on these
            raise CheckpointFormatError(f".metadata stores {fqn} at offset {at}, length {length}: damaged")
        where = Stored(_str(info.field("relative_path")), _int(at), _int(length))
        stored[(fqn, _ints(index.field("offset", optional=True) or ()))] = where
    entries: dict[str, TensorEntry | BytesEntry] = {}
    for fqn, md in _mapping(meta.field("state_dict_metadata"), "state_dict_metadata").items():
        entries[_str(fqn)] = _entry(_str(fqn), md, stored)
    planner = _mapping(meta.field("planner_data") or {}, "planner_data")
    paths = {_str(k): tuple(_path(v, len(planner))) for k, v in planner.items()}
    return DcpMetadata(entries, paths)


def _entry(fqn: str, md: Any, stored: dict[tuple[str, tuple[int, ...]], Stored]) -> TensorEntry | BytesEntry:
    kind = getattr(md, "global_name", "")
    if kind == _META + "BytesStorageMetadata":
        return BytesEntry(fqn, _find(stored, fqn, ()))
    if kind != _META + "TensorStorageMetadata":
        raise NeedsTorch(f"{fqn} is a {kind or type(md).__name__}, which this reader does not model")
    props = md.field("properties")
    state = getattr(props, "state", None)  # (dtype, layout, requires_grad, memory format, pin_memory)
    if not isinstance(state, tuple) or not state or not isinstance(state[0], str):
        raise NeedsTorch(f"{fqn}: tensor properties this reader does not model")
    dtype = state[0].removeprefix("torch.")
    layout = state[1] if len(state) > 1 else None
    if getattr(layout, "args", ("torch.strided",)) != ("torch.strided",):
        raise NeedsTorch(f"{fqn} is not a strided (dense) tensor")
    chunks = []
    for c in md.field("chunks"):
        offsets, sizes = _ints(c.field("offsets")), _ints(c.field("sizes"))
        chunks.append(Chunk(offsets, sizes, _find(stored, fqn, offsets)))
    return TensorEntry(fqn, dtype, _ints(md.field("size")), tuple(chunks))


def _find(stored: dict[tuple[str, tuple[int, ...]], Stored], fqn: str, offsets: tuple[int, ...]) -> Stored:
    where = stored.get((fqn, offsets))
    if where is None:
        raise CheckpointFormatError(
            f".metadata lists {fqn} (chunk at {list(offsets)}) but not where its bytes are stored"
        )
    return where


def _mapping(value: Any, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise NeedsTorch(f".metadata's {what} is a {type(value).__name__}, not a dict")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise NeedsTorch(f".metadata holds a {type(value).__name__} where a name belongs")
    return value


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise NeedsTorch(f".metadata holds {value!r:.40} where a byte count belongs")
    return value


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise NeedsTorch(f".metadata holds a {type(value).__name__} where a size belongs")
    return tuple(_int(v) for v in value)


def _path(value: Any, entries: int) -> list[str | int]:
    """A key path; a list index in it can only count the folder's own entries (a larger one would
    make the reader allocate a list that long: 10**14 from a 60-byte field)."""
    if not isinstance(value, (tuple, list)) or not value or not all(isinstance(p, (str, int)) for p in value):
        raise NeedsTorch(f".metadata's planner_data holds {value!r:.60}, not a key path")
    bad = [p for p in value if isinstance(p, int) and not 0 <= p < entries]
    if bad:
        raise CheckpointFormatError(
            f".metadata's planner_data path {list(value)!r:.80} has list index {bad[0]}, "
            f"beyond the folder's {entries} entries"
        )
    return list(value)


def set_element(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """torch's ``_traverse.set_element``: nested dicts (lists where a key is an int), so that this
    path and torch's own reader give the same structure, in the same order."""
    node: Any = root
    for prev, key in zip(path, path[1:], strict=False):
        if isinstance(node, dict):
            node = node.setdefault(prev, {} if isinstance(key, str) else [])
        else:
            node.extend([None] * (int(prev) + 1 - len(node)))
            if node[prev] is None:
                node[prev] = {} if isinstance(key, str) else []
            node = node[prev]
    if isinstance(path[-1], int):
        node.extend([None] * (path[-1] + 1 - len(node)))
    try:
        node[path[-1]] = value
    except PARSE_ERRORS as e:
        raise NeedsTorch(f"planner_data path {list(path)} does not nest") from e


def chunks_in_order(folder: Path, e: TensorEntry, *, unit: int = 1) -> tuple[list[Chunk], array[int] | None]:
    """The chunks with bytes, and how they tile the tensor.

    Split along dim 0 only (FSDP's rows), the chunks in offset order are the tensor's bytes one
    after another: runs is None. Split along other dims too (tensor parallelism's columns, a 2-D
    mesh), each chunk is a box whose rows interleave with its neighbours': runs lists, in the
    tensor's row-major order, each stretch that is contiguous in both, as ``(chunk index, start
    in the chunk, length)`` triples, flat (one array: a large tensor has many), counted in elements
    of ``unit`` bytes (the dtype's size: bytes; 1: elements).

    Raises:
        CheckpointFormatError: a chunk outside the tensor, or chunks that overlap or leave a gap.
    """
    rank = len(e.shape)
    for c in e.chunks:
        if len(c.offsets) != rank or len(c.sizes) != rank:
            raise CheckpointFormatError(
                f"{folder}: a chunk of tensor {e.fqn} has {len(c.sizes)} dims, the tensor {rank}"
            )
        if any(o + n > d for o, n, d in zip(c.offsets, c.sizes, e.shape, strict=True)):
            raise CheckpointFormatError(
                f"{folder}: tensor {e.fqn} is {list(e.shape)} but has a chunk of {list(c.sizes)} at {list(c.offsets)}"
            )
    if rank == 0:
        if len(e.chunks) != 1:
            raise CheckpointFormatError(f"{folder}: scalar tensor {e.fqn} has {len(e.chunks)} chunks, expected 1")
        return list(e.chunks), None
    chunks = sorted((c for c in e.chunks if 0 not in c.sizes), key=lambda c: c.offsets)  # chunks with bytes
    if any(c.offsets[d] != 0 or c.sizes[d] != e.shape[d] for c in chunks for d in range(1, rank)):
        return chunks, _runs(folder, e, chunks, unit)
    at = 0
    for c in chunks:
        if c.offsets[0] != at:
            what = (
                f"overlap at row {c.offsets[0]}"
                if c.offsets[0] < at
                else f"leave rows {at}..{c.offsets[0] - 1} uncovered"
            )
            raise CheckpointFormatError(
                f"{folder}: the chunks of tensor {e.fqn} (dim 0 of {e.shape[0]}) {what}; "
                "each row must be in exactly one chunk"
            )
        at += c.sizes[0]
    if at != e.shape[0] and 0 not in e.shape:
        raise CheckpointFormatError(
            f"{folder}: the chunks of tensor {e.fqn} cover rows 0..{at - 1} of {e.shape[0]}; each row must be in exactly one chunk"
        )
    return chunks, None


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return strides[::-1]


def _runs(folder: Path, e: TensorEntry, chunks: list[Chunk], unit: int) -> array[int]:
    """The stretches of :func:`chunks_in_order`, checked to cover the tensor once."""
    rank, strides = len(e.shape), _strides(e.shape)
    lengths, each = [], []
    for i, c in enumerate(chunks):
        full = rank  # the dims from ``full`` on are the tensor's whole: a stretch spans them
        while full > 0 and c.offsets[full - 1] == 0 and c.sizes[full - 1] == e.shape[full - 1]:
            full -= 1
        inner = max(full - 1, 0)  # the dim a stretch runs along (part of it); 0 for a chunk that is the whole tensor
        lengths.append(c.sizes[inner] * strides[inner] if full else math.prod(e.shape))
        chunk_strides = _strides(c.sizes)
        # where each stretch starts in the tensor and in the chunk: sums over the dims above ``inner``,
        # in increasing order (itertools.product is lexicographic), so the chunks' lists merge
        outside = [[(c.offsets[d] + k) * strides[d] for k in range(c.sizes[d])] for d in range(inner)]
        within = [[k * chunk_strides[d] for k in range(c.sizes[d])] for d in range(inner)]
        base = c.offsets[inner] * strides[inner] if full else 0
        each.append(
            zip(
                map(base.__add__, map(sum, itertools.product(*outside))),  # base bound now, not when merged
                itertools.repeat(i),
                map(sum, itertools.product(*within)),
                strict=False,
            )
        )
    runs, at = array("q"), 0
    for start, i, begin in heapq.merge(*each):
        if start != at:
            what = f"overlap at element {start}" if start < at else f"leave elements {at}..{start - 1} uncovered"
            raise CheckpointFormatError(
                f"{folder}: the chunks of tensor {e.fqn} ({list(e.shape)}) {what}; each element must be in exactly one chunk"
            )
        runs.extend((i, begin * unit, lengths[i] * unit))
        at += lengths[i]
    if at != math.prod(e.shape):
        raise CheckpointFormatError(
            f"{folder}: the chunks of tensor {e.fqn} cover {at} of its {math.prod(e.shape)} elements; "
            "each element must be in exactly one chunk"
        )
    return runs
