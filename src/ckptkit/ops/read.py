"""Read any supported checkpoint as Python objects, safely, onto this rank's device."""

from __future__ import annotations

import os
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from ..distributed.devices import MapLocation, single_device
from ..errors import CheckpointFormatError
from ..formats.deepspeed.files import refuse_rank_file
from ..formats.deepspeed.stream import open_deepspeed
from ..formats.detect import DCP, DEEPSPEED, HF, SAFETENSORS, ZIP, detect_format
from ..formats.hf.index import check_shard_keys, read_index, shard_note
from ..formats.safetensors.torch import load_tensors, tensor_bytes
from ..io.remote import is_url, staged_read
from .dcp_read import read_dcp
from .safety import AllowGlobals
from .torchload import torch_load


def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    map_location: MapLocation = None,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    mmap: bool = True,
) -> Any:
    """Load a torch zip or legacy file, a safetensors file, a DCP folder, Hugging Face shards
    (their folder or index: one state dict, checked against the index), or a DeepSpeed ZeRO
    folder (the fp32 state dict ``zero_to_fp32`` rebuilds: :func:`read_deepspeed`) (no model involved).

    Not a collective: each rank reads the file itself. Safe by default: pickles load with
    ``weights_only=True``. A whole pickled module (``torch.save(model, path)``, DDP/DataParallel/
    torch.compile wrapped or not) gives its ``state_dict()``, read without importing its classes
    or running anything.

    Args:
        path: the checkpoint; or an object's URL (``s3://bucket/key.pt``, any fsspec URL), staged
            through a local file that is removed before this returns.
        map_location: as ``torch.load``'s; by default storages saved on any accelerator land on
            this rank's device (``cuda:LOCAL_RANK``, or the CPU without CUDA) and CPU storages stay
            on the CPU. Safetensors files and DCP folders take a device.
        trust: allow arbitrary unpickling. Only for files you trust: a pickle can run code.
        allow_globals: classes or functions to admit without trusting everything, as objects
            (``[argparse.Namespace]``) or dotted names (``["argparse.Namespace"]``).
        mmap: memory-map zip checkpoints instead of reading them into memory.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        CheckpointFormatError: damaged, or not a checkpoint.
        UnsupportedCheckpointError: a TorchScript or torch.export archive.
        UnsafeCheckpointError: the pickle needs globals that were not admitted.
        ClassNotFoundError: a trusted pickle's class cannot be imported.
        ArgumentError: an option that cannot apply.
        PartialCheckpointError: one ZeRO-3 rank's file (the message names the folder to give).

    Example:
        >>> ckpt = read_checkpoint("fixtures/train_ckpt.pt", map_location="cpu")  # doctest: +SKIP
        >>> sorted(ckpt)  # doctest: +SKIP
        ['best_loss', 'epoch', 'model', 'optimizer', 'scheduler', 'step']
    """
    if is_url(path):
        with staged_read(path) as local:
            return _read(
                os.fspath(local), map_location=map_location, trust=trust, allow_globals=allow_globals, mmap=mmap
            )
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
    if fmt == DEEPSPEED:  # tensors and DeepSpeed's own records only, read inertly: nothing to trust
        return read_deepspeed(source, map_location=map_location)
    if fmt == ZIP:  # an intact torch zip, but its weights are 0-element placeholders
        refuse_rank_file(Path(source))
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
            raise CheckpointFormatError(
                f"{path}: a shard of {index.path} must hold a mapping of tensors, not a {type(shards[shard]).__name__}"
            )
    check_shard_keys(index, {s: list(sd) for s, sd in shards.items()})
    out: OrderedDict[str, Any] = OrderedDict((k, shards[s][k]) for k, s in index.weight_map.items())
    for alias, kept in index.tied().items():
        out[alias] = out[kept]
    return out


def read_deepspeed(
    path: str | os.PathLike[str], *, map_location: MapLocation = None, zero_weights: Literal["fp32", "module"] = "fp32"
) -> OrderedDict[str, Any]:
    """A DeepSpeed ZeRO folder's weights as tensors: the fp32 state dict DeepSpeed's
    ``zero_to_fp32`` rebuilds (its names, order, dtypes and bits; tied names one tensor), or with
    ``zero_weights="module"`` the 16-bit ``module`` state dict as saved (ZeRO stage 1/2).

    Each tensor is copied from the ranks' partitions through one scratch file into its own memory,
    so no more than the result is held; every byte is checked against its record's CRC-32.

    Raises:
        CheckpointFormatError: files missing, of another checkpoint, or damaged; ArgumentError.

    Example:
        >>> sd = read_deepspeed("ckpt/", map_location="cpu")  # doctest: +SKIP
    """
    device = single_device(map_location, os.fspath(path), "a DeepSpeed ZeRO folder")
    src = open_deepspeed(path, zero_weights=zero_weights)
    out: OrderedDict[str, Any] = OrderedDict()
    made: dict[int, Any] = {}
    try:
        with tempfile.TemporaryFile() as scratch:  # the copy writes to a file: the kernel's copy, CRC'd
            for name, e in src.obj.items():
                if id(e) not in made:
                    t = torch.empty(e.shape, dtype=getattr(torch, e.dtype))
                    scratch.seek(0)
                    scratch.truncate()
                    e.write(scratch)
                    scratch.seek(0)
                    if scratch.readinto(tensor_bytes(t)) != e.nbytes:
                        raise CheckpointFormatError(f"{src.folder}: tensor {name}: fewer bytes than its {e.nbytes}")
                    made[id(e)] = t.to(device) if device != "cpu" else t
                out[name] = made[id(e)]
        src.damage.raise_if_any()
    finally:
        src.close()
    return out
