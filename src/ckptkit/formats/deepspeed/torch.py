"""The torch half of DeepSpeed ZeRO folders: the rebuilt state dict as torch tensors.

Example:
    >>> sd = read("ckpt/", fmt="deepspeed", placement=placement)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from typing import Any, Literal

import torch

from ...errors import CheckpointFormatError
from ..safetensors.torch import tensor_bytes
from ..spec import Placement
from .stream import open_deepspeed


def read(
    path: str,
    *,
    fmt: str,
    placement: Placement,
    trust: bool = False,
    allow_globals: Any = (),
    mmap: bool = True,
    zero_weights: Literal["fp32", "module"] = "fp32",
) -> OrderedDict[str, Any]:
    """The folder's weights (tensors and DeepSpeed's own records only, read inertly: ``trust`` has
    nothing to admit), on the placement's device."""
    device = placement.device(path, "a DeepSpeed ZeRO folder")
    return read_deepspeed(path, device=device, zero_weights=zero_weights)


def read_deepspeed(
    path: str | os.PathLike[str], *, device: str = "cpu", zero_weights: Literal["fp32", "module"] = "fp32"
) -> OrderedDict[str, Any]:
    """A DeepSpeed ZeRO folder's weights as tensors: the fp32 state dict DeepSpeed's
    ``zero_to_fp32`` rebuilds (its names, order, dtypes and bits; tied names one tensor), or with
    ``zero_weights="module"`` the 16-bit ``module`` state dict as saved (ZeRO stage 1/2).

    Each tensor is copied from the ranks' partitions through one scratch file into its own memory,
    so no more than the result is held; every byte is checked against its record's CRC-32.

    Raises:
        CheckpointFormatError: files missing, of another checkpoint, or damaged; ArgumentError.

    Example:
        >>> sd = read_deepspeed("ckpt/", device="cpu")  # doctest: +SKIP
    """
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
