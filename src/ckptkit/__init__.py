"""ckptkit: PyTorch checkpoints that survive DP/DDP <-> single-device moves, and exact resume.

The public API is ``__all__`` below, plus two public submodules: :mod:`ckptkit.errors` (every
exception) and :mod:`ckptkit.prefix` (the key-renaming tools). Names are imported on first use
(PEP 562), so ``import ckptkit`` does not import torch until a function that needs it is touched.
Every other name lives in its own module: ``ckptkit.errors.UnsafeCheckpointError``,
``ckptkit.prefix.detect_prefixes``.

Folders by role, each importing only those below it (``tests/test_architecture.py`` holds
this; CONTRIBUTING's "Architecture" section draws the tree): ``cli`` and ``train`` (clients of
this API only), this package, ``ops`` (convert, inspect, verify, read, write, save, load),
``model``, ``distributed`` and ``training``, ``formats`` (one package per format; torch only in
each format's ``torch`` module), ``io`` (files and object stores), ``errors``.

Example:
    >>> import ckptkit
    >>> dict(ckptkit.strip_prefix({"module.fc.weight": 0}))
    {'fc.weight': 0}
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import CkptkitError

__version__ = "0.2.0"

_PUBLIC: dict[str, str] = {
    "save_on_master": ".ops.save",
    "write_checkpoint": ".ops.write",
    "load_for_rank": ".ops.load",
    "read_checkpoint": ".ops.read",
    "device_for_rank": ".distributed.devices",
    "save_training_state": ".ops.save",
    "load_training_state": ".ops.resume",
    "TrainingState": ".ops.resume",
    "ResumableDistributedSampler": ".training.sampler",
    "AsyncSaver": ".ops.async_save",
    "CheckpointFolder": ".ops.folder",
    "StopSignal": ".distributed.preempt",
    "convert_checkpoint": ".ops.convert",
    "inspect_checkpoint": ".ops.inspect",
    "diff_checkpoints": ".ops.diff",
    "verify_checkpoint": ".ops.verify",
    "check_adapter": ".ops.adapter",
    "unwrap_model": ".model.unwrap",
    "strip_prefix": ".prefix",
    "add_prefix": ".prefix",
    # What the operations return: typed, so callers can annotate against them.
    "ConvertReport": ".ops.reports",
    "VerifyReport": ".ops.verify",
    "DiffReport": ".ops.diff",
    "CheckpointSummary": ".ops.inspect",
    "AdapterReport": ".ops.adapter",
}

# The public submodules, imported on first use like the names above.
_SUBMODULES = ("errors", "prefix")

__all__ = ["CkptkitError", "__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value: Any = importlib.import_module(f".{name}", __name__)
    elif name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    else:
        raise AttributeError(f"module 'ckptkit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


if TYPE_CHECKING:
    from .distributed.devices import device_for_rank
    from .distributed.preempt import StopSignal
    from .model.unwrap import unwrap_model
    from .ops.adapter import AdapterReport, check_adapter
    from .ops.async_save import AsyncSaver
    from .ops.convert import convert_checkpoint
    from .ops.diff import DiffReport, diff_checkpoints
    from .ops.folder import CheckpointFolder
    from .ops.inspect import CheckpointSummary, inspect_checkpoint
    from .ops.load import load_for_rank
    from .ops.read import read_checkpoint
    from .ops.reports import ConvertReport
    from .ops.resume import TrainingState, load_training_state
    from .ops.save import save_on_master, save_training_state
    from .ops.verify import VerifyReport, verify_checkpoint
    from .ops.write import write_checkpoint
    from .prefix import add_prefix, strip_prefix
    from .training.sampler import ResumableDistributedSampler
