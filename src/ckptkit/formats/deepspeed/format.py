"""DeepSpeed ZeRO folders, as the registry knows them (read, never written)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from ...io.fileio import Progress
from ..integrity import Check
from ..spec import CheckpointFormat, View
from . import zero_checks
from .detect import SIGNATURE
from .stream import open_deepspeed


def check(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    return zero_checks(p, full=full, progress=progress)


def _open(path: Path, *, zero_weights: Literal["fp32", "module"] = "fp32", **_: Any) -> View:
    return open_deepspeed(path, zero_weights=zero_weights)


DEEPSPEED_FORMAT = CheckpointFormat(
    signature=SIGNATURE,
    package="ckptkit.formats.deepspeed",
    check=check,
    open=_open,
    trust_matters=False,  # tensors and DeepSpeed's own records only, read inertly: nothing to trust
)
