"""The one dtype table: every other view of dtypes in ckptkit is derived from it.

Each row names a dtype as torch spells it (``torch.float32`` -> ``"float32"``), its size in
bytes, the typed storage class torch's pickles name for it (``torch.FloatStorage``; newer
dtypes have none and are pickled through ``UntypedStorage`` with the dtype named directly), and
its safetensors code (``"F32"``; None where safetensors has no such dtype).

Example:
    >>> BY_NAME["bfloat16"].safetensors, BY_SAFETENSORS["F16"].name, BY_STORAGE["LongStorage"].itemsize
    ('BF16', 'float16', 8)
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int
    storage: str | None
    safetensors: str | None


TABLE: tuple[DType, ...] = (
    DType("float32", 4, "FloatStorage", "F32"),
    DType("float64", 8, "DoubleStorage", "F64"),
    DType("float16", 2, "HalfStorage", "F16"),
    DType("bfloat16", 2, "BFloat16Storage", "BF16"),
    DType("int64", 8, "LongStorage", "I64"),
    DType("int32", 4, "IntStorage", "I32"),
    DType("int16", 2, "ShortStorage", "I16"),
    DType("int8", 1, "CharStorage", "I8"),
    DType("uint8", 1, "ByteStorage", "U8"),
    DType("bool", 1, "BoolStorage", "BOOL"),
    DType("complex64", 8, "ComplexFloatStorage", "C64"),
    DType("complex128", 16, "ComplexDoubleStorage", None),
    DType("uint16", 2, None, "U16"),
    DType("uint32", 4, None, "U32"),
    DType("uint64", 8, None, "U64"),
    DType("float8_e4m3fn", 1, None, "F8_E4M3"),
    DType("float8_e5m2", 1, None, "F8_E5M2"),
    DType("float8_e4m3fnuz", 1, None, "F8_E4M3FNUZ"),
    DType("float8_e5m2fnuz", 1, None, "F8_E5M2FNUZ"),
    DType("float8_e8m0fnu", 1, None, None),
    DType("float4_e2m1fn_x2", 1, None, None),
    DType("complex32", 4, None, None),
)

BY_NAME: dict[str, DType] = {d.name: d for d in TABLE}
BY_STORAGE: dict[str, DType] = {d.storage: d for d in TABLE if d.storage}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in TABLE if d.safetensors}

# numpy.dtype(code) unpickles into an instance of a numpy.dtypes class (numpy 1.25+), which
# torch's weights-only unpickler must also be allowed to build though the pickle never names it:
# the code numpy pickles ("f8") -> that class ("Float64DType").
NUMPY_DTYPE_CLASSES: dict[str, str] = {
    ("b" if d.name == "bool" else d.name[0]) + str(d.itemsize): (
        "UInt" + d.name[4:] if d.name.startswith("uint") else d.name.capitalize()
    )
    + "DType"
    for d in TABLE
    if re.fullmatch(r"float(16|32|64)|u?int(8|16|32|64)|complex(64|128)|bool", d.name)
}
