"""Write a Hugging Face sharded folder, as ``huggingface_hub.save_torch_state_dict`` does, atomically.

Same split, file names, ``{"format": "pt"}`` shard metadata and index; tied tensors stored once
under the name sorted first, the others recorded in the index metadata (in the one file's
metadata when there is one shard). Each shard also records ckptkit's per-tensor CRC-32s, so
``ckptkit verify`` sees a flipped bit. :func:`write_shards` takes :class:`~..entry.Entry`
tensors, from any source (a file's byte ranges, a DCP folder's chunks, torch tensors), and
writes each shard with :func:`~..safetensors.write_safetensors`.

Example:
    >>> write_shards(Path("out"), entries, max_shard_size=5 * 10**9, source="ddp.pt")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ...errors import ArgumentError, summarize
from ...io.atomicdir import atomic_folder, check_folder_destination
from ...io.fileio import Progress
from ..entry import Entry
from ..integrity import check_written
from ..safetensors.codec import write_safetensors
from ..source import NeedsTorch
from .detect import HF, HF_INDEXES
from .index import HF_FILE, drop_tied, index_bytes, split

_OPEN_AT_MOST = 64  # shard files kept open for their fsync at the end (well under any descriptor limit)


@dataclass
class Written:
    """What was written: ``files`` (shard file -> tensor names), ``total_size`` (the index's),
    ``tied`` ({dropped name: kept name})."""

    files: dict[str, list[str]]
    total_size: int
    tied: dict[str, str]


def check_destination(src: Path, dest: Path, *, force: bool) -> None:
    """Raise unless ``dest`` may become a sharded folder (see :func:`.atomicdir.check_folder_destination`)."""
    check_folder_destination(
        src, dest, force=force, owned=lambda n: bool(HF_FILE.match(n)), what="Hugging Face weight files"
    )


def write_folder(
    dest: Path,
    written: Written,
    write_shard: Callable[[BinaryIO, list[str], dict[str, str]], object],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``written``'s shards (``write_shard(file, names, metadata)`` fills each) and its index
    into a temp folder that becomes ``dest`` once every file is complete and durable. Every shard
    carries ``metadata`` (the source's: torchao's description of its tensors, transformers'
    ``format``), as transformers' own sharded save does.

    The files are fsynced once all are written, not each before the next is begun: an fsync
    waits for its file's last bytes to reach the disk, time the next shard's copy can use
    (BENCHMARKS.md). Each is fsynced through the descriptor that wrote it, which is sure to
    hear of a failed writeback (a reopened one may not, if the file left memory between); past
    ``_OPEN_AT_MOST`` files the oldest is synced and closed early."""
    one = len(written.files) == 1
    meta = {"format": "pt", **(metadata or {}), **(written.tied if one else {})}
    with (
        atomic_folder(dest, check=lambda tmp: check_written(tmp, HF, dest=dest)) as tmp,
        contextlib.ExitStack() as files,
    ):  # files close before the folder's rename
        unsynced: list[BinaryIO] = []
        for file in [*written.files, *([] if one else [HF_INDEXES[0]])]:
            f = files.enter_context(open(tmp / file, "xb"))
            if file in written.files:
                write_shard(f, written.files[file], meta)
            else:
                f.write(index_bytes(written.files, written.total_size, written.tied))
            f.flush()
            unsynced.append(f)
            if len(unsynced) > _OPEN_AT_MOST:
                oldest = unsynced.pop(0)
                os.fsync(oldest.fileno())
                oldest.close()
        for synced in unsynced:
            os.fsync(synced.fileno())


def plan(state: Mapping[str, Entry], *, max_shard_size: int, views: bool = False) -> Written:
    """The shards for ``state``: exact aliases of a whole storage are tied (stored once), the rest
    split by storage size, as huggingface_hub does. ``views``: different views of one storage are
    each stored as a tensor of its own (else they raise NeedsTorch, for the caller to decide).
    """
    groups: dict[Any, list[str]] = {}
    for name, e in state.items():
        if e.nbytes:
            groups.setdefault(e.ident if views else e.storage, []).append(name)
    for names in groups.values():
        if len(names) > 1 and (len({state[n].ident for n in names}) > 1 or not state[names[0]].complete):
            raise NeedsTorch(f"tensors {summarize(names)} are different views of one storage")
    tied = drop_tied(groups)
    sizes = [(n, (e.ident if views else e.storage) if e.nbytes else None, e.storage_size) for n, e in state.items()]
    files, total = split([s for s in sizes if s[0] not in tied], max_shard_size=max_shard_size)
    return Written(files, total, tied)


def write_shards(
    dest: Path,
    state: Mapping[str, Any],
    *,
    max_shard_size: int,
    source: str,
    progress: Progress | None = None,
    views: bool = False,
    after: Callable[[], object] = lambda: None,
    metadata: Mapping[str, str] | None = None,
) -> Written:
    """Write ``state`` (names -> :class:`~..entry.Entry`) as a sharded folder at ``dest``, each
    shard with ``metadata`` (``{"format": "pt"}`` at least); ``after()`` runs once each shard is
    written, before anything is published (a source's damage check).

    Raises:
        ArgumentError: a value is not a tensor; NeedsTorch: views of one storage (see :func:`plan`).
    """
    bad = [f"{k} ({type(v).__name__})" for k, v in state.items() if not isinstance(v, Entry)]
    if bad:
        raise ArgumentError(f"{source}: Hugging Face shards hold only tensors; not tensors: {summarize(bad)}")
    written = plan(state, max_shard_size=max_shard_size, views=views)

    def write_shard(f: BinaryIO, names: list[str], meta: dict[str, str]) -> None:
        write_safetensors(f, {n: state[n] for n in names}, meta, source=source, progress=progress)
        after()

    write_folder(dest, written, write_shard, metadata)
    return written
