"""ckptkit: PyTorch checkpoints that survive DP/DDP <-> single-device moves, and exact resume.

The public API is ``__all__`` below, plus two public submodules: :mod:`ckptkit.errors` (every
exception) and :mod:`ckptkit.prefix` (the key-renaming tools). Names are imported on first use
(PEP 562), so ``import ckptkit`` does not import torch until a function that needs it is touched.
Every other name lives in its own module: ``ckptkit.errors.UnsafeCheckpointError``,
``ckptkit.prefix.detect_prefixes``.

Layers, each importing only its own and those below it (``tests/test_architecture.py`` holds
this; README's "Architecture" section lists every module):

3. ``ckptkit.cli`` and ``ckptkit.train``: clients of the public API only;
2. the public API's front: this package, ``_convert``, ``_inspect``, ``_diff``, ``_load``;
1. ``ckptkit.distributed`` (collectives, the rank-0 protocol, async saving, checkpoint folders,
   preemption) beside the read/write/verify/state/fit/prefix/RNG/sampler modules;
0. ``ckptkit.errors`` and ``ckptkit.formats``: torch-free readers and writers; never torch.

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
    "save_on_master": ".distributed.rank0",
    "write_checkpoint": "._write",
    "load_for_rank": "._load",
    "read_checkpoint": "._read",
    "device_for_rank": "._devices",
    "save_training_state": "._state",
    "load_training_state": "._resume",
    "TrainingState": "._resume",
    "ResumableDistributedSampler": "._sampler",
    "AsyncSaver": ".distributed.async_save",
    "CheckpointFolder": ".distributed.folder",
    "StopSignal": ".distributed.preempt",
    "convert_checkpoint": "._convert",
    "inspect_checkpoint": "._inspect",
    "diff_checkpoints": "._diff",
    "verify_checkpoint": "._verify",
    "unwrap_model": "._unwrap",
    "strip_prefix": ".prefix",
    "add_prefix": ".prefix",
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
    from ._convert import convert_checkpoint
    from ._devices import device_for_rank
    from ._diff import diff_checkpoints
    from ._inspect import inspect_checkpoint
    from ._load import load_for_rank
    from ._read import read_checkpoint
    from ._resume import TrainingState, load_training_state
    from ._sampler import ResumableDistributedSampler
    from ._state import save_training_state
    from ._unwrap import unwrap_model
    from ._verify import verify_checkpoint
    from ._write import write_checkpoint
    from .distributed.async_save import AsyncSaver
    from .distributed.folder import CheckpointFolder
    from .distributed.preempt import StopSignal
    from .distributed.rank0 import save_on_master
    from .prefix import add_prefix, strip_prefix
