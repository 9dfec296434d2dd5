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

What torch's reader asks of ``.metadata``, this asks too, so that ``verify`` passes what
``read_checkpoint`` reads: the stand-ins refuse what DCP's classes refuse as ``pickle.load``
builds them (a ``BUILD`` state that is not a dict, properties that are not five values, a
memory-format code that is none, a ``torch.Size`` of non-ints); each chunk (and each value) must
have its bytes in ``storage_data`` under the index torch looks it up by; no size or offset is
negative; and each key must come back as itself from its place in the nested state dict
(:func:`~.keys.key_paths`). Those raise CheckpointFormatError: torch's reader fails on them too, or
(a renamed key that still happens to load) the file is damaged, and ckptkit refuses rather than
guess. Two more rules on the records live here: where a key goes in the nested state dict
(:func:`set_element`, as torch's reader places it) and how a tensor's chunks tile it, along any
dims (:func:`chunks_in_order`).

Example:
    >>> meta = read_metadata("fixtures/fsdp2_dcp")  # doctest: +SKIP
    >>> meta.entries["embed.weight"].chunks[1].offsets  # doctest: +SKIP
    (19, 0)
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ...errors import PARSE_ERRORS, CheckpointFormatError
from ...io.fileio import open_regular
from ..dtypes import BY_NAME
from ..pickles import reader as lp
from ..source import NeedsTorch
from . import DAMAGED, is_dcp_class
from .detect import DCP_METADATA
from .keys import key_paths

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
    saved: tuple[int, ...] | None = None  # its shape as saved, where a view drops a leading 1 (a layer)


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


_MEM_FORMATS = frozenset({0, 1, 2})  # _MEM_FORMAT_ENCODING's values: contiguous, channels-last, preserve


class _Global(str):
    """A global torch pickles by name and never calls (a dtype, ``torch.strided``): its name.
    Without slots, a ``BUILD`` could give it fields, which the real object refuses."""

    __slots__ = ()


class _Stand:
    """An inert instance of one of DCP's dataclasses: constructor arguments and pickled state."""

    global_name = ""
    __hash__ = None  # type: ignore[assignment]  # a dataclass that is not frozen: no dict key, no set item

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        # pickle's BUILD of a class without __setstate__, as torch's reader (the C unpickler) does it:
        # a dict of fields, or (a dict or None, a dict of slot fields); it fails on anything else
        slots: Any = {}
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        if not isinstance(slots, dict) or not isinstance(state, (dict, type(None))):
            found = slots if not isinstance(slots, dict) else state
            raise CheckpointFormatError(
                f".metadata builds a {self.global_name} from a {type(found).__name__}; "
                f"torch's reader needs a dict of its fields: {DAMAGED}"
            )
        fields = self.__dict__.setdefault("state", {})
        fields.update(state or {})
        fields.update(slots)

    def field(self, name: str, *, optional: bool = False) -> Any:
        state = getattr(self, "state", None)
        if isinstance(state, dict) and optional:
            return state.get(name)  # pickled only when set (a bytes item's index has no offset)
        if not isinstance(state, dict) or name not in state:
            raise NeedsTorch(f".metadata's {self.global_name} has no field {name!r} this reader knows")
        return state[name]


class _Index(_Stand):
    """``MetadataIndex``, a frozen dataclass: hashed and compared by its fqn and offset (the keys
    of ``storage_data``, which torch's reader looks each read up by)."""

    def _key(self) -> tuple[Any, Any]:
        state = getattr(self, "state", None)
        if not isinstance(state, dict) or "fqn" not in state:  # the dataclass's hash reads its fields
            raise CheckpointFormatError(f".metadata uses a MetadataIndex without its fqn as a key: {DAMAGED}")
        return state["fqn"], state.get("offset")

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key() == other._key()  # type: ignore[attr-defined]


class _Properties(_Stand):
    """``TensorProperties``, whose own ``__setstate__`` unpacks five values (dtype, layout,
    requires_grad, memory-format code, pin_memory) and fails unless the fourth is a code; later
    torch releases pickle more after those five, so more is no damage."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, (tuple, list)):
            raise NeedsTorch(f".metadata's TensorProperties hold a {type(state).__name__}")  # any iterable unpacks
        if len(state) < 5:
            raise CheckpointFormatError(
                f".metadata's TensorProperties hold {len(state)} values; torch's reader unpacks 5: {DAMAGED}"
            )
        if not isinstance(state[3], _MemFormat):
            raise CheckpointFormatError(
                f".metadata's TensorProperties hold {state[3]!r:.40} where torch's reader expects a "
                f"_MEM_FORMAT_ENCODING: {DAMAGED}"
            )
        self.state = tuple(state)


class _MemFormat(_Stand):
    """``_MEM_FORMAT_ENCODING``, an Enum: called (or created) with one of its values, or it fails."""

    def __new__(cls, *args: Any) -> _MemFormat:
        try:
            known = len(args) == 1 and args[0] in _MEM_FORMATS  # an Enum finds its member by hash and ==
        except TypeError:  # unhashable: no member's value
            known = False
        if not known:
            raise CheckpointFormatError(
                f".metadata holds memory-format code {args!r:.40}; torch's reader knows 0, 1 and 2: {DAMAGED}"
            )
        return super().__new__(cls)

    __hash__ = object.__hash__  # type: ignore[assignment]  # an Enum member's


class _Path(_Stand):
    """A pathlib class (``StorageMeta.checkpoint_id``): built from str parts or paths, as pathlib is."""

    def __new__(cls, *args: Any) -> _Path:
        if not all(type(a) is str or isinstance(a, _Path) for a in args):
            raise CheckpointFormatError(
                f".metadata builds a {cls.global_name} from {args!r:.60}; pathlib needs str parts: {DAMAGED}"
            )
        concrete = cls.global_name.rpartition(".")[2]
        if concrete in ("PosixPath", "WindowsPath") and concrete != ("WindowsPath" if os.name == "nt" else "PosixPath"):
            raise NeedsTorch(f".metadata holds a {concrete}, which Python cannot create on this system")
        return super().__new__(cls)

    __hash__ = object.__hash__  # type: ignore[assignment]  # a path's

    def __setstate__(self, state: Any) -> None:
        if state is not None:
            raise NeedsTorch(f".metadata gives a {self.global_name} fields")  # pathlib's slots: torch decides


def _size(*args: Any) -> tuple[int, ...]:
    """``torch.Size``: nothing, or one sequence of ints (a bool counts as one) that fit in 64 bits."""
    if not args:
        return ()
    if len(args) == 1 and not isinstance(args[0], (tuple, list)):
        raise NeedsTorch(f".metadata builds a torch.Size from a {type(args[0]).__name__}")  # any iterable
    if len(args) > 1 or not all(type(v) in (int, bool) and -(1 << 63) <= v < 1 << 63 for v in args[0]):
        raise CheckpointFormatError(
            f".metadata builds a torch.Size from {args!r:.60}; torch's reader needs one sequence of 64-bit ints: {DAMAGED}"
        )
    return tuple(int(v) for v in args[0])


_SPECIAL: dict[str, type[_Stand]] = {
    _META + "MetadataIndex": _Index,
    _META + "TensorProperties": _Properties,
    _META + "_MEM_FORMAT_ENCODING": _MemFormat,
    **{f"pathlib.{c}": _Path for c in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")},
}


class _Unpickler(lp._Unpickler):  # the torch pickle reader's guards (no protocol-5 buffers), other globals
    # All of pickle's opcodes: torch's reader loads .metadata with plain pickle.load (protocol 4:
    # FRAME, MEMOIZE, STACK_GLOBAL), not with its weights-only unpickler.
    def __init__(self, file: Any, on_storage: Any = None) -> None:
        super().__init__(file, on_storage)
        self._classes: dict[str, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if not is_dcp_class(full):
            raise lp.UnsupportedGlobal(full)
        if module == "torch" and (name in BY_NAME or full in ("torch.strided", "torch.contiguous_format")):
            return _Global(full)  # pickled as the global itself, never called
        if full == "torch.Size":
            return _size
        if full in ("collections.OrderedDict", "builtins.set", "builtins.frozenset"):
            return super().find_class(module, name)
        if full not in self._classes:
            self._classes[full] = type(name, (_SPECIAL.get(full, _Stand),), {"global_name": full})
        return self._classes[full]

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(f"unexpected persistent id {pid!r:.80} in .metadata")


def read_metadata(folder: str | os.PathLike[str]) -> DcpMetadata:
    """Read ``folder/.metadata`` into :class:`DcpMetadata`.

    Raises:
        UnsupportedGlobal: it names a global beyond DCP's own classes (nothing was run).
        NeedsTorch: it holds something this reader does not model (torch's reader may).
        CheckpointFormatError: what torch's reader cannot read either: not a well-formed pickle,
            DCP's classes given what they refuse, keys that do not come back from their paths,
            a chunk without stored bytes, a negative size or offset.
    """
    with open_regular(Path(folder) / DCP_METADATA, folder=folder) as f:
        data = f.read()  # its size on disk: read whole, as torch's reader does
    try:
        return _interpret(lp.loads(data, unpickler=_Unpickler))
    except lp.UnsupportedGlobal:
        raise
    except CheckpointFormatError as e:  # what no reader may accept (torch's would allocate for it)
        text = str(e) if str(e).startswith(DCP_METADATA) else f"{DCP_METADATA}: {e}"
        fix = "" if "damaged" in text else f": {DAMAGED}"  # the pickle reader's own words
        raise CheckpointFormatError(f"{folder}/{text}{fix}") from None
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as e:  # DCP's classes, in a shape not modelled
        raise NeedsTorch(f".metadata is laid out in a way this reader does not model ({type(e).__name__}: {e})") from e


def _interpret(meta: Any) -> DcpMetadata:
    if not isinstance(meta, _Stand) or meta.global_name != _META + "Metadata":
        raise NeedsTorch(f".metadata holds a {type(meta).__name__}, not DCP's Metadata")
    storage_meta = meta.field("storage_meta", optional=True)  # torch's reader sets its load_id
    if storage_meta is not None and (
        not isinstance(storage_meta, _Stand) or isinstance(storage_meta, (_Path, _MemFormat, _Index))  # _Index: frozen
    ):
        raise NeedsTorch(f".metadata's storage_meta is a {type(storage_meta).__name__}")
    stored: dict[tuple[str, tuple[int, ...] | None], Stored] = {}
    for index, info in _mapping(meta.field("storage_data"), "storage_data").items():
        if getattr(info, "global_name", "") != "torch.distributed.checkpoint.filesystem._StorageInfo":
            raise NeedsTorch("storage_data is not FileSystemWriter's (another storage writer)")
        if info.state.get("transform_descriptors"):
            raise NeedsTorch(f"{index.field('fqn')} is stored through transforms {info.state['transform_descriptors']}")
        fqn, at, length = _str(index.field("fqn")), info.field("offset"), info.field("length")
        if isinstance(at, int) and isinstance(length, int) and (at < 0 or length <= 0):  # torch's reader fails on these
            raise CheckpointFormatError(f".metadata stores {fqn} at offset {at}, length {length}: {DAMAGED}")
        where = Stored(
            _str(info.field("relative_path")), _int(at, f"{fqn}'s byte offset"), _int(length, f"{fqn}'s length")
        )
        offset = index.field("offset", optional=True)
        stored[(fqn, None if offset is None else dims(offset, f"{fqn}'s stored chunk offset"))] = where
    entries: dict[str, TensorEntry | BytesEntry] = {}
    for fqn, md in _mapping(meta.field("state_dict_metadata"), "state_dict_metadata").items():
        entries[_str(fqn)] = _entry(_str(fqn), md, stored)
    kinds = {k: isinstance(e, TensorEntry) for k, e in entries.items()}
    return DcpMetadata(entries, key_paths(kinds, meta.field("planner_data", optional=True)))


def _entry(fqn: str, md: Any, stored: dict[tuple[str, tuple[int, ...] | None], Stored]) -> TensorEntry | BytesEntry:
    kind = getattr(md, "global_name", "")
    if kind == _META + "BytesStorageMetadata":
        return BytesEntry(fqn, _find(stored, fqn, None))
    if kind != _META + "TensorStorageMetadata":
        raise NeedsTorch(f"{fqn} is a {kind or type(md).__name__}, which this reader does not model")
    props = md.field("properties")
    state = getattr(props, "state", None)  # (dtype, layout, requires_grad, memory format, pin_memory)
    if not isinstance(props, _Properties) or not isinstance(state, tuple):
        raise NeedsTorch(f"{fqn}: tensor properties this reader does not model")
    if not isinstance(state[0], str):  # None is torch's default dtype
        raise NeedsTorch(f"{fqn}: its dtype is a {type(state[0]).__name__}")
    dtype = state[0].removeprefix("torch.")
    if not isinstance(state[0], _Global) or dtype not in BY_NAME:  # torch's reader passes it to torch.empty
        raise CheckpointFormatError(
            f".metadata gives tensor {fqn} the dtype {str(state[0])!r:.40}, no torch dtype: {DAMAGED}"
        )
    if getattr(state[1], "args", ("torch.strided",)) != ("torch.strided",):
        raise NeedsTorch(f"{fqn} is not a strided (dense) tensor")
    chunks = []
    for c in md.field("chunks"):
        offsets, sizes = (
            dims(c.field("offsets"), f"{fqn}'s chunk offset"),
            dims(c.field("sizes"), f"{fqn}'s chunk size"),
        )
        chunks.append(Chunk(offsets, sizes, _find(stored, fqn, offsets)))
    return TensorEntry(fqn, dtype, dims(md.field("size"), f"{fqn}'s size"), tuple(chunks))


def _find(
    stored: dict[tuple[str, tuple[int, ...] | None], Stored], fqn: str, offsets: tuple[int, ...] | None
) -> Stored:
    # the index torch's reader looks each read up by: a chunk's offsets, or none for a value
    where = stored.get((fqn, offsets))
    if where is None:
        raise unstored(fqn, offsets)
    return where


def unstored(fqn: str, offsets: tuple[int, ...] | None) -> CheckpointFormatError:
    """The error for an item ``storage_data`` does not hold: a chunk at ``offsets`` (None: a value)."""
    what = "its value" if offsets is None else f"its chunk at {list(offsets)}"
    return CheckpointFormatError(f".metadata is malformed: it lists {fqn} but not where {what} is stored: {DAMAGED}")


def _mapping(value: Any, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise NeedsTorch(f".metadata's {what} is a {type(value).__name__}, not a dict")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise NeedsTorch(f".metadata holds a {type(value).__name__} where a name belongs")
    return value


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise NeedsTorch(f".metadata holds {value!r:.40} as {what}")
    if value < 0:  # torch's reader fails on it: a negative dimension, or an index it never finds
        raise CheckpointFormatError(f".metadata gives {what} as {value}, below 0: {DAMAGED}")
    return value


def dims(value: Any, what: str) -> tuple[int, ...]:
    """A size or offsets, as ints none of which is negative (``what`` names it in errors)."""
    if not isinstance(value, (tuple, list)):
        raise NeedsTorch(f".metadata holds a {type(value).__name__} as {what}")
    return tuple(_int(v, what) for v in value)


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


class Group(NamedTuple):
    """``rows`` consecutive rows of a tensor, from row ``row`` on, each the same chunks' stretches
    side by side: ``parts`` lists, left to right, ``(chunk index, first element, width)``: the
    chunk's stretch of each row is ``width`` elements, the group's rows one after another in the
    chunk from ``first element`` on."""

    row: int
    rows: int
    parts: tuple[tuple[int, int, int], ...]


class Tiling(NamedTuple):
    """How chunks split along more than the first dim tile a tensor: rows of ``width`` elements
    (a row spans the dims from the last split one on), in :class:`Group` s, in row order."""

    width: int
    groups: list[Group]


def chunks_in_order(folder: Path, e: TensorEntry) -> tuple[list[Chunk], Tiling | None]:
    """The chunks with bytes, and how they tile the tensor.

    Split along dim 0 only (FSDP's rows), the chunks in offset order are the tensor's bytes one
    after another: the tiling is None. Split along other dims too (tensor parallelism's columns,
    a 2-D mesh), each chunk is a box whose rows interleave with its neighbours': the
    :class:`Tiling` says which chunks make up each run of rows, found per run of rows (never per
    stretch: a large tensor has millions).

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
        return chunks, _tiling(folder, e, chunks)
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


def _tiling(folder: Path, e: TensorEntry, chunks: list[Chunk]) -> Tiling:
    """The :class:`Tiling` of :func:`chunks_in_order`, checked to cover the tensor once.

    A row is an index into the dims before ``split`` (the last dim a chunk splits); every chunk
    spans the dims after it, so its part of a row is one stretch. Dim by dim, the chunks' edges
    cut the index range into intervals each chunk covers whole or not at all; an interval whose
    chunks all span the remaining row dims is one group, else each index in it is cut further.
    Within a group, the chunks' intervals along ``split`` must tile it exactly.
    """
    shape = e.shape
    split = max(d for c in chunks for d in range(len(shape)) if c.offsets[d] != 0 or c.sizes[d] != shape[d])
    span = math.prod(shape[split + 1 :])  # elements per unit of the split dim
    width = shape[split] * span
    rows_per = [math.prod(shape[d + 1 : split]) for d in range(split)]  # rows per index of dim d
    groups: list[Group] = []

    def fail(row: int, col: int, end_row: int, end_col: int, overlap: bool) -> CheckpointFormatError:
        first, last = row * width + col, end_row * width + end_col - 1
        what = f"overlap at element {first}" if overlap else f"leave elements {first}..{last} uncovered"
        return CheckpointFormatError(
            f"{folder}: the chunks of tensor {e.fqn} ({list(shape)}) {what}; each element must be in exactly one chunk"
        )

    def emit(row: int, rows: int, index: list[int], members: list[int]) -> None:
        parts, col = [], 0
        for i in sorted(members, key=lambda i: chunks[i].offsets[split]):
            c = chunks[i]
            if c.offsets[split] != col:
                at = c.offsets[split] * span if c.offsets[split] < col else col * span
                raise fail(row, at, row, c.offsets[split] * span, c.offsets[split] < col)
            local = 0  # the chunk's row holding the group's first row
            for d in range(split):
                local = local * c.sizes[d] + (index[d] - c.offsets[d] if d < len(index) else 0)
            w = c.sizes[split] * span
            parts.append((i, local * w, w))
            col += c.sizes[split]
        if col != shape[split]:
            raise fail(row, col * span, row, width, False)
        groups.append(Group(row, rows, tuple(parts)))

    def cut(d: int, row: int, index: list[int], members: list[int]) -> None:
        edges = sorted(
            {
                0,
                shape[d],
                *(x for i in members for x in (chunks[i].offsets[d], chunks[i].offsets[d] + chunks[i].sizes[d])),
            }
        )
        for a, b in itertools.pairwise(edges):
            inside = [
                i for i in members if chunks[i].offsets[d] <= a and b <= chunks[i].offsets[d] + chunks[i].sizes[d]
            ]
            first = row + a * rows_per[d]
            if not inside:
                raise fail(first, 0, first + (b - a) * rows_per[d] - 1, width, False)
            if d == split - 1 or all(
                chunks[i].offsets[k] == 0 and chunks[i].sizes[k] == shape[k]
                for i in inside
                for k in range(d + 1, split)
            ):
                emit(first, (b - a) * rows_per[d], [*index, a], inside)
            else:
                for k in range(a, b):
                    cut(d + 1, row + k * rows_per[d], [*index, k], inside)

    cut(0, 0, [], list(range(len(chunks))))
    return Tiling(width, groups)
