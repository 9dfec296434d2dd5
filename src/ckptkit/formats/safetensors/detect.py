"""safetensors as detection sees it: an 8-byte little-endian header length, then a JSON object
that fits the file.

Example:
    >>> import struct
    >>> from pathlib import Path
    >>> SIGNATURE.matches(Path("x.safetensors"), struct.pack("<Q", 2) + b"{}")  # doctest: +SKIP
    True
"""

from __future__ import annotations

import struct
from pathlib import Path

from ..detect import Signature

SAFETENSORS = "safetensors"


def _matches(p: Path, head: bytes) -> bool:
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 8 + n <= p.stat().st_size


SIGNATURE = Signature(SAFETENSORS, "a safetensors file", _matches)
