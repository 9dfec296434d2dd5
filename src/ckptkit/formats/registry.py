"""The one registry of checkpoint formats: the operations ask it, never a format's name.

Each format's package describes itself with one :class:`~.spec.CheckpointFormat` in its
``format.py``; adding a format is that package plus one line in :data:`FORMATS`. A path is the
first format in :data:`FORMATS` whose signature it matches.

Example:
    >>> for_suffix("model.SafeTensors").name, for_suffix("model_best.pth.tar").name
    ('safetensors', 'torch-zip')
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ArgumentError
from .dcp.format import DCP_FORMAT
from .deepspeed.format import DEEPSPEED_FORMAT
from .detect import detect_format
from .hf.format import HF_FORMAT
from .safetensors.format import SAFETENSORS_FORMAT
from .spec import CheckpointFormat
from .torchzip.format import TORCH_LEGACY, TORCH_ZIP

# In the order detection asks them: a folder holding DCP's .metadata and HF shards is a DCP folder.
FORMATS: dict[str, CheckpointFormat] = {
    f.name: f for f in (TORCH_ZIP, TORCH_LEGACY, SAFETENSORS_FORMAT, DCP_FORMAT, HF_FORMAT, DEEPSPEED_FORMAT)
}

# An output's suffix (lowercase) -> its format.
SUFFIXES: dict[str, CheckpointFormat] = {s: f for f in FORMATS.values() for s in f.suffixes}


def get(name: str) -> CheckpointFormat:
    """The format named ``name`` (``"dcp"``)."""
    return FORMATS[name]


def detect(path: str | os.PathLike[str]) -> CheckpointFormat:
    """The format ``path`` holds: the first whose signature it matches.

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        UnsupportedCheckpointError: an intact file of a kind ckptkit does not read (a
            TorchScript or torch.export archive).
        CheckpointFormatError: not a checkpoint of any format here.
    """
    return FORMATS[detect_format(path, [f.signature for f in FORMATS.values()])]


def for_suffix(path: str | os.PathLike[str], *, default: str | None = TORCH_ZIP.name) -> CheckpointFormat:
    """The format a destination's suffix names (case-insensitive); ``default`` for other suffixes
    (None: refuse them).

    Raises:
        ArgumentError: an unknown suffix and no default.
    """
    suffix = Path(path).suffix.lower()
    fmt = SUFFIXES.get(suffix) or (FORMATS[default] if default is not None else None)
    if fmt is None:
        raise ArgumentError(f"{path}: unknown output suffix {suffix or '(none)'!r}; use one of {', '.join(SUFFIXES)}")
    return fmt
