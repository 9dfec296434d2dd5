"""ckptkit: PyTorch checkpoints that survive DP/DDP <-> single-device moves, and exact resume.

Everything public is listed in ``__all__``. Attributes are imported on first use (PEP 562), so
``import ckptkit`` does not import torch until a function that needs it is touched.

Example:
    >>> import ckptkit
    >>> dict(ckptkit.strip_prefix({"module.fc.weight": 0}))
    {'fc.weight': 0}
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import (
    ArgumentError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CkptkitError,
    DistributedError,
    LayoutError,
    ResumeError,
    StateDictMismatchError,
    UnsafeCheckpointError,
)

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "save_on_master": "._save",
    "write_checkpoint": "._save",
    "load_for_rank": "._load",
    "read_checkpoint": "._load",
    "device_for_rank": "._load",
    "strip_prefix": "._prefix",
    "add_prefix": "._prefix",
    "detect_prefixes": "._prefix",
    "adapt_state_dict": "._prefix",
    "rewrite_prefixes": "._prefix",
    "PrefixInfo": "._prefix",
    "WRAPPER_PREFIXES": "._prefix",
    "find_model_state": "._layout",
    "unwrap_model": "._unwrap",
    "save_training_state": "._state",
    "load_training_state": "._state",
    "TrainingState": "._state",
    "ResumableDistributedSampler": "._sampler",
    "capture_rng_state": "._rng",
    "restore_rng_state": "._rng",
    "convert_checkpoint": "._convert",
    "ConvertReport": "._convert",
    "inspect_checkpoint": "._inspect",
    "CheckpointSummary": "._inspect",
    "diff_checkpoints": "._diff",
    "DiffReport": "._diff",
    "verify_checkpoint": "._verify",
    "VerifyReport": "._verify",
    "AsyncSaver": "._async",
    "CheckpointFolder": "._folder",
    "StopSignal": "._preempt",
}

__all__ = [
    "ArgumentError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CkptkitError",
    "DistributedError",
    "LayoutError",
    "ResumeError",
    "StateDictMismatchError",
    "UnsafeCheckpointError",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from ._async import AsyncSaver
    from ._convert import ConvertReport, convert_checkpoint
    from ._diff import DiffReport, diff_checkpoints
    from ._folder import CheckpointFolder
    from ._inspect import CheckpointSummary, inspect_checkpoint
    from ._layout import find_model_state
    from ._load import device_for_rank, load_for_rank, read_checkpoint
    from ._preempt import StopSignal
    from ._prefix import (
        WRAPPER_PREFIXES,
        PrefixInfo,
        adapt_state_dict,
        add_prefix,
        detect_prefixes,
        rewrite_prefixes,
        strip_prefix,
    )
    from ._rng import capture_rng_state, restore_rng_state
    from ._sampler import ResumableDistributedSampler
    from ._save import save_on_master, write_checkpoint
    from ._state import TrainingState, load_training_state, save_training_state
    from ._unwrap import unwrap_model
    from ._verify import VerifyReport, verify_checkpoint
