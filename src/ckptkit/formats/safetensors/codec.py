"""The safetensors codec: header, CRC-32 metadata and tied-tensor aliases, without torch.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, a
JSON header of N bytes (space-padded so data starts 8-aligned), then raw little-endian bytes.
Each header entry is ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data;
``__metadata__`` maps strings to strings. We write the file ourselves instead of calling
``safetensors.torch.save_file`` so the bytes go into our atomic temp file, stream tensor by
tensor (no whole-file buffer, no numpy), and keep tied weights: a tensor that is an exact alias
of another is stored once and recorded under ``ckptkit.aliases`` so loading re-ties it, as
``safetensors.torch.save_model``/``load_model`` do for modules.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, BinaryIO

from ...errors import PARSE_ERRORS, ArgumentError, CheckpointFormatError, summarize
from ...io.fileio import Progress, file_size
from ..dtypes import BY_NAME, BY_SAFETENSORS
from ..entry import Entry

DTYPE_SIZES: dict[str, int] = {code: d.itemsize for code, d in BY_SAFETENSORS.items()}
MAX_HEADER = 100_000_000  # the limit safetensors itself enforces
ALIASES_KEY = "ckptkit.aliases"
CRC_KEY = "ckptkit.crc32"  # {tensor name: CRC-32 of its bytes, 8 hex digits}: lets verify see bit flips
_CRC_PLACEHOLDER = "00000000"
# CRC-32 of what the header says (header_crc): a flipped bit in a name, a dtype edited from I64 to
# U64 or an offset moved is seen, as the tensor CRCs see the bytes.
HEADER_CRC_KEY = "ckptkit.header_crc32"


def header_crc(header: Mapping[str, Any]) -> int:
    """The CRC-32 of what a parsed header says: every tensor's name, dtype, shape and offsets, and
    the metadata (its own :data:`HEADER_CRC_KEY` aside), in an order of their own.

    Example:
        >>> f"{header_crc({'w': {'dtype': 'F32', 'shape': [1], 'data_offsets': [0, 4]}}):08x}"
        'e15b1c23'
    """
    meta = sorted((str(k), str(v)) for k, v in (header.get("__metadata__") or {}).items() if k != HEADER_CRC_KEY)
    tensors = sorted(
        (str(n), str(e["dtype"]), [int(d) for d in e["shape"]], [int(o) for o in e["data_offsets"]])
        for n, e in header.items()
        if n != "__metadata__"
    )
    return zlib.crc32(json.dumps([meta, tensors], separators=(",", ":")).encode())


def crc_metadata(names: Iterable[str], crcs: Mapping[str, Any] | None = None) -> str:
    """The CRC_KEY value; with ``crcs`` missing it is a same-length placeholder to patch later."""
    return json.dumps({n: f"{crcs[n]:08x}" if crcs is not None else _CRC_PLACEHOLDER for n in names})


def write_safetensors(
    f: BinaryIO, state: Mapping[str, Any], metadata: Mapping[str, str], *, source: str, progress: Progress | None = None
) -> int:
    """The one safetensors writer: ``state``'s entries, tied ones (equal ``ident``) stored once and
    recorded under ``ckptkit.aliases``, with ckptkit's per-tensor CRC-32s; returns the bytes stored.

    Raises:
        ArgumentError: naming ``source``: a value that is not a tensor, or a dtype safetensors
            has no name for.

    Example:
        >>> write_safetensors(f, {"w": entry}, {"format": "pt"}, source="model.pt")  # doctest: +SKIP
    """
    bad = [f"{k} ({type(v).__name__})" for k, v in state.items() if not isinstance(v, Entry)]
    if bad:
        raise ArgumentError(
            f"{source}: safetensors holds only tensors, but {len(bad)} entries are not: {summarize(bad)}; "
            "save them with a .pt suffix, or pass only the model state dict"
        )
    unknown = [
        f"{k} ({v.dtype})" for k, v in state.items() if v.dtype not in BY_NAME or BY_NAME[v.dtype].safetensors is None
    ]
    if unknown:
        raise ArgumentError(f"{source}: safetensors has no dtype for {summarize(unknown)}; use a .pt suffix")
    kept: dict[str, Entry] = {}
    first: dict[Any, str] = {}
    aliases: dict[str, list[Any]] = {}
    for i, (name, e) in enumerate(state.items()):
        if e.nbytes and e.ident in first:  # {alias: [target, position]}: loading restores the order too
            aliases[name] = [first[e.ident], i]
        else:
            first.setdefault(e.ident, name)
            kept[name] = e
    meta = {k: v for k, v in metadata.items() if k not in (ALIASES_KEY, CRC_KEY)}
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases)
    entries = [(n, BY_NAME[e.dtype].safetensors or "", list(e.shape), e.nbytes) for n, e in kept.items()]
    offset = sum(e.nbytes for e in kept.values())
    start = f.tell()

    def header(crcs: Mapping[str, int | None] | None) -> bytes:
        return header_bytes(entries, {**meta, CRC_KEY: crc_metadata(kept, crcs)}, checksum=True)

    # Where the source records every CRC-32, the header goes out once, final; else with
    # same-width placeholders patched after the data (a page the disk may be writing back).
    known = {n: e.crc for n, e in kept.items()}
    first_header = header(known if None not in known.values() else None)
    f.write(first_header)
    final = header({n: e.write(f, progress) for n, e in kept.items()})
    if final != first_header:
        if len(final) != len(first_header):  # cannot happen: same keys, same widths
            raise CheckpointFormatError("internal error: safetensors header changed length while patching CRCs")
        end = f.tell()
        f.seek(start)
        f.write(final)
        f.seek(end)
    return offset


def header_bytes(
    entries: Iterable[tuple[str, str, list[int], int]], metadata: Mapping[str, str] | None, *, checksum: bool = False
) -> bytes:
    """Length prefix + JSON header for ``(name, dtype, shape, nbytes)`` entries laid out in order;
    ``checksum``: with its :func:`header_crc` in the metadata."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if checksum:
        header.setdefault("__metadata__", {})[HEADER_CRC_KEY] = f"{header_crc(header):08x}"
    return encode_header(header)


