"""A DCP folder written without torch, as DCP's ``FileSystemWriter`` writes one from one process.

torch's ``dcp.save`` flattens the state dict (:func:`flatten`), writes each item into
``__0_0.distcp`` as ``torch.save`` writes it alone (a tensor as a zip of its own, any other value as
a zip of its pickle), and pickles ``.metadata``: each key's dtype, size and chunk, where its bytes
lie, and its path in the nested state dict. Here each tensor is an :class:`~..entry.Entry` copied
from its source as it is written (a DCP folder split along any dims included), so memory holds
no tensor; ``.metadata`` comes last, and the folder passes ckptkit's own DCP check before it is
published. ``torch.distributed.checkpoint.load`` reads it into a plain model or a sharded one.

Example:
    >>> write_dcp_entries(Path("out.dcp"), {"model": {"w": entry}}, source="model.pt")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from ...errors import ArgumentError
from ...io.atomic import streamed_file
from ...io.atomicdir import atomic_folder
from ...io.fileio import Progress
from ..entry import Entry
from ..pickles.dump import Built, dumps, global_
from ..pickles.reader import Call
from ..torchzip.kept import RecordsKept
from ..torchzip.writer import write_torch_zip
from .check import check_written_dcp
from .detect import DCP_METADATA

DATA_FILE = "__0_0.distcp"  # FileSystemWriter's one file of rank 0
DCP_VERSION = "1.0.0"  # what torch's FileSystemWriter records (torch.distributed.checkpoint.filesystem)
_META = "torch.distributed.checkpoint.metadata"

KeyPath = tuple[str | int, ...]


def flatten(state: Mapping[Any, Any], *, source: str) -> dict[str, tuple[KeyPath, Any]]:
    """``state``'s items as ``dcp.save`` flattens them: each flattened key -> (its path, its value).

    As torch's ``traverse_state_dict``: a mapping's keys become ``str`` path parts; a list that
    holds a tensor or a non-empty container is walked by index; any other list, a tuple, and any
    other value is one item. Keys are the path's parts joined by dots.

    Raises:
        ArgumentError: two paths give one key (``0`` and ``"0"``), a key's value stands where
            another key's path goes on, or a list holds a mapping with no item in it (torch's save
            leaves a gap there that its own reader cannot load, or drops it at the end).

    Example:
        >>> flatten({"opt": {"groups": [{"lr": 0.1}]}, "step": 3}, source="x")
        {'opt.groups.0.lr': (('opt', 'groups', 0, 'lr'), 0.1), 'step': (('step',), 3)}
    """
    items: dict[str, tuple[KeyPath, Any]] = {}
    given: dict[str, tuple[Any, ...]] = {}  # each key's path as the state spells it (for messages)

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any(isinstance(v, Entry) or (isinstance(v, (Mapping, list)) and not terminal(v)) for v in value)

    def walk(path: KeyPath, raw: tuple[Any, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk((*path, str(k)), (*raw, k), v)
        elif terminal(value):
            key = ".".join(map(str, path))
            if key in items:
                _refuse(source, f"{key!r} names two values", given[key], raw)
            items[key], given[key] = (path, value), raw
        else:
            for i, v in enumerate(value):
                before = len(items)
                walk((*path, i), (*raw, i), v)
                if len(items) == before:  # torch's save leaves a gap its reader cannot load, or drops the end
                    where = ".".join(map(str, (*path, i)))
                    raise ArgumentError(
                        f"{source}: {where} is an empty dict (or holds only empty ones) inside a list, which a DCP "
                        "folder cannot hold; write a torch file (DST ending in .pt), or leave it out"
                    )

    for k, v in state.items():
        walk((str(k),), (k,), v)
    leaves = {tuple(map(str, path)): key for key, (path, _) in items.items()}
    for key, (path, _) in items.items():  # a value where another key's path goes on below it
        parts = tuple(map(str, path))
        for n in range(1, len(parts)):
            if parts[:n] in leaves:
                above = leaves[parts[:n]]
                _refuse(source, f"{above!r} is a value and also holds {key!r}", given[above], given[key])
    return items


def _refuse(source: str, what: str, one: tuple[Any, ...], other: tuple[Any, ...]) -> None:
    raise ArgumentError(
        f"{source}: {what} in a DCP folder, whose keys are strings ({_spelled(one)} and {_spelled(other)}); "
        "write a torch file (DST ending in .pt), which keeps both"
    )


def _spelled(raw: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in raw)


def write_dcp_entries(
    dest: Path,
    state: Any,
    *,
    source: str,
    progress: Progress | None = None,
    after: Callable[[], object] = lambda: None,
) -> None:
    """Write ``state`` (a mapping whose tensors are entries) as a DCP folder at ``dest``. ``after()`` runs once every item is written, before anything is
    published (a source's damage check). A folder standing for a store's prefix streams its
    ``.distcp`` there, ``.metadata`` uploaded last, once the folder passes its check.

    Raises:
        ArgumentError: ``state`` is not a mapping, or :func:`flatten` refuses it.
    """
    if not isinstance(state, Mapping):
        raise ArgumentError(f"{dest}: a DCP folder holds a state dict (a mapping), not a {type(state).__name__}")
    items = flatten(state, source=source)
    with atomic_folder(dest, check=lambda tmp: check_written_dcp(tmp, dest=dest)) as tmp:
        data = tmp / DATA_FILE
        archives = RecordsKept()  # begun again at each item's zip
        streamed = streamed_file(data, kept=lambda: archives)
        with streamed if streamed is not None else open(data, "xb") as f:
            stored = _write_items(f, items, archives, progress)
            after()
            if streamed is None:
                f.flush()
                os.fsync(f.fileno())
        with open(tmp / DCP_METADATA, "xb") as f:
            f.write(metadata_bytes(items, stored))
            f.flush()
            os.fsync(f.fileno())


def _write_items(
    f: BinaryIO, items: dict[str, tuple[KeyPath, Any]], archives: RecordsKept, progress: Progress | None
) -> dict[str, tuple[int, int]]:
    """Each item as ``torch.save`` writes it alone, one after another; key -> (offset, length)."""
    stored: dict[str, tuple[int, int]] = {}
    for key, (_, value) in items.items():
        start = f.tell()
        archives.begin(start)
        write_torch_zip(f, value, progress=progress)
        stored[key] = (start, f.tell() - start)
    return stored


def metadata_bytes(items: dict[str, tuple[KeyPath, Any]], stored: dict[str, tuple[int, int]]) -> bytes:
    """``.metadata`` for ``items`` stored in :data:`DATA_FILE` at ``stored``, pickled as torch
    pickles DCP's ``Metadata`` (its dataclasses by ``NEWOBJ`` and their fields), so that torch's
    reader and ckptkit's read it as one torch wrote.

    Example:
        >>> data = metadata_bytes({"step": (("step",), 3)}, {"step": (0, 700)})
        >>> data[:2], b"BytesStorageMetadata" in data
        (b'\\x80\\x02', True)
    """
    size = global_("torch", "Size")
    layout = Call(global_("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Call(global_(_META, "_MEM_FORMAT_ENCODING"), (0,))

    def shape(dims: tuple[int, ...]) -> Call:
        return Call(size, (tuple(dims),))

    entries: dict[str, Any] = {}
    where: dict[Any, Any] = {}
    for key, (_, value) in items.items():
        offset, length = stored[key]
        info = {"relative_path": DATA_FILE, "offset": offset, "length": length}  # torch leaves out None fields
        if isinstance(value, Entry):
            # Five values: torch 2.6's reader unpacks exactly five; later ones also take a sixth,
            # the saved tensor's strides, which no load reads (a new tensor is contiguous anyway).
            props = (global_("torch", value.dtype), layout, False, contiguous, False)
            origin = shape(tuple(0 for _ in value.shape))
            chunk = Built(global_(_META, "ChunkStorageMetadata"), {"offsets": origin, "sizes": shape(value.shape)})
            entries[key] = Built(
                global_(_META, "TensorStorageMetadata"),
                {
                    "properties": Built(global_(_META, "TensorProperties"), props),
                    "size": shape(value.shape),
                    "chunks": [chunk],
                },
            )
            index = {"fqn": key, "offset": origin, "index": 0}
        else:
            entries[key] = Built(global_(_META, "BytesStorageMetadata"), None)
            index = {"fqn": key, "offset": None, "index": None}
        where[Built(global_(_META, "MetadataIndex"), index)] = Built(
            global_("torch.distributed.checkpoint.filesystem", "_StorageInfo"), info
        )
    meta = {
        "state_dict_metadata": entries,
        "planner_data": {key: path for key, (path, _) in items.items()},
        "storage_data": where,
        "storage_meta": None,  # torch's reader fills it in; ckptkit's needs none
        "version": DCP_VERSION,
    }
    pickled, _ = dumps(Built(global_(_META, "Metadata"), meta))
    return pickled
