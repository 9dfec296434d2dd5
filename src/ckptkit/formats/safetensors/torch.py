"""safetensors files from and to torch tensors; the format itself is ``formats.safetensors``.

Tied tensors (exact aliases: same memory, shape, stride and dtype) are stored once and
recorded under ``ckptkit.aliases`` so loading re-ties them, as ``safetensors.torch``'s
``save_model``/``load_model`` do for modules.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ...errors import ArgumentError, CheckpointFormatError, UnsupportedCheckpointError
from ...io.fileio import Progress, local_file, write_checked
from ..entry import Bytes
from ..spec import Placement, WritePlan
from .codec import insert_aliases, parse_aliases, read_header, write_safetensors


def tensor_bytes(t: Any) -> memoryview:
    """The bytes of a CPU contiguous tensor, without copying them."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _write(t: Any, f: BinaryIO, progress: Progress | None) -> int:
    """A tensor's bytes, copied to the CPU (and made contiguous) only now: one at a time in memory."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    return write_checked(f, tensor_bytes(t), progress)  # t stays referenced until the write returns


def entries(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict's tensors as :class:`~.formats.entry.Entry` leaves (other values as they are):
    exact aliases (same memory, shape, stride, dtype: tied weights) share an ident, so every
    writer stores them once."""
    out: dict[str, Any] = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            out[name] = t
            continue
        if is_traceable_wrapper_subclass(t):  # its own storage is a placeholder: the data is in inner tensors
            kind = type(t)
            raise UnsupportedCheckpointError(
                f"{name} is a {kind.__module__.split('.')[0]} {kind.__name__} (a tensor subclass, as torchao's "
                "quantized weights are), which safetensors cannot hold as a plain tensor; write a .pt file instead, "
                "or save it with the library that made it (transformers' save_pretrained writes torchao's layout)"
            )
        s = t.untyped_storage()
        nbytes = t.numel() * t.element_size()
        out[name] = Bytes(
            str(t.dtype).removeprefix("torch."),
            tuple(t.shape),
            nbytes,
            functools.partial(_write, t),
            ident=(t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())),
            storage=(t.device, s.data_ptr()),
            storage_size=s.nbytes(),
            complete=t.data_ptr() == s.data_ptr() and nbytes == s.nbytes(),
        )
    return out


def save_tensors(
    f: BinaryIO, state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None = None, *, source: str = "state dict"
) -> None:
    """Write a mapping of tensors to ``f`` in safetensors format, tied tensors stored once.

    Raises:
        ArgumentError: when a value is not a tensor, or a dtype has no safetensors name.
    """
    if sys.byteorder != "little":
        raise ArgumentError("writing safetensors needs a little-endian machine")
    write_safetensors(f, entries(state_dict), {"format": "pt", **(metadata or {})}, source=source)


def load_tensors(path: str | os.PathLike[str], *, device: str = "cpu") -> tuple[OrderedDict[str, Any], dict[str, str]]:
    """Read a safetensors file into an ordered dict (file order), re-tying recorded aliases.

    Returns:
        ``(tensors, metadata)``.
    """
    source = local_file(path)  # the safetensors package opens the path itself
    with open(source, "rb") as f:
        header, _ = read_header(f, source=source)
    meta: dict[str, str] = dict(header.pop("__metadata__", {}) or {})
    out: OrderedDict[str, Any] = OrderedDict()
    try:
        with safe_open(source, framework="pt", device=device) as sf:
            for name in header:
                out[name] = sf.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointFormatError(f"{source}: {e}") from e
    return insert_aliases(out, parse_aliases(meta, out, source)), meta


def read(
    path: str,
    *,
    fmt: str,
    placement: Placement,
    trust: bool = False,
    allow_globals: Any = (),
    mmap: bool = True,
    zero_weights: str = "fp32",
) -> OrderedDict[str, Any]:
    """A safetensors file's tensors (tied names one tensor again), on the placement's device."""
    return load_tensors(path, device=placement.device(path, "a safetensors file"))[0]


def write(target: BinaryIO | Path, obj: Any, state: Any, *, dest: Path, plan: WritePlan) -> None:
    """``state`` (a mapping of tensors, or a module's state dict) into the open file ``target``."""
    assert not isinstance(target, Path)  # a file format: its writer gets the open file
    if hasattr(state, "state_dict") and hasattr(state, "named_modules"):
        state = state.state_dict()
    if not isinstance(state, Mapping):
        raise ArgumentError(f"{dest}: safetensors holds a mapping of tensors, not a {type(state).__name__}")
    save_tensors(target, state, source=str(dest))
