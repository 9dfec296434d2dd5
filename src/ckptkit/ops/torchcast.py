"""``convert --dtype`` on the torch path: the weights' floating tensors cast with torch's ``.to()``.

The torch-free path casts while it copies (:mod:`ckptkit.formats.cast`, the same values); this is
the path for what only torch reads (legacy files, trusted pickles), and both report through one
:class:`~ckptkit.formats.cast.Cast`.

Example:
    >>> import torch
    >>> from ckptkit.formats.cast import Cast
    >>> cast = Cast("bf16")
    >>> out = cast_tensors({"w": torch.ones(2), "n": torch.zeros(1, dtype=torch.long)}, cast)
    >>> out["w"].dtype, out["n"].dtype, cast.notes()
    (torch.bfloat16, torch.int64, ['cast 1 tensor float32 -> bfloat16 (8 B -> 4 B)'])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..formats.cast import Cast


def cast_tensors(state: Mapping[str, Any], cast: Cast) -> dict[str, Any]:
    """``state`` with each floating tensor ``cast`` wants as ``tensor.to(cast.dtype)``; the rest
    (integer, bool, complex tensors, quantization state, other values) as they are. One tensor under several
    names (tied) is cast once and stays one tensor."""
    cast.refuse_scaled(
        {k: str(v.dtype).removeprefix("torch.") for k, v in state.items() if isinstance(v, torch.Tensor)}
    )
    target = getattr(torch, cast.dtype)
    done: dict[int, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for name, v in state.items():
        before = str(v.dtype).removeprefix("torch.") if isinstance(v, torch.Tensor) else ""
        if not before or not cast.wants(before, name):
            out[name] = v
            continue
        if id(v) not in done:
            done[id(v)] = v.detach().to(target)
        out[name] = done[id(v)]
        cast.record(
            name, before, id(v), v.nelement() * v.element_size(), out[name].nelement() * out[name].element_size()
        )
    return out
