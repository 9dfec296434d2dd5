"""Write a Hugging Face sharded folder, as ``huggingface_hub.save_torch_state_dict`` does, atomically.

Same split, file names, ``{"format": "pt"}`` shard metadata and index; tied tensors stored once
under the name sorted first, the others recorded in the index metadata (in the one file's
metadata when there is one shard). Each shard also records ckptkit's per-tensor CRC-32s, so
``ckptkit verify`` sees a flipped bit. :func:`write_shards` copies byte ranges of an opened
source without torch (each byte checked against the source's recorded CRC-32 while copied);
``ckptkit._hfsave`` feeds :func:`write_folder` from torch tensors.

Example:
    >>> write_shards(Path("out"), src, state, max_shard_size=5 * 10**9, progress=None)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ...errors import summarize
from ...io.atomicdir import atomic_folder, check_folder_destination
from ...io.fileio import Progress
from ..dcp import stream as dcps
from ..dcp import write as dcpcopy
from ..detect import HF, HF_INDEXES
from ..integrity import check_written
from ..rewrite import NeedsTorch, Source, locate, write_safetensors
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
    check_folder_destination(src, dest, force=force, owned=lambda n: bool(HF_FILE.match(n)), what="Hugging Face weight files")


def write_folder(dest: Path, written: Written, write_shard: Callable[[BinaryIO, list[str], dict[str, str]], object]) -> None:
    """Write ``written``'s shards (``write_shard(file, names, metadata)`` fills each) and its index
    into a temp folder that becomes ``dest`` once every file is complete and durable.

    The files are fsynced once all are written, not each before the next is begun: an fsync
    waits for its file's last bytes to reach the disk, time the next shard's copy can use
    (BENCHMARKS.md). Each is fsynced through the descriptor that wrote it, which is sure to
    hear of a failed writeback (a reopened one may not, if the file left memory between); past
    ``_OPEN_AT_MOST`` files the oldest is synced and closed early."""
    one = len(written.files) == 1
    meta = {"format": "pt", **(written.tied if one else {})}
    with atomic_folder(dest, check=lambda tmp: check_written(tmp, HF, dest=dest)) as tmp, contextlib.ExitStack() as files:  # files close before the folder's rename
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


def plan(entries: list[tuple[str, Any, int, Any, bool]], *, max_shard_size: int) -> Written:
    """The shards for ``(name, storage id or None, storage bytes, view identity, is the whole
    storage)`` entries: exact aliases of a whole storage are tied (stored once), the rest split.

    Raises:
        NeedsTorch: different views of one storage (the caller decides how to store them).
    """
    groups: dict[Any, list[str]] = {}
    for name, storage, _, _, _ in entries:
        if storage is not None:
            groups.setdefault(storage, []).append(name)
    by_name = {e[0]: e for e in entries}
    for names in groups.values():
        if len(names) > 1 and (len({by_name[n][3] for n in names}) > 1 or not by_name[names[0]][4]):
            raise NeedsTorch(f"tensors {summarize(names)} are different views of one storage")
    tied = drop_tied(groups)
    files, total = split([(n, s, size) for n, s, size, _, _ in entries if n not in tied], max_shard_size=max_shard_size)
    return Written(files, total, tied)


def write_shards(
    dest: Path, src: Source | dcps.DcpSource, state: Mapping[str, Any], *, max_shard_size: int, progress: Progress | None
) -> Written:
    """Write ``state`` (leaves of ``src``: a file's, or a DCP folder's chunked tensors) as a
    sharded folder at ``dest``, torch-free."""
    entries: list[tuple[str, Any, int, Any, bool]]
    if isinstance(src, dcps.DcpSource):  # each tensor its own storage, copied chunk by chunk
        entries = [(n, id(t), getattr(t, "nbytes", 0), id(t), True) for n, t in state.items()]
        write: Any = dcpcopy.write_safetensors
    else:
        located = {name: locate(src, ref, name) for name, ref in state.items()}
        entries = [(n, b.storage if b.length else None, b.storage_size, b.ident, b.complete) for n, b in located.items()]
        write = write_safetensors
    written = plan(entries, max_shard_size=max_shard_size)
    write_folder(dest, written, lambda f, names, meta: write(f, src, {n: state[n] for n in names}, progress, metadata=meta))
    return written
