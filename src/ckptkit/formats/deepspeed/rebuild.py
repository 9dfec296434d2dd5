"""DeepSpeed's ``zero_to_fp32`` rules, as byte ranges: each tensor of the rebuilt state dict is
the pieces of the partition records it would be concatenated from, nothing read yet.

The order and names are ``zero_to_fp32``'s: buffers (floating ones to be upcast to fp32), then
frozen parameters, then trainable ones (fp32 masters), then tied aliases (the same
:class:`Spec` as their source, so every writer stores them once). ``fixtures/DEEPSPEED_LAYOUT.md``
gives the rules.

Example:
    >>> partitioned(13, 2)
    7
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ...errors import CheckpointFormatError, UnsupportedCheckpointError
from ..pickles import reader as tp
from ..torchzip.container import Record, TorchZip
from .files import entry_of

FLOATS = ("float32", "float16", "bfloat16", "float64")  # what zero_to_fp32's buffer .float() upcasts (or rounds)


class Piece(NamedTuple):
    """``length`` bytes at ``start`` of file ``file`` (an index into the source's files), inside zip
    record ``record``, whose CRC-32 covers them and the rest of that record."""

    file: int
    start: int
    length: int
    record: Record


@dataclass(eq=False)  # identity matters: a tied alias is the same Spec
class Spec:
    """One tensor of the result: dtype, shape and pieces; ``source_dtype`` differs where the
    bytes are upcast to ``dtype`` while copied (a 16-bit buffer)."""

    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    source_dtype: str


class Run(NamedTuple):
    """A contiguous tensor of a rank file, as elements at ``start``: a flat partition, a fragment."""

    file: int
    start: int
    numel: int
    itemsize: int
    record: Record
    dtype: str


def partitioned(numel: int, world_size: int) -> int:
    """Elements of a ZeRO-3 parameter each rank holds: ``ceil(numel / world_size)``."""
    return math.ceil(numel / world_size)


def run(file: int, z: TorchZip, value: Any, what: str) -> Run:
    """A stand-in tensor of file ``file`` as a contiguous run of its record's bytes.

    Raises:
        CheckpointFormatError: not a tensor, or past its record's end; UnsupportedCheckpointError:
            not contiguous, compressed or big-endian.
    """
    t = tp.tensor_of(value)
    if t is None:
        raise CheckpointFormatError(f"{z.path}: {what} is a {type(value).__name__}, expected a tensor")
    rec = z.storage(t.storage.key)
    if not t.itemsize:
        raise UnsupportedCheckpointError(f"{z.path}: {what} has dtype {t.dtype}, which ckptkit does not know")
    if rec.method != 0 or z.byteorder != "little" or not t.is_contiguous():
        why = "compressed" if rec.method else "big-endian" if z.byteorder != "little" else "not contiguous"
        raise UnsupportedCheckpointError(
            f"{z.path}: {what} is {why}; rebuild the weights with DeepSpeed's zero_to_fp32.py"
        )
    start, length = t.byte_range()
    if start < 0 or start + length > rec.size:
        raise CheckpointFormatError(f"{z.path}: {what} needs bytes {start}..{start + length} of a record of {rec.size}")
    return Run(file, rec.data_offset + start, t.numel, t.itemsize, rec, t.dtype)


def shape_of(value: Any, where: str) -> tuple[int, ...]:
    """A pickled ``torch.Size`` (or tuple) as a tuple of ints."""
    if isinstance(value, tp.Call) and value.func.name == "Size":
        value = value.args[0] if value.args else ()
    if not isinstance(value, (tuple, list)) or not all(isinstance(d, int) and d >= 0 for d in value):
        raise CheckpointFormatError(f"{where}: a shape is {value!r}, expected sizes")
    return tuple(value)


def pieces(runs: list[Run], offset: int, numel: int) -> tuple[Piece, ...]:
    """Elements ``offset .. offset + numel`` of the concatenation of ``runs``."""
    out, at = [], 0
    for r in runs:
        lo, hi = max(offset, at), min(offset + numel, at + r.numel)
        if lo < hi:
            out.append(Piece(r.file, r.start + (lo - at) * r.itemsize, (hi - lo) * r.itemsize, r.record))
        at += r.numel
    return tuple(out)


def whole(r: Run, shape: tuple[int, ...], dtype: str | None = None) -> Spec:
    return Spec(dtype or r.dtype, shape, pieces([r], 0, r.numel), r.dtype)


def trainable_12(
    shapes: list[dict[str, Any]], optims: list[Any], paths: list[Path], zips: list[TorchZip]
) -> OrderedDict[str, Spec]:
    """Stage 1/2: group ``i`` is the rank-ordered concatenation of ``single_partition_of_fp32_groups[i]``;
    each parameter a slice of it, in ``param_shapes[i]`` order, past its alignment padding."""
    out: OrderedDict[str, Spec] = OrderedDict()
    ws = len(optims)
    groups = [entry_of(o, "single_partition_of_fp32_groups", p) for o, p in zip(optims, paths, strict=True)]
    if any(not isinstance(g, list) or len(g) != len(shapes) for g in groups):
        raise CheckpointFormatError(
            f"{paths[0]}: {len(groups[0])} fp32 partition groups, expected {len(shapes)} (param_shapes)"
        )
    for gi, group in enumerate(shapes):
        runs = [run(r, zips[r], groups[r][gi], f"fp32 partition of group {gi}") for r in range(ws)]
        paddings = optims[0].get("param_alignment_paddings") or [[0] * len(g) for g in shapes]
        pads = paddings[gi] if gi < len(paddings) else []
        if len(pads) != len(group):
            raise CheckpointFormatError(
                f"{paths[0]}: group {gi} has {len(group)} parameters but {len(pads)} alignment paddings"
            )
        avail, offset = sum(r.numel for r in runs), 0
        for (name, size), pad in zip(group.items(), pads, strict=True):
            shape = shape_of(size, str(zips[0].path))
            numel = math.prod(shape)
            if offset + numel > avail:
                raise CheckpointFormatError(
                    f"{paths[0].parent}: parameter {name} needs elements {offset}..{offset + numel} of "
                    f"group {gi}, whose partitions hold {avail}: a rank's optim file is missing or stale"
                )
            out[name] = Spec("float32", shape, pieces(runs, offset, numel), "float32")
            offset += numel + pad
        align = 2 * ws  # zero_to_fp32's sanity check: both padded up to a multiple of 2 * world size
        if math.ceil(offset / align) != math.ceil(avail / align):
            raise CheckpointFormatError(
                f"{paths[0].parent}: group {gi}'s parameters take {offset} elements but its fp32 "
                f"partitions hold {avail}: the files are not of one checkpoint"
            )
        if any(r.dtype != "float32" for r in runs):
            raise CheckpointFormatError(
                f"{paths[0].parent}: group {gi}'s fp32 partitions are {runs[0].dtype}, expected float32"
            )
    return out


def trainable_3(
    shapes: list[dict[str, Any]], optims: list[Any], paths: list[Path], zips: list[TorchZip]
) -> OrderedDict[str, Spec]:
    """Stage 3: each parameter is partitioned alone, ``ceil(numel / ws)`` per rank, back to back in
    each rank's ``fp32_flat_groups`` (concatenated), in the order of every ``param_shapes`` merged."""
    out: OrderedDict[str, Spec] = OrderedDict()
    ws = len(optims)
    flats = [
        [run(r, zips[r], g, f"fp32_flat_groups[{i}]") for i, g in enumerate(entry_of(o, "fp32_flat_groups", paths[r]))]
        for r, o in enumerate(optims)
    ]
    lengths = [sum(r.numel for r in f) for f in flats]
    if len(set(lengths)) != 1 or any(r.dtype != "float32" for f in flats for r in f):
        raise CheckpointFormatError(
            f"{paths[0].parent}: the ranks' fp32 partitions hold {lengths} elements; expected "
            "float32 partitions of one length: the files are not of one checkpoint"
        )
    merged = {k: v for group in shapes for k, v in group.items()}
    offset = 0
    for name, size in merged.items():
        shape = shape_of(size, str(zips[0].path))
        numel = math.prod(shape)
        part = partitioned(numel, ws)
        if offset + part > lengths[0]:
            raise CheckpointFormatError(
                f"{paths[0].parent}: parameter {name} needs elements {offset}..{offset + part} of "
                f"each rank's fp32 partition, which holds {lengths[0]}"
            )
        found = [p for r in range(ws) for p in pieces(flats[r], offset, max(0, min(part, numel - r * part)))]
        out[name] = Spec("float32", shape, tuple(found), "float32")
        offset += part
    if offset != lengths[0]:
        raise CheckpointFormatError(
            f"{paths[0].parent}: the parameters take {offset} elements of each rank's fp32 "
            f"partition, which holds {lengths[0]}: the files are not of one checkpoint"
        )
    return out


def buffers(model: Any, z: TorchZip, file: int) -> OrderedDict[str, Spec]:
    """The persistent buffers of ``module``, in its order; floating ones to be made float32."""
    names = set(entry_of(model, "buffer_names", z.path) or ())
    out: OrderedDict[str, Spec] = OrderedDict()
    for name, value in entry_of(model, "module", z.path).items():
        if name in names:
            r = run(file, z, value, f"buffer {name}")
            out[name] = whole(r, tp.tensor_of(value).shape, "float32" if r.dtype in FLOATS else r.dtype)  # type: ignore[union-attr]
    return out


def frozen(stage: int, models: list[Any], zips: list[TorchZip], files: list[int]) -> OrderedDict[str, Spec]:
    """Parameters the optimizer does not own: stage 2 saves each whole (in its saved dtype), stage
    3 each rank's flat chunk; stage 1 saves none (zero_to_fp32 leaves them out)."""
    out: OrderedDict[str, Spec] = OrderedDict()
    shapes = models[0].get("frozen_param_shapes") if isinstance(models[0], Mapping) else None
    for name, size in (shapes or {}).items():
        shape = shape_of(size, str(zips[0].path))
        frags = [
            entry_of(entry_of(m, "frozen_param_fragments", z.path), name, z.path)
            for m, z in zip(models, zips, strict=True)
        ]
        runs = [run(f, z, v, f"frozen parameter {name}") for f, z, v in zip(files, zips, frags, strict=True)]
        if stage <= 2:
            out[name] = whole(runs[0], tp.tensor_of(frags[0]).shape)  # type: ignore[union-attr]
        elif sum(r.numel for r in runs) < math.prod(shape):
            raise CheckpointFormatError(
                f"{zips[0].path.parent}: frozen parameter {name} {list(shape)} has "
                f"{sum(r.numel for r in runs)} elements across the ranks' fragments"
            )
        else:
            out[name] = Spec(runs[0].dtype, shape, pieces(runs, 0, math.prod(shape)), runs[0].dtype)
    return out


def module_weights(model: Any, z: TorchZip, file: int) -> OrderedDict[str, Spec]:
    """``module`` as saved (stage 1/2: full 16-bit weights and buffers), names sharing one view
    (the tied alias) sharing one Spec."""
    out: OrderedDict[str, Spec] = OrderedDict()
    seen: dict[Any, Spec] = {}
    for name, value in entry_of(model, "module", z.path).items():
        t = tp.tensor_of(value)
        r = run(file, z, value, f"module weight {name}")
        key = (t.storage.key, t.offset, t.shape, t.stride, t.dtype)  # type: ignore[union-attr]
        out[name] = seen.setdefault(key, whole(r, t.shape))  # type: ignore[union-attr]
    return out


def to_float32(dtype: str, data: bytes) -> bytearray:
    """Little-endian ``dtype`` values as little-endian float32, exactly as torch's ``.float()``.

    Example:
        >>> bytes(to_float32("bfloat16", b"\\xc0\\x3f"))  # 1.5
        b'\\x00\\x00\\xc0?'
    """
    if dtype == "float32":
        return bytearray(data)
    if dtype == "bfloat16":  # bf16 is fp32's top half: each value moves up two bytes
        out = bytearray(len(data) * 2)
        out[2::4], out[3::4] = data[0::2], data[1::2]
        return out
    if dtype == "float16":  # every half is exactly a float
        n = len(data) // 2
        return bytearray(struct.pack(f"<{n}f", *struct.unpack(f"<{n}e", data)))
    values = struct.unpack(f"<{len(data) // 8}d", data)  # float64 rounds to nearest; beyond float32's range, inf
    return bytearray(b"".join(_f32(v) for v in values))


def _f32(v: float) -> bytes:
    try:
        return struct.pack("<f", v)
    except OverflowError:
        return struct.pack("<f", math.copysign(math.inf, v))
