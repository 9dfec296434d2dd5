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
import functools
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ...errors import ArgumentError, summarize
from ...io.atomic import streamed_file
from ...io.atomicdir import atomic_folder, check_folder_destination
from ...io.fileio import Progress
from ..entry import Entry
from ..integrity import check_written, kept_for_check
from ..safetensors.codec import write_safetensors
from ..safetensors.detect import SAFETENSORS
from ..source import NeedsTorch
from ..spec import WritePlan, balanced
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


def check_destination(src: Path, dest: Path, *, force: bool, extra: Iterable[str] = ()) -> None:
    """Raise unless ``dest`` may become a sharded folder (see :func:`.atomicdir.check_folder_destination`);
    ``extra``: the other files the folder is written with (``config.json``), which ``force`` replaces too."""
    also = set(extra)
    check_folder_destination(
        src, dest, force=force, owned=lambda n: bool(HF_FILE.match(n)) or n in also, what="Hugging Face weight files"
    )


def write_folder(
    dest: Path,
    written: Written,
    write_shard: Callable[[BinaryIO, list[str], dict[str, str]], object],
    metadata: Mapping[str, str] | None = None,
    *,
    plan: WritePlan | None = None,
    sizes: Mapping[str, int] | None = None,
) -> None:
    """Write ``written``'s shards (``write_shard(file, names, metadata)`` fills each) and its index
    into a temp folder that becomes ``dest`` once every file is complete and durable. Every shard
    carries ``metadata`` (the source's: torchao's description of its tensors, transformers'
    ``format``), as transformers' own sharded save does.

    With ``plan.workers`` above 1 (and ``plan.spread``), the shards are split among that many
    processes by ``sizes`` (largest first, each to the least loaded): this one writes the first
    share while ``plan.spread`` runs the others on the same temp folder, and the index is written
    once every share is complete and durable; any failure leaves no folder. A worker
    (``plan.part``) writes only its share's files into the folder it is given.
    """
    one = len(written.files) == 1
    meta = {"format": "pt", **(metadata or {}), **(written.tied if one else {})}
    if plan is not None and plan.part is not None:  # a worker: the parent checks and publishes
        plan.part.take(dest, written.files)
        _write_files(plan.part.folder, plan.part.files, written, write_shard, meta)
        return
    spread = plan.spread if plan is not None else None
    with atomic_folder(dest, check=lambda tmp: check_written(tmp, HF, dest=dest)) as tmp:
        for name, data in (plan.extra if plan is not None else {}).items():  # config.json
            with open(tmp / name, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        shares = (
            _shares(written, sizes or {}, min(plan.workers, len(written.files)))
            if plan is not None and spread is not None
            else [[*written.files]]
        )
        finish = spread(tmp, shares[1:]) if spread is not None else None
        index = [] if one else [HF_INDEXES[0]]
        try:  # alone, the index goes with the shards (synced together); else once every worker is done
            _write_files(tmp, shares[0] + (index if finish is None else []), written, write_shard, meta)
        except BaseException:
            if finish is not None:
                finish(False)
            raise
        if finish is not None:
            finish(True)
            _write_files(tmp, index, written, write_shard, meta)


def _write_files(
    folder: Path,
    names: list[str],
    written: Written,
    write_shard: Callable[[BinaryIO, list[str], dict[str, str]], object],
    meta: dict[str, str],
) -> None:
    """Write ``names`` (shards, or the index) into ``folder``, all durable when this returns.

    The files are fsynced once all are written, not each before the next is begun: an fsync
    waits for its file's last bytes to reach the disk, time the next shard's copy can use
    (BENCHMARKS.md). Each is fsynced through the descriptor that wrote it, which is sure to
    hear of a failed writeback (a reopened one may not, if the file left memory between); past
    ``_OPEN_AT_MOST`` files the oldest is synced and closed early. A folder standing for a store's
    prefix streams each shard there instead, checked and committed as it ends (the index is
    written here, and uploaded once the folder passes its check)."""

    def fill(f: BinaryIO, file: str) -> None:
        if file in written.files:
            write_shard(f, written.files[file], meta)
        else:
            f.write(index_bytes(written.files, written.total_size, written.tied))

    with contextlib.ExitStack() as files:
        unsynced: list[BinaryIO] = []
        for file in names:
            path = folder / file
            # One shard alone is the checkpoint (no index publishes it): it comes after the check
            stream = (
                streamed_file(
                    path,
                    check=functools.partial(check_written, fmt=SAFETENSORS, dest=path),
                    kept=kept_for_check(SAFETENSORS),
                )
                if len(written.files) > 1
                else None
            )
            if stream is not None:
                with stream as f:
                    fill(f, file)
                continue
            f = files.enter_context(open(path, "xb"))
            fill(f, file)
            f.flush()
            unsynced.append(f)
            if len(unsynced) > _OPEN_AT_MOST:
                oldest = unsynced.pop(0)
                os.fsync(oldest.fileno())
                oldest.close()
        for synced in unsynced:
            os.fsync(synced.fileno())


def _shares(written: Written, sizes: Mapping[str, int], count: int) -> list[list[str]]:
    """The shard files split into ``count`` shares of about equal bytes (:func:`~..spec.balanced`),
    each in the index's order."""
    owner = balanced({file: sizes.get(file, 0) for file in written.files}, count)
    return [[f for f in written.files if owner[f] == i] for i in range(count)]


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
    write_plan: WritePlan | None = None,
) -> Written:
    """Write ``state`` (names -> :class:`~..entry.Entry`) as a sharded folder at ``dest``, each
    shard with ``metadata`` (``{"format": "pt"}`` at least); ``after()`` runs once each shard is
    written, before anything is published (a source's damage check). ``write_plan``: its workers
    or part (see :func:`write_folder`).

    Raises:
        ArgumentError: a value is not a tensor; NeedsTorch: views of one storage (see :func:`plan`).
    """
    bad = [f"{k} ({type(v).__name__})" for k, v in state.items() if not isinstance(v, Entry)]
    if bad:
        raise ArgumentError(
            f"{source}: Hugging Face shards hold only tensors; not tensors: {summarize(bad)}; write a torch file "
            "(DST ending in .pt), which holds them too"
        )
    written = plan(state, max_shard_size=max_shard_size, views=views)

    def write_shard(f: BinaryIO, names: list[str], meta: dict[str, str]) -> None:
        write_safetensors(f, {n: state[n] for n in names}, meta, source=source, progress=progress)
        after()

    spread = write_plan is not None and write_plan.spread is not None  # sizes: only to split the shards
    sizes = (
        {file: sum(state[n].storage_size for n in names) for file, names in written.files.items()} if spread else None
    )
    write_folder(dest, written, write_shard, metadata, plan=write_plan, sizes=sizes)
    return written
