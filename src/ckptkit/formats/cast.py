"""Floating tensors cast to another dtype while they are copied, without torch: ``convert --dtype``.

:class:`Cast` decides which entries change (float16, bfloat16, float32, float64, and float8 e4m3fn
and e5m2 ones; integer, bool and complex tensors, other float8 kinds, and the quantization state
beside quantized weights (:data:`QUANT_STATE`) are left as they are) and wraps each in a :class:`CastEntry`,
whose :meth:`~CastEntry.write` streams the source entry's bytes through a small sink: the source
entry reads and checks its own bytes as it always does (each byte against the CRC-32 its source
records, a mismatch to the source's ``damage``), and the sink converts each piece as it arrives
and appends it to the output, so a tensor of any size takes a few MiB of memory.

The values are torch's ``.to(dtype)``, bit for bit, as torch computes them on the CPU: round to
nearest even (through float32, as torch casts a float64 to a 16-bit type), overflow to inf,
subnormals kept, NaN kept as torch's quiet NaN (:func:`cast_bytes`). numpy does the arithmetic;
it is imported on the first cast only, so ``convert`` without ``--dtype`` starts as fast as before.

Example:
    >>> bytes(cast_bytes(b"\\x00\\x00\\xc0\\x3f", "float32", "bfloat16")).hex()  # 1.5
    'c03f'
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Literal

from ..errors import ArgumentError, CheckpointFormatError, spell
from ..io.fileio import Progress, crc32
from .dtypes import BY_NAME
from .entry import Entry

Target = Literal["bf16", "fp16", "fp32"]
TARGETS: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# What a cast changes. float8 e4m3fn and e5m2 only widen (every value is exact in each target);
# the fnuz and e8m0 kinds stay, as does complex.
FLOATS = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
# A quantized weight's companions, by the last part of their name: a float tensor the quantized
# values are decoded with, not a weight. Cast, they decode to other values, and loaders take them
# without a word (bitsandbytes 4-bit: the NF4 codebook cast to bf16 made every layer wrong).
QUANT_STATE = frozenset(
    {
        # fp8 and int8 weights' scales: DeepSeek-V3 (weight_scale_inv), HF FP8 / fbgemm, compressed-tensors,
        # vLLM's KV-cache scales
        "weight_scale",
        "weight_scale_inv",
        "weight_global_scale",
        "input_scale",
        "input_global_scale",
        "output_scale",
        "k_scale",
        "v_scale",
        "kv_scale",
        "weight_zero_point",
        "input_zero_point",
        # GPTQ and AWQ: per-group scales beside the packed int32 qweight and qzeros (their kernels take fp16)
        "scales",
        # bitsandbytes 4-bit and 8-bit (weight.absmax, weight.quant_map, ..., SCB)
        "absmax",
        "quant_map",
        "nested_absmax",
        "nested_quant_map",
        "SCB",
    }
)
_STEP = 8 << 20  # source bytes converted at a time: numpy's temporaries stay a few times this


def target_dtype(dtype: str) -> str:
    """torch's name for a ``dtype=`` choice.

    Example:
        >>> target_dtype("bf16")
        'bfloat16'
    """
    if dtype not in TARGETS:
        raise ArgumentError(f"{spell('dtype', '--dtype')} must be one of {', '.join(TARGETS)}, not {dtype!r}")
    return TARGETS[dtype]


@dataclass(eq=False)
class CastEntry(Entry):
    """``src`` as ``dtype``: same shape, converted bytes. Entries of one source tensor (ties) share
    an ident, so a writer still stores them once."""

    src: Entry = field(repr=False)
    dtype: str
    crc = None  # of bytes that do not exist until written
    zip = None

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.src.shape

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        return self._scaled(self.src.nbytes)

    @property
    def ident(self) -> Any:  # type: ignore[override]
        return ("cast", self.dtype, self.src.ident)

    @property
    def storage(self) -> Any:  # type: ignore[override]
        return ("cast", self.dtype, self.src.storage)

    @property
    def storage_size(self) -> int:  # type: ignore[override]
        return self._scaled(self.src.storage_size)

    @property
    def complete(self) -> bool:  # type: ignore[override]
        return self.src.complete

    def _scaled(self, n: int) -> int:
        return n // BY_NAME[self.src.dtype].itemsize * BY_NAME[self.dtype].itemsize

    def write(self, f: BinaryIO, progress: Progress | None = None) -> int:
        """Append the converted bytes to ``f``; returns their CRC-32. The source entry's own write
        reads (and checks) the source bytes into the sink, piece by piece."""
        sink = _Sink(f, self.src.dtype, self.dtype)
        self.src.write(sink, progress)  # type: ignore[arg-type] # a file-like sink, see _Sink
        if sink.left:  # a source that wrote part of an element: its byte count said otherwise
            raise CheckpointFormatError(
                f"internal error: {len(sink.left)} bytes left over casting a {self.src.dtype} tensor"
            )
        return sink.crc


class _Sink:
    """What a source entry writes into: each piece converted and appended to ``out`` at once.

    It has no file descriptor (``fileno`` raises), so :func:`~ckptkit.io.fileio.copy_range`
    copies into it through reads of at most 32 MiB rather than in the kernel."""

    def __init__(self, out: BinaryIO, src: str, dst: str) -> None:
        self.out, self.src, self.dst = out, src, dst
        self.size = BY_NAME[src].itemsize
        self.left = b""  # the start of an element a piece ended inside of
        self.crc = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if self.left:  # rare: pieces end on element boundaries (chunks and steps are whole elements)
            view = memoryview(self.left + bytes(view))
        whole = len(view) - len(view) % self.size
        for at in range(0, whole, _STEP):
            out = cast_bytes(view[at : min(at + _STEP, whole)], self.src, self.dst)
            self.crc = crc32(out, self.crc)
            self.out.write(out)
        self.left = bytes(view[whole:])
        return n

    def flush(self) -> None:
        """Nothing is buffered: each piece went to the output as it came."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a cast's sink has no file descriptor")


