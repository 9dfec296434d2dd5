"""Read any supported checkpoint as Python objects, safely, onto this rank's device."""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._dcpread import read_dcp
from ._devices import MapLocation, single_device
from ._safety import AllowGlobals
from ._sttorch import load_tensors
from ._torchload import torch_load
from .errors import CheckpointFormatError
from .formats.detect import DCP, HF, SAFETENSORS, detect_format
from .formats.hf.index import check_shard_keys, read_index, shard_note


def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    map_location: MapLocation = None,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    mmap: bool = True,
) -> Any:
    """Load a torch zip or legacy file, a safetensors file, a DCP folder, or Hugging Face shards
    (their folder or index: one state dict, checked against the index) (no model involved).

    Not a collective: each rank reads the file itself. Safe by default: pickles load with
    ``weights_only=True``. A whole pickled module (``torch.save(model, path)``, DDP/DataParallel/
    torch.compile wrapped or not) gives its ``state_dict()``, read without importing its classes
    or running anything.

    Args:
        path: the checkpoint.
        map_location: as ``torch.load``'s; by default storages saved on any accelerator land on
            this rank's device (``cuda:LOCAL_RANK``, or the CPU without CUDA) and CPU storages stay
            on the CPU. Safetensors files and DCP folders take a device.
        trust: allow arbitrary unpickling. Only for files you trust: a pickle can run code.
        allow_globals: classes or functions to admit without trusting everything, as objects
            (``[argparse.Namespace]``) or dotted names (``["argparse.Namespace"]``).
        mmap: memory-map zip checkpoints instead of reading them into memory.

    Raises:
        CheckpointNotFoundError, CheckpointFormatError (damaged, or not a checkpoint),
        UnsupportedCheckpointError (a TorchScript or torch.export archive), UnsafeCheckpointError,
        ClassNotFoundError (a trusted pickle's class cannot be imported), ArgumentError.

    Example:
        >>> ckpt = read_checkpoint("fixtures/train_ckpt.pt", map_location="cpu")  # doctest: +SKIP
        >>> sorted(ckpt)  # doctest: +SKIP
        ['best_loss', 'epoch', 'model', 'optimizer', 'scheduler', 'step']
    """
    source = os.fspath(path)
    if note := shard_note(Path(source)):  # one shard alone loads as a partial model: say so
        warnings.warn(note, stacklevel=2)
    return _read(source, map_location=map_location, trust=trust, allow_globals=allow_globals, mmap=mmap)


def _read(source: str, *, map_location: MapLocation, trust: bool, allow_globals: AllowGlobals, mmap: bool) -> Any:
    fmt = detect_format(source)
    if fmt == HF:
        return _read_shards(source, map_location=map_location, trust=trust, allow_globals=allow_globals, mmap=mmap)
    if fmt == SAFETENSORS:
        return load_tensors(source, device=single_device(map_location, source, "a safetensors file"))[0]
    if fmt == DCP:
        return read_dcp(source, trust=trust, allow_globals=allow_globals, map_location=map_location)
    return torch_load(source, fmt, map_location=map_location, trust=trust, allow_globals=allow_globals, mmap=mmap)


def _read_shards(source: str, **options: Any) -> OrderedDict[str, Any]:
    """Every shard read as a file of its own, checked against the index, in the index's order;
    tied tensors the index records as dropped are the same tensor as the one kept."""
    index = read_index(source)
    shards: dict[str, Any] = {}
    for shard in index.shards:
        path = index.folder / shard
        if detect_format(path) in (HF, DCP):
            raise CheckpointFormatError(f"{index.path}: shard {shard} is not a file of tensors")
        shards[shard] = _read(os.fspath(path), **options)
        if not isinstance(shards[shard], Mapping):
            raise CheckpointFormatError(f"{path}: a shard of {index.path} must hold a mapping of tensors, not a {type(shards[shard]).__name__}")
    check_shard_keys(index, {s: list(sd) for s, sd in shards.items()})
    out: OrderedDict[str, Any] = OrderedDict((k, shards[s][k]) for k, s in index.weight_map.items())
    for alias, kept in index.tied().items():
        out[alias] = out[kept]
    return out
