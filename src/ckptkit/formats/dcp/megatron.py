"""Megatron's ``torch_dist`` checkpoints: DCP folders with Megatron's layers stacked, read as DCP.

megatron-core's ``dist_checkpointing.save`` writes a DCP folder (``.metadata``, ``*.distcp``)
beside ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``) and ``common.pt`` (the
state that is not sharded: a ``torch.save`` file). A ``TransformerBlock`` saves its layers as one
tensor per weight, the layer index first: ``decoder.layers.mlp.linear_fc1.weight`` of shape
``[num_layers, ...]``, each layer a chunk of its own (``prepend_axis_num``), and each layer's
``_extra_state`` as ``decoder.layers.mlp.linear_fc1._extra_state/shard_{layer}_{num_layers}``.
:func:`unstack` gives each layer its own key (``decoder.layers.0.mlp.linear_fc1.weight``), as
Megatron's models name them in memory, by pointing each new key at its layer's chunks: nothing is
read or copied twice.

Example:
    >>> layer_key("decoder.layers.mlp.linear_fc1.weight", 3)
    'decoder.layers.3.mlp.linear_fc1.weight'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import CheckpointFormatError, spell
from ...io.fileio import small_json
from ..producers import Producer
from ..source import NeedsTorch
from .meta import BytesEntry, Chunk, DcpMetadata, TensorEntry

MEGATRON_CONFIG = "metadata.json"  # beside .metadata: which backend wrote the folder
COMMON = "common.pt"  # the state that is not sharded (iteration, args, ...), a torch.save file
_MAX_CONFIG = 1 << 16  # metadata.json is a few fields

# <container>.layers.<weight>, the weight's name not starting with a layer number
_STACKED = re.compile(r"^(?P<block>(?:.+\.)?layers)\.(?P<rest>(?!\d+(?:\.|$)).+)$")
# <container>.layers.<module>._extra_state/shard_<layer>_<layers>: one layer's extra state
_EXTRA = re.compile(r"^(?P<key>.+)/shard_(?P<layer>\d+)_(?P<layers>\d+)$")


def unstack_flag() -> str:
    """The option that unstacks layers, as the caller spells it (the CLI's flag or the keyword)."""
    return spell("unstack_layers=True", "--unstack-layers")


def megatron_backend(folder: Path) -> str | None:
    """``metadata.json``'s ``sharded_backend`` (``"torch_dist"``) where megatron-core wrote the folder."""
    config = small_json(folder / MEGATRON_CONFIG, limit=_MAX_CONFIG)
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    return backend if isinstance(backend, str) else None


def layer_key(key: str, layer: int) -> str:
    """``key`` (``decoder.layers.X``) as layer ``layer``'s own (``decoder.layers.{layer}.X``)."""
    m = _STACKED.match(key)
    assert m is not None, key
    return f"{m['block']}.{layer}.{m['rest']}"


@dataclass(frozen=True)
class Stacks:
    """The stacked tensors of a folder: ``layers``, each block's layer count (``{"decoder.layers": 24}``),
    and ``keys``, the tensor keys stacked along dim 0."""

    layers: dict[str, int]
    keys: list[str]

    def describe(self) -> str:
        blocks = ", ".join(f"{b} ({n} layers)" for b, n in self.layers.items())
        return f"{len(self.keys)} tensors stack the layers of {blocks} along dim 0"


def stacks(shapes: Mapping[str, tuple[int, ...]]) -> Stacks:
    """The tensors (of ``shapes``: each tensor's key and shape) whose first dim is a block's layer
    index (``decoder.layers.X``, X no layer number).

    A block's layer count is its stacked tensors' first dim, which all share; a block whose
    tensors disagree stacks nothing this reader can tell apart from a plain weight, and is left out.
    """
    found: dict[str, set[int]] = {}
    keys: dict[str, list[str]] = {}
    for key, shape in shapes.items():
        if shape and (m := _STACKED.match(key)):
            found.setdefault(m["block"], set()).add(shape[0])
            keys.setdefault(m["block"], []).append(key)
    layers = {b: next(iter(n)) for b, n in found.items() if len(n) == 1}
    return Stacks(layers, [k for b in layers for k in keys[b]])


def _shapes(meta: DcpMetadata) -> dict[str, tuple[int, ...]]:
    return {k: e.shape for k, e in meta.entries.items() if isinstance(e, TensorEntry)}


def extra_state_key(key: str, found: Stacks) -> str | None:
    """The key of one layer's ``_extra_state`` (``.../shard_{layer}_{layers}``) under its layer; None for any other key."""
    m = _EXTRA.match(key)
    block = _STACKED.match(m["key"]) if m else None
    if m and block and found.layers.get(block["block"]) == int(m["layers"]):
        return layer_key(m["key"], int(m["layer"]))
    return None


def no_stacks(folder: str | Path) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{folder}: no tensor stacks layers (keys such as decoder.layers.mlp.linear_fc1.weight, the layer index "
        f"first, as megatron-core's torch_dist saves them): leave {unstack_flag()} out"
    )


def unstack(folder: Path, meta: DcpMetadata) -> tuple[DcpMetadata, Stacks]:
    """``meta`` with each stacked tensor split into one per layer, and each layer's ``_extra_state``
    under its layer's key; every other entry as it was, in order.

    Raises:
        CheckpointFormatError: nothing is stacked, or a chunk spans more than one layer (Megatron
            saves each layer as its own chunk; a copy through it would have to split a chunk).
    """
    found = stacks(_shapes(meta))
    if not found.keys:
        raise no_stacks(folder)
    stacked = set(found.keys)
    entries: dict[str, TensorEntry | BytesEntry] = {}
    paths: dict[str, tuple[str | int, ...]] = {}
    for key, e in meta.entries.items():
        path = meta.paths.get(key, (key,))
        if key in stacked and isinstance(e, TensorEntry):
            for layer in range(e.shape[0]):
                new = layer_key(key, layer)
                entries[new] = TensorEntry(new, e.dtype, e.shape[1:], _layer_chunks(folder, e, layer))
                paths[new] = _moved(path, new, lambda last, layer=layer: layer_key(last, layer))  # type: ignore[misc]
        elif isinstance(e, BytesEntry) and (extra := extra_state_key(key, found)) is not None:
            entries[extra] = BytesEntry(extra, e.stored)
            paths[extra] = _moved(path, extra, lambda last: extra_state_key(last, found))
        else:
            entries[key], paths[key] = e, path
    return DcpMetadata(entries, paths), found


def _moved(path: tuple[str | int, ...], new: str, rename: Any) -> tuple[str | int, ...]:
    """``path`` (a key's place in the nested state dict) with its last part renamed as its key
    is: a key nested under ``model`` stays there."""
    last = path[-1] if path else None
    renamed = rename(last) if isinstance(last, str) and _STACKED.match(last.split("/shard_")[0]) else None
    return (*path[:-1], renamed) if isinstance(renamed, str) else (new,)


def _layer_chunks(folder: Path, e: TensorEntry, layer: int) -> tuple[Chunk, ...]:
    chunks = []
    for c in e.chunks:
        if c.offsets[0] <= layer < c.offsets[0] + c.sizes[0]:
            if c.sizes[0] != 1:  # a layer is part of a chunk's bytes: torch's reader splits the tensor
                raise NeedsTorch(
                    f"tensor {e.fqn}'s chunk at {list(c.offsets)} spans layers {c.offsets[0]} to "
                    f"{c.offsets[0] + c.sizes[0] - 1}"
                )
            chunks.append(Chunk(c.offsets[1:], c.sizes[1:], c.stored, saved=c.sizes))
    return tuple(chunks)


def megatron_producer(folder: Path, meta: DcpMetadata) -> Producer | None:
    """What ``inspect`` says of a folder megatron-core wrote: its backend, stacked layers and ``common.pt``."""
    backend = megatron_backend(folder)
    if backend is None:
        return None
    found = stacks(_shapes(meta))
    notes = []
    if found.keys:
        notes.append(
            f"{found.describe()}: {unstack_flag()} gives each layer its own keys ({layer_key(found.keys[0], 0)}, ...), "
            "as Megatron's models name them in memory"
        )
    if (folder / COMMON).is_file():
        notes.append(
            f"{COMMON} holds the state megatron-core did not shard (iteration, args, ...); convert reads the sharded "
            f"tensors only: ckptkit inspect {folder / COMMON} shows it"
        )
    return Producer("megatron", f"megatron-core dist_checkpointing folder ({backend})", notes=notes)
