"""Hugging Face sharded folders from torch tensors: the torch side of :mod:`.formats.hf.write`, for
sources only torch reads (legacy files, DCP folders, trusted pickles).

Example:
    >>> save_shards({"w": torch.zeros(2)}, Path("out"), max_shard_size=5 * 10**9)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ._sttorch import save_tensors
from .errors import ArgumentError, summarize
from .formats.hf.write import Written, plan, write_folder
from .formats.source import NeedsTorch


def save_shards(state: Mapping[str, Any], dest: Path, *, max_shard_size: int) -> Written:
    """Write a state dict of tensors as huggingface_hub's sharded safetensors folder at ``dest``.

    Raises:
        ArgumentError: a value is not a tensor.
    """
    bad = [f"{k} ({type(v).__name__})" for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ArgumentError(f"{dest}: Hugging Face shards hold only tensors; not tensors: {summarize(bad)}")
    entries: list[tuple[str, Any, int, Any, bool]] = []
    for name, t in state.items():
        s = t.untyped_storage()
        ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        complete = t.data_ptr() == s.data_ptr() and t.numel() * t.element_size() == s.nbytes()
        entries.append((name, (t.device, s.data_ptr()) if s.nbytes() else None, s.nbytes(), ident, complete))
    try:
        written = plan(entries, max_shard_size=max_shard_size)
    except NeedsTorch:  # views of one storage, not the same one: each is stored as its own tensor
        entries = [(n, ident if storage is not None else None, size, ident, ok) for n, storage, size, ident, ok in entries]
        written = plan(entries, max_shard_size=max_shard_size)
    write_folder(dest, written, lambda f, names, meta: save_tensors(f, {n: state[n] for n in names}, meta))
    return written
