"""safetensors files from and to torch tensors; the format itself is ``formats.safetensors``.

Tied tensors (exact aliases: same memory, shape, stride and dtype) are stored once and
recorded under ``ckptkit.aliases`` so loading re-ties them, as ``safetensors.torch``'s
``save_model``/``load_model`` do for modules.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from .errors import ArgumentError, CheckpointFormatError, summarize
from .formats.dtypes import BY_NAME
from .formats.safetensors import ALIASES_KEY, insert_aliases, parse_aliases, read_header, write_with_crcs
from .io.fileio import crc32


def torch_dtype_codes() -> dict[Any, str]:
    """``{torch.float32: "F32", ...}`` for every dtype of this torch that safetensors stores."""
    return {getattr(torch, d.name): d.safetensors for d in BY_NAME.values() if d.safetensors and hasattr(torch, d.name)}


def find_aliases(state_dict: Mapping[str, Any]) -> dict[str, str]:
    """Map each key whose tensor is an exact alias (same memory, shape, stride, dtype) of an
    earlier key to that earlier key: tied embeddings and the like."""
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for key, t in state_dict.items():
        if t.numel() == 0:
            continue
        ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if ident in first:
            aliases[key] = first[ident]
        else:
            first[ident] = key
    return aliases


def _raw(t: Any) -> memoryview:
    """The bytes of a CPU contiguous tensor, without copying them."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def save_tensors(f: BinaryIO, state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> None:
    """Write a mapping of tensors to ``f`` in safetensors format, tied tensors stored once.

    Raises:
        ArgumentError: when a value is not a tensor, or a dtype has no safetensors name.
    """
    if sys.byteorder != "little":
        raise ArgumentError("writing safetensors needs a little-endian machine")
    bad = [f"{k} ({type(v).__name__})" for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ArgumentError(
            f"safetensors holds only tensors, but {len(bad)} entries are not: {summarize(bad)}; "
            "save them with a .pt suffix, or pass only the model state dict"
        )
    names = torch_dtype_codes()
    unknown = [f"{k} ({v.dtype})" for k, v in state_dict.items() if v.dtype not in names]
    if unknown:
        raise ArgumentError(f"safetensors has no dtype for {summarize(unknown)}; use a .pt suffix")
    aliases = find_aliases(state_dict)
    keep = [(k, v) for k, v in state_dict.items() if k not in aliases]
    meta = {"format": "pt", **(metadata or {})}
    if aliases:
        # {alias: [target, position in the original order]} so loading restores order too.
        position = {k: i for i, k in enumerate(state_dict)}
        meta[ALIASES_KEY] = json.dumps({a: [t, position[a]] for a, t in aliases.items()})
    entries = [(k, names[v.dtype], list(v.shape), v.numel() * v.element_size()) for k, v in keep]

    def write_data(crcs: dict[str, int]) -> None:
        for name, t in keep:
            t = t.detach()
            if t.device.type != "cpu":
                t = t.to("cpu")
            t = t.contiguous()
            raw = _raw(t)  # t stays referenced until the write returns
            crcs[name] = crc32(raw)
            f.write(raw)

    write_with_crcs(f, entries, meta, write_data)


def load_tensors(path: str | os.PathLike[str], *, device: str = "cpu") -> tuple[OrderedDict[str, Any], dict[str, str]]:
    """Read a safetensors file into an ordered dict (file order), re-tying recorded aliases.

    Returns:
        ``(tensors, metadata)``.
    """
    source = os.fspath(path)
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
