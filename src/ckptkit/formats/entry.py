"""One model of a checkpoint, whatever its format: an object tree whose tensors are entries.

An :class:`Entry` is what every writer needs of a tensor: its dtype, shape and byte count, the
CRC-32 its bytes must have where that is known before they are read, the source offset a copy
should keep within a page, and :meth:`Entry.write`, which appends the bytes to the output and
returns their CRC-32 (checking them against the CRC-32 their source records as it goes).

Every source opens as such a tree: a torch zip or safetensors file and Hugging Face shards
(:mod:`.source`), a DCP folder (:mod:`.dcp.stream`, whose tensors are entries themselves), torch
tensors in memory (``ckptkit.formats.safetensors.torch``). Selection and renaming act on the tree; each output
format then has one writer that takes it: :func:`.safetensors.write_safetensors`,
:func:`.zipwrite.write_torch_zip`, :func:`.hf.write.write_shards`, :func:`.dcp.write.write_dcp_entries`.

Example:
    >>> e = Bytes("uint8", (3,), 3, lambda f, progress: f.write(b"abc"))
    >>> e.nbytes, e.ident is e
    (3, True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ..errors import CheckpointFormatError
from ..io.fileio import Progress


class Entry:
    """What every writer needs of a tensor: its bytes, contiguous and row-major, as safetensors and a
    new torch storage hold them. Subclasses: :class:`Bytes`, and a DCP folder's ``DcpTensor``.

    ``crc``: the CRC-32 the bytes must have, where known before they are read (None: not yet);
    ``ident``: entries
    with equal idents are one tensor (tied), stored once; ``storage``, ``storage_size``,
    ``complete``: the storage it views, that storage's size, and whether it is all of it
    (huggingface_hub's split groups and counts by storage); ``zip``: ``(method, inflated size)``
    for a compressed zip record copied as it is into a torch zip.
    """

    dtype: str  # torch's name: "bfloat16"
    shape: tuple[int, ...]
    nbytes: int
    crc: int | None
    ident: Any
    storage: Any
    storage_size: int
    complete: bool
    zip: tuple[int, int] | None

    def find_crc(self) -> int | None:
        """:attr:`crc`, found now where that reads no tensor bytes (a zip's local header precedes
        its bytes: a CRC patched in later rewrites a page the disk may be writing back)."""
        return self.crc

    def write(self, f: BinaryIO, progress: Progress | None = None) -> int | None:
        """Append the bytes to ``f``; returns their CRC-32 (None: compressed bytes, which the
        source checks). Bytes that differ from what their source records are reported by the
        source's ``damage``, raised once the whole output is written."""
        raise NotImplementedError


@dataclass(eq=False)
class Bytes(Entry):
    """An entry whose bytes ``copy(f, progress)`` appends: a byte range of a file, or memory."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    copy: Callable[[BinaryIO, Progress | None], int | None] = field(repr=False)
    crc: int | None = None
    ident: Any = None
    storage: Any = None
    storage_size: int = -1
    complete: bool = True
    zip: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.ident is None:
            self.ident = self
        if self.storage is None:
            self.storage = self.ident
        if self.storage_size < 0:
            self.storage_size = self.nbytes

    def write(self, f: BinaryIO, progress: Progress | None = None) -> int | None:
        return self.copy(f, progress)


MAX_NESTING = 300  # containers within containers a tree may have (real checkpoints: a few dozen)


def map_entries(node: Any, leaf: Callable[[Any, str], Any], is_leaf: Callable[[Any], bool], path: str = "") -> Any:
    """``node`` with each leaf replaced by ``leaf(value, dotted path)``: containers are rebuilt only
    where something under them changed, so a tree without leaves comes back as it was. A container
    reached twice (a pickle may share one) is mapped once and stays shared, so the work is linear in
    the tree's distinct objects, not in its paths.

    Raises:
        CheckpointFormatError: containers nested deeper than :data:`MAX_NESTING`.

    Example:
        >>> map_entries({"a": [1, 2]}, lambda v, p: v * 10, lambda v: isinstance(v, int))
        {'a': [10, 20]}
    """
    done: dict[int, Any] = {}
    keep: list[Any] = []  # holds each mapped node, so no id in ``done`` is reused while it runs

    def walk(node: Any, path: str, depth: int) -> Any:
        if id(node) in done:
            return done[id(node)]
        if depth > MAX_NESTING:
            raise CheckpointFormatError(
                f"{path}: containers nested more than {MAX_NESTING} deep; ckptkit copies at most {MAX_NESTING} levels"
            )
        if is_leaf(node):
            return leaf(node, path)  # each path its own call: tied tensors are told apart by name
        new: Any
        if isinstance(node, Mapping):
            items = [(k, walk(v, f"{path}.{k}" if path else str(k), depth + 1)) for k, v in node.items()]
            unchanged = all(new is old for (_, new), old in zip(items, node.values(), strict=True))
            new = node if unchanged else type(node)(items)  # type: ignore[call-arg]
        elif isinstance(node, (list, tuple)):
            values = [walk(v, f"{path}.{i}" if path else str(i), depth + 1) for i, v in enumerate(node)]
            if all(new is old for new, old in zip(values, node, strict=True)):
                new = node
            elif isinstance(node, list):
                new = values
            else:
                new = type(node)(*values) if hasattr(node, "_fields") else type(node)(values)
        else:
            return node
        done[id(node)] = new
        keep.append(node)
        return new

    return walk(node, path, 0)
