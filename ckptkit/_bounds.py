"""Refuse a torch checkpoint whose pickle declares storages larger than the bytes behind them.

torch allocates each storage at the size its pickle declares before reading the bytes, so
one flipped bit in a size can ask for terabytes. Walking the pickle through ckptkit's inert
stand-ins first (nothing is imported or run) checks every declared size against its zip
record, or for the legacy format against the file, as soon as the reference is read: a huge
storage placed before a forbidden global is caught too.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import _lazy_pickle as lp
from ._errors import CheckpointFormatError
from ._formats import LEGACY, ZIP, ClampedReader
from ._torchzip import TorchZip


def check_storage_bounds(path: str | os.PathLike[str], fmt: str) -> None:
    """Raise CheckpointFormatError if a declared storage cannot fit its bytes.

    Stops quietly at a global the stand-ins do not model: torch's weights-only loader refuses
    it before reading further, and with ``trust`` the caller accepted arbitrary pickles.
    """
    p = Path(path)
    if fmt == ZIP:
        z = TorchZip(p)

        def check_zip(ref: lp.StorageRef) -> None:
            need, have = lp.storage_nbytes(ref), z.storage(ref.key).size
            if need > have:
                raise CheckpointFormatError(f"{p}: storage {ref.key} declares {need} bytes but its record holds {have}")

        source: bytes | object = z.read(f"{z.prefix}data.pkl")
        _walk(source, check_zip)
    elif fmt == LEGACY:
        size = p.stat().st_size

        def check_legacy(ref: lp.StorageRef) -> None:
            if lp.storage_nbytes(ref) > size:
                raise CheckpointFormatError(
                    f"{p}: storage {ref.key} declares {lp.storage_nbytes(ref)} bytes, more than the whole file ({size})"
                )

        with open(p, "rb") as f:
            reader = ClampedReader(f)
            for _ in range(3):  # magic number, protocol version, system info: plain values
                _walk(reader, None)
            _walk(reader, check_legacy)


def _walk(source: object, check: object) -> None:
    try:
        lp.loads(source, on_storage=check)  # type: ignore[arg-type]
    except lp.UnsupportedGlobal:
        return
