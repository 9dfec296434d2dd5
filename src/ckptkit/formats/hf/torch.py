"""Hugging Face sharded folders from torch tensors: the torch side of :mod:`.formats.hf.write`, for
sources only torch reads (legacy files, DCP folders, trusted pickles).

Example:
    >>> save_shards({"w": torch.zeros(2)}, Path("out"), max_shard_size=5 * 10**9)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..safetensors.torch import entries
from ..source import NeedsTorch
from .write import Written, write_shards


def save_shards(state: Mapping[str, Any], dest: Path, *, max_shard_size: int) -> Written:
    """Write a state dict of tensors as huggingface_hub's sharded safetensors folder at ``dest``.

    Raises:
        ArgumentError: a value is not a tensor.
    """
    tensors = entries(state)
    try:
        return write_shards(dest, tensors, max_shard_size=max_shard_size, source=str(dest))
    except NeedsTorch:  # views of one storage, not the same one: each is stored as its own tensor
        return write_shards(dest, tensors, max_shard_size=max_shard_size, source=str(dest), views=True)
