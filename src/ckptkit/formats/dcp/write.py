"""A DCP folder written without torch, as DCP's ``FileSystemWriter`` writes one from one process.

torch's ``dcp.save`` flattens the state dict (:func:`flatten`), writes each item into
``__0_0.distcp`` as ``torch.save`` writes it alone (a tensor as a zip of its own, any other value as
a zip of its pickle), and pickles ``.metadata``: each key's dtype, size and chunk, where its bytes
lie, and its path in the nested state dict. Here each tensor is an :class:`~..entry.Entry` copied
from its source as it is written (a DCP folder split along any dims included), so memory holds
no tensor; ``.metadata`` comes last, and the folder passes ckptkit's own DCP check before it is
published. ``torch.distributed.checkpoint.load`` reads it into a plain model or a sharded one.
Written by several processes (``convert --workers``, or ranks), the tensors are split among one
``.distcp`` per process, named as DCP names each rank's.

Example:
    >>> write_dcp_entries(Path("out.dcp"), {"model": {"w": entry}}, source="model.pt")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ...errors import ArgumentError
from ...io.atomic import streamed_file
from ...io.atomicdir import atomic_folder
from ...io.fileio import Progress
from ..entry import Entry
from ..pickles.dump import Built, dumps, global_
from ..pickles.reader import Call
from ..spec import WritePlan, balanced
from ..torchzip.kept import RecordsKept
from ..torchzip.writer import write_torch_zip
from .check import check_written_dcp
from .detect import DCP_METADATA

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


def data_file(rank: int) -> str:
    """The ``.distcp`` file FileSystemWriter names for ``rank`` (its first thread's)."""
    return f"__{rank}_0.distcp"


def write_dcp_entries(
    dest: Path,
    state: Any,
    *,
    source: str,
    progress: Progress | None = None,
    after: Callable[[], object] = lambda: None,
    plan: WritePlan | None = None,
) -> None:
    """Write ``state`` (a mapping whose tensors are entries) as a DCP folder at ``dest``. ``after()`` runs once every item is written, before anything is
    published (a source's damage check). A folder standing for a store's prefix streams its
    ``.distcp`` files there, ``.metadata`` uploaded last, once the folder passes its check.

    With ``plan.workers`` above 1, the tensors are split among that many ``.distcp`` files by
    bytes, named as ranks' files are (:func:`data_file`), and ``plan.spread`` has the other
    processes write all but the first into the same temp folder while this one writes it, with
    every non-tensor value (as DCP's rank 0 does). ``.metadata`` is written from what each reported
    of its items' places once every file is complete and durable; any failure leaves no folder.
    A worker (``plan.part``) writes only its files and reports their items' places
    (``part.reported``).

    Raises:
        ArgumentError: ``state`` is not a mapping, or :func:`flatten` refuses it.
    """
    if not isinstance(state, Mapping):
        raise ArgumentError(f"{dest}: a DCP folder holds a state dict (a mapping), not a {type(state).__name__}")
    items = flatten(state, source=source)
    files = split(items, plan.workers if plan is not None else 1)
    part = plan.part if plan is not None else None
    if part is not None:  # a worker: the first process checks and publishes
        part.take(dest, files)
        part.reported = {}
        for name in part.files:
            part.reported |= _write_file(part.folder / name, {k: items[k] for k in files[name]}, progress, after)
        return
    spread = plan.spread if plan is not None else None
    with atomic_folder(dest, check=lambda tmp: check_written_dcp(tmp, dest=dest)) as tmp:
        first, *others = files
        finish = spread(tmp, [[name] for name in others]) if spread is not None else None
        try:
            stored = _write_file(tmp / first, {k: items[k] for k in files[first]}, progress, after)
        except BaseException:
            if finish is not None:
                finish(False)
            raise
        if finish is not None:
            for reported in finish(True):
                stored |= reported
        with open(tmp / DCP_METADATA, "xb") as f:
            f.write(metadata_bytes(items, stored))
            f.flush()
            os.fsync(f.fileno())


def split(items: dict[str, tuple[KeyPath, Any]], count: int) -> dict[str, list[str]]:
    """``items``' keys split among at most ``count`` files (:func:`data_file`), never more than
    there are tensors holding bytes: those about equal in bytes (:func:`~..spec.balanced`), every
    other value (empty tensors too) in the first file. Each file keeps the items' order.

    Example:
        >>> split({"a": (("a",), 1)}, 4)
        {'__0_0.distcp': ['a']}
    """
    tensors = {k: v.nbytes for k, (_, v) in items.items() if isinstance(v, Entry) and v.nbytes}
    count = max(1, min(count, len(tensors)))  # each file holds bytes: an empty tensor goes with the values
    owner = balanced(tensors, count)
    return {data_file(i): [k for k in items if owner.get(k, 0) == i] for i in range(count)}


def _write_file(
    path: Path, items: dict[str, tuple[KeyPath, Any]], progress: Progress | None, after: Callable[[], object]
) -> dict[str, tuple[str, int, int]]:
    """``items`` written into the new ``.distcp`` file ``path``, durable when this returns (or
    streamed and committed); key -> (file, offset, length)."""
    stored: dict[str, tuple[str, int, int]] = {}
    archives = RecordsKept()  # begun again at each item's zip
    streamed = streamed_file(path, kept=lambda: archives)
    with streamed if streamed is not None else open(path, "xb") as f:
        for key, (_, value) in items.items():  # each as torch.save writes it alone, one after another
            start = f.tell()
            archives.begin(start)
            write_torch_zip(f, value, progress=progress)
            stored[key] = (path.name, start, f.tell() - start)
        after()
        if streamed is None:
            f.flush()
            os.fsync(f.fileno())
    return stored


def metadata_bytes(items: dict[str, tuple[KeyPath, Any]], stored: dict[str, tuple[str, int, int]]) -> bytes:
    """``.metadata`` for ``items`` stored at ``stored`` (key -> file, offset, length), pickled as torch
    pickles DCP's ``Metadata`` (its dataclasses by ``NEWOBJ`` and their fields), so that torch's
    reader and ckptkit's read it as one torch wrote.

    Example:
        >>> data = metadata_bytes({"step": (("step",), 3)}, {"step": ("__0_0.distcp", 0, 700)})
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
        file, offset, length = stored[key]
        info = {"relative_path": file, "offset": offset, "length": length}  # torch leaves out None fields
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