def cast_bytes(data: Any, src: str, dst: str) -> Any:
    """Little-endian ``src`` values (a bytes-like of whole elements) as little-endian ``dst``
    values, exactly as torch's CPU ``.to(dst)`` gives them; returns a bytes-like object.

    NaN, as torch gives it: to bfloat16, ``0xFFFF`` from float32 or float64 (ATen's vectorized
    conversion) and ``0x7FC0`` from float16 or float8 (through c10's scalar one); to float16 and float32,
    quieted with the payload's top bits kept, sign and all (the x86 conversions torch uses).

    Example:
        >>> bytes(cast_bytes(b"\\x00\\x3c", "float16", "float32")).hex()  # 1.0
        '0000803f'
    """
    if src == dst:
        return bytes(data)
    import numpy as np  # noqa: PLC0415 - deferred: only a cast needs it, and it costs ~0.1 s to import

    with np.errstate(all="ignore"):  # overflow to inf and NaN are the intended results
        bits = _f32_bits(np, data, src)
        if dst == "float32":
            return bits
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        if dst == "bfloat16":  # round to nearest even on the top half: add 0x7FFF plus the kept bit's parity
            rounded = bits >> 16
            rounded &= 1
            rounded += 0x7FFF
            rounded += bits  # NaN patterns may wrap: they are replaced below
            rounded >>= 16
            out = rounded.astype("<u2")
            out[nan] = 0xFFFF if src in ("float32", "float64") else 0x7FC0  # torch's vectorized and scalar paths
            return out
        out = bits.view("<f4").astype("<f2").view("<u2")  # IEEE round to nearest even, as F16C
        out[nan] = ((bits[nan] >> 16) & 0x8000) | 0x7E00 | ((bits[nan] >> 13) & 0x3FF)
        return out


def _e4m3fn_bits(np: Any) -> Any:
    """float8_e4m3fn's 256 bit patterns as float32 bit patterns: bias 7, no infinity, NaN at
    S.1111.111 (torch gives it as sign | 0x7FF00000)."""
    b = np.arange(256, dtype="<u4")
    e, m = (b >> 3) & 0xF, (b & 7).astype("<f4")
    magnitude = np.where(e == 0, m / 8, 1 + m / 8) * np.exp2(np.maximum(e, 1).astype("<f4") - 7)
    bits = magnitude.astype("<f4").view("<u4") | ((b >> 7) << 31)
    nan = (b & 0x7F) == 0x7F
    bits[nan] = (bits[nan] & 0x80000000) | 0x7FF00000
    return bits


def _f32_bits(np: Any, data: Any, src: str) -> Any:
    """``data``'s values as float32 bit patterns (a new uint32 array), as torch widens or rounds them."""
    if src == "float32":
        return np.frombuffer(data, "<u4").copy()
    if src == "float8_e4m3fn":  # 256 values, each exact in float32: looked up
        return _e4m3fn_bits(np)[np.frombuffer(data, "u1")]
    if src == "float8_e5m2":  # float16's top byte, as torch widens it
        return _f32_bits(np, (np.frombuffer(data, "u1").astype("<u2") << 8).tobytes(), "float16")
    if src == "bfloat16":  # bfloat16 is float32's top half, NaN payloads and all
        return np.frombuffer(data, "<u2").astype("<u4") << 16
    if src == "float16":  # exact; a NaN is quieted, its payload moved up
        half = np.frombuffer(data, "<u2")
        bits = np.frombuffer(data, "<f2").astype("<f4").view("<u4")
        nan = (half & 0x7FFF) > 0x7C00
        bits[nan] = ((half[nan].astype("<u4") & 0x8000) << 16) | 0x7FC00000 | ((half[nan].astype("<u4") & 0x3FF) << 13)
        return bits
    # float64: rounded to nearest even, overflow to inf; a NaN quieted, the payload's top 22 bits kept
    wide = np.frombuffer(data, "<u8")
    bits = np.frombuffer(data, "<f8").astype("<f4").view("<u4")
    nan = (wide & 0x7FFFFFFFFFFFFFFF) > 0x7FF0000000000000
    bits[nan] = (((wide[nan] >> 32) & 0x80000000) | 0x7FC00000 | ((wide[nan] >> 29) & 0x3FFFFF)).astype("<u4")
    return bits


