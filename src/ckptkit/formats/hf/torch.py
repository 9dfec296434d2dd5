"""The torch half of Hugging Face shards: a folder (or index) read as one state dict, checked
against its index, and sharded folders written from torch tensors (:mod:`.write`'s writer, for
sources only torch reads: legacy files, DCP folders, trusted pickles).

Example:
    >>> save_shards({"w": torch.zeros(2)}, Path("out"), max_shard_size=5 * 10**9)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from ...errors import CheckpointFormatError
from ..deepspeed.files import refuse_rank_file
from ..safetensors.detect import SAFETENSORS
from ..safetensors.torch import entries
from ..safetensors.torch import read as safetensors_read
from ..source import NeedsTorch
from ..spec import Placement, WritePlan
from ..torchzip.detect import LEGACY, ZIP
from ..torchzip.torch import read as zip_read
from .detect import shard_format
from .index import check_shard_keys, read_index
from .write import Written, write_shards


def save_shards(state: Mapping[str, Any], dest: Path, *, max_shard_size: int, plan: WritePlan | None = None) -> Written:
    """Write a state dict of tensors as huggingface_hub's sharded safetensors folder at ``dest``
    (with ``plan``'s other files, ``config.json``).

    Raises:
        ArgumentError: a value is not a tensor.
    """
    tensors = entries(state)
    try:
        return write_shards(dest, tensors, max_shard_size=max_shard_size, source=str(dest), write_plan=plan)
    except NeedsTorch:  # views of one storage, not the same one: each is stored as its own tensor
        return write_shards(dest, tensors, max_shard_size=max_shard_size, source=str(dest), views=True, write_plan=plan)


def write(target: BinaryIO | Path, obj: Any, state: Any, *, dest: Path, plan: WritePlan) -> Written:
    """The weights ``state`` as a sharded safetensors folder at ``target``."""
    assert isinstance(target, Path)  # a folder: its writer owns the temp folder and the swap
    return save_shards(state, target, max_shard_size=plan.max_shard_size, plan=plan)


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
    """Every shard read as a file of its own, checked against the index, in the index's order;
    tied tensors the index records as dropped are the same tensor as the one kept."""
    index = read_index(path)
    shards: dict[str, Any] = {}
    for shard in index.shards:
        file = index.folder / shard
        shard_fmt = shard_format(index.path, index.folder, shard)
        if shard_fmt == ZIP:
            refuse_rank_file(file)
        options = {"trust": trust, "allow_globals": allow_globals, "mmap": mmap}
        shards[shard] = _SHARD_READERS[shard_fmt](os.fspath(file), fmt=shard_fmt, placement=placement, **options)
        if not isinstance(shards[shard], Mapping):
            raise CheckpointFormatError(
                f"{file}: a shard of {index.path} must hold a mapping of tensors, not a {type(shards[shard]).__name__}"
            )
    check_shard_keys(index, {s: list(sd) for s, sd in shards.items()})
    out: OrderedDict[str, Any] = OrderedDict((k, shards[s][k]) for k, s in index.weight_map.items())
    for alias, kept in index.tied().items():
        out[alias] = out[kept]
    return out


# What a shard may be, and its reader.
_SHARD_READERS: dict[str, Any] = {ZIP: zip_read, LEGACY: zip_read, SAFETENSORS: safetensors_read}