def encode_header(header: Mapping[str, Any]) -> bytes:
    """Length prefix + compact JSON, space-padded so tensor data starts 8-byte aligned."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_header(f: BinaryIO, *, size: int | None = None, source: str = "file") -> tuple[dict[str, Any], int]:
    """Parse and validate a safetensors header without reading tensor data.

    Returns:
        ``(header, data_start)``: the header in file order (``__metadata__`` included when
        present) and the byte offset where tensor data begins.

    Raises:
        CheckpointFormatError: naming what is wrong (length past EOF, bad JSON, unknown dtype,
            offsets out of bounds or overlapping, size not matching the shape).
    """
    if size is None:
        size = file_size(f)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise CheckpointFormatError(f"{source}: {size} bytes is too short for a safetensors file (needs 8+)")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER or 8 + n > size:
        raise CheckpointFormatError(
            f"{source}: safetensors header claims {n} bytes but the file has {size - 8} after the length "
            f"(limit {MAX_HEADER}); the file is truncated or not safetensors"
        )
    raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except PARSE_ERRORS as e:  # RecursionError too: a header nested 100,000 deep
        raise CheckpointFormatError(f"{source}: safetensors header is not valid JSON ({type(e).__name__}: {e})") from e
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{source}: safetensors header is a JSON {type(header).__name__}, not an object")
    data_len = size - 8 - n
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CheckpointFormatError(f"{source}: __metadata__ must map strings to strings")
            continue
        spans.append(_check_entry(name, entry, data_len, source))
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            what = "overlaps the previous tensor" if begin < end else f"leaves a gap of {begin - end} bytes"
            raise CheckpointFormatError(f"{source}: tensor {name!r} at byte {begin} {what}")
        end = stop
    if end != data_len:
        raise CheckpointFormatError(f"{source}: tensors cover {end} bytes but the data section has {data_len}")
    _check_recorded(header, source)
    return header, 8 + n


def _check_recorded(header: Mapping[str, Any], source: str) -> None:
    """Hold a header against what ckptkit recorded in it when it wrote it (other writers record
    nothing): its own CRC-32, and a CRC map naming each stored tensor once."""
    meta = header.get("__metadata__") or {}
    if HEADER_CRC_KEY in meta and meta[HEADER_CRC_KEY] != f"{header_crc(header):08x}":
        raise CheckpointFormatError(
            f"{source}: the header's names, dtypes, shapes, offsets or metadata changed since ckptkit wrote it "
            f"(its CRC-32 is {header_crc(header):08x}, recorded {meta[HEADER_CRC_KEY][:8]}): the file is damaged"
        )
    if CRC_KEY in meta:
        recorded, names = set(parse_crcs(meta, source)), {n for n in header if n != "__metadata__"}
        if recorded != names:
            absent, missing = sorted(recorded - names), sorted(names - recorded)
            said = [f"names absent tensors {summarize(absent, 3)}"] * bool(absent)
            said += [f"misses {summarize(missing, 3)}"] * bool(missing)
            raise CheckpointFormatError(f"{source}: its {CRC_KEY} map {' and '.join(said)}: the file is damaged")


def _check_entry(name: str, entry: Any, data_len: int, source: str) -> tuple[int, int, str]:
    if not isinstance(entry, dict):
        raise CheckpointFormatError(f"{source}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise CheckpointFormatError(f"{source}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CheckpointFormatError(f"{source}: tensor {name!r} has invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise CheckpointFormatError(
            f"{source}: tensor {name!r} has data_offsets {offsets!r} outside the {data_len}-byte data section"
        )
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise CheckpointFormatError(
            f"{source}: tensor {name!r} is {dtype}{shape} = {expected} bytes but its offsets span {offsets[1] - offsets[0]}"
        )
    return offsets[0], offsets[1], name


def shown_metadata(meta: Mapping[str, str]) -> dict[str, str]:
    """Metadata as ``inspect`` shows it: what ckptkit records for itself (a CRC per tensor, the
    header's, the aliases) summarised as one ``ckptkit`` entry, the rest as it is.

    Example:
        >>> shown_metadata({"format": "pt", CRC_KEY: '{"w": "7bd5c66f"}', HEADER_CRC_KEY: "a811b336"})
        {'format': 'pt', 'ckptkit': 'CRC-32 of 1 tensor and of the header'}
    """
    own = {k: meta[k] for k in (CRC_KEY, HEADER_CRC_KEY, ALIASES_KEY) if k in meta}
    shown = {k: v for k, v in meta.items() if k not in own}
    said = []
    if CRC_KEY in own:
        try:
            n = len(json.loads(own[CRC_KEY]))
            said.append(
                f"CRC-32 of {n} tensor{'s' * (n != 1)}" + (" and of the header" if HEADER_CRC_KEY in own else "")
            )
        except PARSE_ERRORS:
            said.append("a malformed CRC map (verify says more)")
    if ALIASES_KEY in own:
        said.append("tied tensors stored once")
    if said:
        shown["ckptkit"] = "; ".join(said)
    return shown


def parse_crcs(meta: Mapping[str, str], source: str) -> dict[str, int]:
    """Tensor name -> CRC-32 from the ``ckptkit.crc32`` metadata ({} when none was recorded)."""
    try:
        return {str(k): int(v, 16) for k, v in json.loads(meta.get(CRC_KEY, "{}")).items()}
    except PARSE_ERRORS as e:
        raise CheckpointFormatError(f"{source}: metadata {CRC_KEY} is malformed ({type(e).__name__}: {e})") from e


def parse_aliases(meta: Mapping[str, str], names: Iterable[str], source: str) -> list[tuple[int, str, str]]:
    """``(position, alias, target)`` from the ``ckptkit.aliases`` metadata, sorted by position.

    Only in a header ckptkit wrote (it carries :data:`HEADER_CRC_KEY`, which covers the aliases
    too, and the header parser checked it): another writer's metadata is not ckptkit's to act on,
    and every other reader (``safetensors.torch.load_file``) ignores it, so ckptkit does too.

    Raises:
        CheckpointFormatError: the metadata is malformed, or an alias points at a missing tensor
            or shadows a stored one.
    """
    if HEADER_CRC_KEY not in meta:
        return []
    try:
        raw = json.loads(meta.get(ALIASES_KEY, "{}"))
        if not isinstance(raw, dict):
            raise TypeError(f"a JSON {type(raw).__name__}, not an object")
        placed = sorted((int(pos), str(alias), str(target)) for alias, (target, pos) in raw.items())
    except PARSE_ERRORS as e:
        raise CheckpointFormatError(f"{source}: metadata {ALIASES_KEY} is malformed ({e})") from e
    known = set(names)
    for _, alias, target in placed:
        if target not in known:
            raise CheckpointFormatError(f"{source}: alias {alias!r} points at missing tensor {target!r}")
        if alias in known:
            raise CheckpointFormatError(f"{source}: alias {alias!r} has the name of a stored tensor")
    return placed


def insert_aliases(entries: OrderedDict[str, Any], placed: list[tuple[int, str, str]]) -> OrderedDict[str, Any]:
    """``entries`` with each alias put back at its position, as the same object as its target."""
    if not placed:
        return entries
    items = list(entries.items())
    for pos, alias, target in placed:
        items.insert(min(pos, len(items)), (alias, entries[target]))
    return OrderedDict(items)


class HeaderKept:
    """What a check of a safetensors file reads of it, as its bytes pass (a file streamed to a
    store): the length prefix and the header; the tensors' bytes are a hole in the local image.

    Example:
        >>> kept = HeaderKept()
        >>> kept.feed(0, (2).to_bytes(8, "little") + b"{}"), kept.feed(10, b"data")
        ([(0, 10)], [])
    """

    def __init__(self) -> None:
        self.end: int | None = None

    def feed(self, offset: int, data: bytes | memoryview) -> list[tuple[int, int]]:
        if self.end is None and offset == 0 and len(data) >= 8:
            self.end = 8 + int.from_bytes(bytes(data[:8]), "little")
        if self.end is None:  # the length not yet seen: kept until it is
            return [(offset, offset + len(data))]
        return [(offset, min(offset + len(data), self.end))] if offset < self.end else []