class Cast:
    """A ``convert --dtype`` cast: which tensors it changed, and the note saying so.

    Example:
        >>> c = Cast("bf16")
        >>> c.record("w", "float32", "w", 8, 4)
        >>> c.notes()
        ['cast 1 tensor float32 -> bfloat16 (8 B -> 4 B)']
    """

    def __init__(self, dtype: Target) -> None:
        self.dtype = target_dtype(dtype)
        self.names: OrderedDict[str, str] = OrderedDict()  # tensor name -> its dtype before
        self.kept: OrderedDict[str, str] = OrderedDict()  # quantization state left as it is -> its dtype
        self._sizes: dict[tuple[str, Any], tuple[int, int]] = {}  # (dtype before, ident) -> bytes before, after

    def refuse_scaled(self, dtypes: Mapping[str, str]) -> None:
        """Refuse a cast of float8 weights with a scale beside them (``weight_scale_inv``, ...):
        fp8-quantized weights mean their values times their scales, which a ``.to()`` does not
        apply. ``dtypes``: each tensor's name and dtype.

        Raises:
            ArgumentError: naming the first such weight and its scale.
        """
        scales: dict[str, str] = {}  # module -> its first quantization-state tensor
        for k in dtypes:
            if is_quant_state(k):
                scales.setdefault(k.rpartition(".")[0], k)
        for name, dtype in dtypes.items():
            if dtype.startswith("float8") and (scale := scales.get(name.rpartition(".")[0])) is not None:
                raise ArgumentError(
                    f"{name} is {dtype} with {scale} beside it: fp8-quantized weights, whose values mean something "
                    f"only times their scales, which a cast (as .to()) does not apply; leave "
                    f"{spell('dtype', '--dtype')} out, or dequantize them with the model's own tooling first"
                )

    def wants(self, dtype: str, name: str) -> bool:
        """Whether tensor ``name`` of ``dtype`` is cast: a floating one of another dtype that is not
        a quantized weight's state (:data:`QUANT_STATE`, which :meth:`notes` then names)."""
        if dtype not in FLOATS or dtype == self.dtype:
            return False
        if is_quant_state(name):
            self.kept[name] = dtype
            return False
        return True

    def wrap(self, e: Any, name: str) -> Any:
        """``e`` as the output should hold it: a :class:`CastEntry` where it is cast, else ``e``."""
        if not isinstance(e, Entry) or not self.wants(e.dtype, name):
            return e
        cast = CastEntry(e, self.dtype)
        self.record(name, e.dtype, e.ident, e.nbytes, cast.nbytes)
        return cast

    def record(self, name: str, before: str, ident: Any, nbytes_before: int, nbytes_after: int) -> None:
        """Note that tensor ``name`` (of ``before``; ties share ``ident``, counted once in bytes) was cast."""
        self.names[name] = before
        self._sizes[(before, ident)] = (nbytes_before, nbytes_after)

    def notes(self) -> list[str]:
        """One line per source dtype: ``cast 12 tensors float32 -> bfloat16 (1.2 GB -> 600.0 MB)``."""
        out = []
        for before in sorted(set(self.names.values())):
            count = sum(1 for d in self.names.values() if d == before)
            a = sum(s[0] for (d, _), s in self._sizes.items() if d == before)
            b = sum(s[1] for (d, _), s in self._sizes.items() if d == before)
            out.append(f"cast {count} tensor{'s' * (count != 1)} {before} -> {self.dtype} ({_size(a)} -> {_size(b)})")
        if not out:
            out.append(f"nothing cast: no floating weights other than {self.dtype}")
        if self.kept:
            n, first = len(self.kept), next(iter(self.kept))
            out.append(
                f"left {n} quantization-state tensor{'s' * (n != 1)} as {'they are' if n != 1 else 'it is'} "
                f"({first}{', ...' * (n > 1)}): quantized weights decode with them"
            )
        return out


def is_quant_state(name: str) -> bool:
    """Whether tensor ``name`` is a quantized weight's state (:data:`QUANT_STATE`, or bitsandbytes'
    ``weight.quant_state.*``), which a cast leaves as it is.

    Example:
        >>> is_quant_state("model.layers.0.mlp.down_proj.weight_scale_inv"), is_quant_state("lm_head.weight")
        (True, False)
    """
    return name.rsplit(".", 1)[-1] in QUANT_STATE or ".quant_state." in f".{name}"


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
