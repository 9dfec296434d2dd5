"""An object in a store read as a file: ranged GETs of the bytes a reader asks for, several at once
ahead of a reader that goes forward, none of it on local disk.

The torch-free readers (a safetensors header and its tensors, a torch zip's directory, pickle and
records) open a URL's object through this (:func:`~.fileio.open_regular`, where
:func:`ranged_read` says a path stands for it) instead of a local copy of it. The object is read
in aligned runs of :data:`RUN` bytes, one GET each, kept for every reader of it in the block
(detection, the parser and the check each open it): once a reader crosses into the next run, the
:func:`~.remote.parts_in_flight` runs after it are fetched ahead. Memory holds those, and two
more (a reader going back a little, to a header; the end of a zip); the objects of a prefix
share a :class:`Budget` of twice that, so memory does not grow with the shards. A short read
that does not go forward (a header, a zip's directory entry) reads a block of :data:`SMALL`
bytes around it instead, so that ``inspect`` reads headers, not weights.

Every run's CRC-32 is kept: a run read twice with other bytes is an object that changed, and once
every run has been read, the whole object's CRC-32 is held against the one ckptkit recorded when
it wrote it (or the store's own), as a staged read does. Each GET asks for the version first
seen (``If-Match`` its ETag), so an object replaced meanwhile is refused, not mixed.

Example:
    >>> with ranged_read("s3://bucket/model.safetensors") as local:  # doctest: +SKIP
    ...     summary = inspect_checkpoint(local)  # reads the header's runs, not the object
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import io
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

from ..errors import StorageError
from . import remote
from .crcmath import crc32_combine
from .fileio import read_elsewhere, routed

RUN = 8 << 20  # one GET: the part size of the AWS CRT client (memory holds a few runs per reader)
SMALL = 64 << 10  # a read this short, not continuing forward, reads a block this long: no run is fetched
_BLOCKS_KEPT = 16


class Budget:
    """The runs held in memory by the objects of one read (an object, or a prefix's objects), at
    most ``limit``: those used least recently, by any of them, are let go first; and the
    :func:`~.remote.parts_in_flight` threads that fetch them. A prefix's objects share one, so
    that neither the shards a reader has finished with nor their threads (each one's memory
    arena) add up with the shards' number."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pool = concurrent.futures.ThreadPoolExecutor(remote.parts_in_flight(), thread_name_prefix="ckptkit-read")
        self._held: collections.OrderedDict[tuple[RangedObject, int], None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def use(self, obj: RangedObject, wanted: range) -> None:
        """``obj``'s runs ``wanted`` are held, its first used now; let the least recent others go."""
        with self._lock:
            for r in wanted:
                self._held.setdefault((obj, r))
            self._held.move_to_end((obj, wanted[0]))
            over = len(self._held) - self.limit
            gone = [k for k in self._held if k[0] is not obj or k[1] not in wanted][: max(over, 0)]
            for k in gone:
                del self._held[k]
        for owner, r in gone:  # outside this lock: each object takes its own
            owner.drop(r)

    def forget(self, obj: RangedObject) -> None:
        with self._lock:
            for k in [k for k in self._held if k[0] is obj]:
                del self._held[k]

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class RangedObject:
    """The runs of the object at ``url`` fetched so far, shared by its readers (see the module);
    ``budget``: shared with the other objects of the read (default: its own, of N + 2 runs)."""

    def __init__(
        self, url: str, fs: Any, key: str, info: dict[str, Any], budget: Budget | None = None, *, run: int = 0
    ) -> None:
        self.url, self.fs, self.key, self.info = url, fs, key, info
        self.size = int(info["size"])
        self.etag = info.get("ETag")
        self.run = run or RUN  # another process's reads of it (a worker's) use the run of the first
        self.runs = -(-self.size // self.run)
        self.ahead = remote.parts_in_flight()
        self._own = budget is None  # closed with this object, else by the read that shares it
        self.budget = budget or Budget(self.ahead + 2)
        self._runs: collections.OrderedDict[int, concurrent.futures.Future[bytearray]] = collections.OrderedDict()
        self._blocks: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # small reads' blocks
        self._crcs: dict[int, int] = {}
        self._lock = threading.Lock()
        self._whole_checked = False

    def reader(self) -> RangedReader:
        return RangedReader(self)

    def get(self, run: int, *, ahead: int) -> bytearray:
        """Run ``run``'s bytes, and the ``ahead`` runs after it asked for; the runs used least
        recently beyond what memory holds are let go."""
        wanted = range(run, min(run + ahead, self.runs - 1) + 1)
        while True:
            with self._lock:  # the bookkeeping: readers may share the object across threads
                for r in wanted:
                    if r not in self._runs:
                        self._runs[r] = self.budget.pool.submit(self._fetch, r)
                future = self._runs[run]
            self.budget.use(self, wanted)
            try:
                data = future.result()
                break
            except concurrent.futures.CancelledError:  # let go meanwhile for another reader's runs: ask again
                continue
        self.check_if_whole()
        return data

    def check_if_whole(self) -> None:
        """Once every run has been read (here, or by another process's reads of it): the whole
        object held to its recorded CRC-32."""
        if not self._whole_checked and len(self._crcs) == self.runs:
            self._check_whole()

    def cached(self, offset: int, length: int) -> bytes | None:
        """Bytes ``offset``.. of a run fetched already (``length`` of them at most), without a GET; None where none is."""
        run = offset // self.run
        with self._lock:
            future = self._runs.get(run)
        if future is None or not future.done() or future.exception() is not None:
            return None
        start = offset - run * self.run
        return bytes(future.result()[start : start + length])

    def small(self, offset: int, length: int) -> bytes:
        """``length`` (at most :data:`SMALL`) bytes from ``offset``, from the aligned blocks of
        :data:`SMALL` bytes around them, each one GET, a few kept: a reader that looks at a header
        here and there (a zip's local headers) reads no weights."""
        end = min(offset + length, self.size)
        first, last = offset // SMALL, (end - 1) // SMALL
        with self._lock:
            found = [self._blocks.get(b) for b in range(first, last + 1)]
        held = [block for block in found if block is not None]
        if len(held) < len(found):
            data = bytearray()
            start, stop = first * SMALL, min((last + 1) * SMALL, self.size)
            sink = lambda at, piece: data.extend(piece)  # noqa: E731
            remote.read_range(self.fs, self.key, self.url, start, stop, sink, etag=self.etag)
            held = [bytes(data[i : i + SMALL]) for i in range(0, len(data), SMALL)]
            with self._lock:
                for b, block in zip(range(first, last + 1), held, strict=True):
                    self._blocks[b] = block
                    self._blocks.move_to_end(b)
                while len(self._blocks) > _BLOCKS_KEPT:
                    self._blocks.popitem(last=False)
        joined = b"".join(held)
        return joined[offset - first * SMALL : end - first * SMALL]

    def drop(self, run: int) -> None:
        """Let run ``run`` go (the budget's choice)."""
        with self._lock:
            future = self._runs.pop(run, None)
        if future is not None:
            future.cancel()

    def complete(self) -> None:
        """Hold the whole object's CRC-32 against the recorded one, reading the runs no reader read
        (for their CRC-32s only, none kept); nothing is read where none was recorded."""
        if self._whole_checked or remote.recorded_crc(self.fs, self.key) is None:
            return
        missing = [r for r in range(self.runs) if r not in self._crcs]
        remote.in_flight(lambda i: self._fetch(missing[i], keep=False), len(missing))
        self._check_whole()

    def _fetch(self, run: int, *, keep: bool = True) -> bytearray:
        start, end = run * self.run, min((run + 1) * self.run, self.size)
        data = bytearray()
        sink = (lambda at, piece: data.extend(piece)) if keep else None
        self.add_runs({run: remote.read_range(self.fs, self.key, self.url, start, end, sink, etag=self.etag)})
        return data

    def run_crcs(self) -> dict[int, int]:
        """The CRC-32 of each run read so far (a worker's reads, reported to the process it serves)."""
        with self._lock:
            return dict(self._crcs)

    def add_runs(self, crcs: dict[int, int]) -> None:
        """Runs read, by this process or another's reads of the object (:meth:`run_crcs`).

        Raises:
            StorageError: a run read twice gave other bytes.
        """
        with self._lock:
            changed = [run for run, value in crcs.items() if self._crcs.setdefault(run, value) != value]
        if changed:
            start = changed[0] * self.run
            end = min(start + self.run, self.size)
            raise StorageError(f"{self.url}: bytes {start}-{end} changed between two reads of them; read it again")

    def _check_whole(self) -> None:
        """Every run read: the object's CRC-32 against the one recorded for it, where there is one."""
        with self._lock:
            crcs = dict(self._crcs)
        value = 0
        for run in range(len(crcs)):
            value = crc32_combine(value, crcs[run], min(self.run, self.size - run * self.run))
        remote.hold_to_recorded(self.fs, self.key, self.url, value, seen=self.info)
        self._whole_checked = True  # only once it held: a failure is raised again by the next read

    def close(self) -> None:
        for f in self._runs.values():
            f.cancel()
        if self._own:
            self.budget.close()
        self._runs.clear()
        self.budget.forget(self)


class RangedReader(io.RawIOBase):
    """A read-only, seekable file over a :class:`RangedObject`: a position, and the run it read last."""

    def __init__(self, obj: RangedObject) -> None:
        super().__init__()
        self.obj = obj
        self.name = obj.url  # as messages name the file
        self.pos = 0
        self._last = -2  # the run read last: crossing into the next one reads ahead

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self.name}: an object in a store has no file descriptor")

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence not in (os.SEEK_SET, os.SEEK_CUR, os.SEEK_END):
            raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
        pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.obj.size}[whence] + offset
        if pos < 0:
            raise ValueError(f"{self.name}: seek to {pos}, before the object's start")
        self.pos = pos
        return pos

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as whole, whole.cast("B") as out:
            data = self._pread(len(out), self.pos)
            out[: len(data)] = data
            self.pos += len(data)
            return len(data)

    def read(self, size: int | None = -1) -> bytes:
        n = self.obj.size - self.pos if size is None or size < 0 else size
        data = self._pread(n, self.pos)
        self.pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read()

    def _pread(self, length: int, offset: int) -> bytes:
        end = min(offset + max(length, 0), self.obj.size)
        run = offset // self.obj.run
        if 0 < end - offset <= SMALL and run != self._last + 1 and run != self.obj.runs - 1:
            # a look at a header, not a reader going forward (nor the last run: a zip's directory
            # and small records, read whole, count towards the object's CRC-32): a block at most
            held = self.obj.cached(offset, end - offset)
            return held if held is not None and len(held) == end - offset else self.obj.small(offset, end - offset)
        pieces: list[bytearray] = []
        at = offset
        while at < end:
            run = at // self.obj.run
            data = self.obj.get(run, ahead=self.obj.ahead if run == self._last + 1 else 0)
            self._last = run
            start = at - run * self.obj.run
            piece = data[start : start + end - at]
            pieces.append(piece)
            at += len(piece)
        return b"".join(pieces)


@contextlib.contextmanager
def ranged_read(url: str, *, complete: bool = False) -> Iterator[Path]:
    """A local path standing for the object at ``url`` for the block's length: the torch-free
    readers open it (:func:`~.fileio.open_regular`) as a :class:`RangedReader`, nothing written
    locally; a reader that opens paths itself (torch) gets it copied whole into it first
    (:func:`~.fileio.local_file`). The path is a file of the object's size holding nothing (a
    hole), so what reads it otherwise reads zeros and fails at its first header.

    A prefix holding objects (a Hugging Face shard folder, DCP) is a local folder of such files,
    one per object; an object of one run or less (an index, a config, DCP's ``.metadata``) is
    copied into it whole, as one GET reads it either way, so that every reader of the small files
    beside the weights reads them as it would locally. Stores other than S3 are staged whole
    (:func:`~.remote.staged_read`).

    Args:
        url: the object, or the prefix.
        complete: once the block has ended without error, each object's CRC-32 is held against the
            recorded one, whatever the readers read (:meth:`RangedObject.complete`).

    Raises:
        StorageError: an object was replaced while it was read: each is read as the version first
            listed (``If-Match``; a copied one is held to that listing), so a folder is never mixed.

    Errors inside name the URL.
    """
    fs, key = remote.filesystem(url)
    if "s3" not in remote.protocols(fs):
        with remote.staged_read(url) as local:
            yield local
        return
    info = remote.object_if_any(fs, key, url)
    listed = remote.listing(url) if info is None else {}
    if info is None and not listed:
        with remote.staged_read(url) as local:  # nothing there: its error, as a staged read says it
            yield local
        return
    with remote.staging(url) as local, remote.naming(local, url), contextlib.ExitStack() as objects:
        held: list[tuple[RangedObject, list[bool]]] = []
        if info is not None:
            held.append(_placeholder(objects, local, url, fs, key, info, None))
        else:
            # one budget for every object: twice one object's, for a tensor split across files
            # (DCP's ranks) read in turns, each file's current run and some read ahead held
            budget = Budget(2 * (remote.parts_in_flight() + 2))
            objects.callback(budget.close)  # after every object's own close: the stack runs backwards
            local.mkdir()
            for name, (size, etag) in listed.items():
                child = remote.join(url, name)
                if int(size) <= RUN:  # pinned to the listing's version, as the placeholders' GETs are
                    remote.download(child, local / name, seen={"size": size, "ETag": etag})
                else:
                    _, child_key = remote.filesystem(child)
                    listing = {"size": size, "ETag": etag}
                    held.append(_placeholder(objects, local / name, child, fs, child_key, listing, budget))
        yield local
        if complete:
            for obj, filled in held:
                if not filled:
                    obj.complete()


def _placeholder(
    objects: contextlib.ExitStack,
    local: Path,
    url: str,
    fs: Any,
    key: str,
    info: dict[str, Any],
    budget: Budget | None,
) -> tuple[RangedObject, list[bool]]:
    """``local`` made a hole of the object's size that stands for it until ``objects`` closes;
    the flag list gains an entry once it was copied whole (:func:`~.fileio.local_file`)."""
    with open(local, "xb") as f:
        f.truncate(int(info["size"]))
    filled: list[bool] = []

    def fill() -> None:
        local.unlink()
        remote.download(url, local, seen=info)  # the version read so far, checked against its CRC-32
        filled.append(True)

    obj = RangedObject(url, fs, key, info, budget)
    objects.callback(obj.close)
    objects.enter_context(read_elsewhere(local, _opener(obj), fill))
    objects.enter_context(routed(_STANDING, local, (obj, filled)))
    return obj, filled


# The objects ranged_read's paths stand for, by absolute path, while its block lasts: what
# another process (a convert's worker) needs to read them through ranges too.
_STANDING: dict[str, tuple[RangedObject, list[bool]]] = {}

Stand = tuple[str, str, dict[str, Any], int]  # a path, the object's URL, its listing, its run size


def stand_ins(path: str | os.PathLike[str]) -> list[Stand]:
    """The paths at or under ``path`` that stand for objects read through ranges (not copied
    whole), as :func:`standing_in` in another process takes them."""
    where = os.path.abspath(path)
    return [
        (p, obj.url, {"size": obj.size, "ETag": obj.etag}, obj.run)
        for p, (obj, filled) in list(_STANDING.items())  # one atomic copy: other threads' reads change it
        if (p == where or p.startswith(where + os.sep)) and not filled
    ]


@contextlib.contextmanager
def standing_in(stands: list[Stand]) -> Iterator[dict[str, RangedObject]]:
    """In another process than the one whose :func:`ranged_read` made them (a convert's spawned
    worker): within the block, each path of ``stands`` is read through ranges of its object,
    the version that read listed; yields the objects by path, whose :meth:`RangedObject.run_crcs`
    the first process then holds (:func:`add_runs`). Nothing is copied whole here: the path is
    the first process's, so a reader that needs it whole is refused."""

    def refused(url: str) -> Callable[[], None]:
        def fill() -> None:
            raise StorageError(  # a worker cannot tell how its caller spells the option: both ways
                f"{url}: a convert's worker reads it through ranged GETs only, and this read needs it whole; "
                "convert in one process (workers=1, --workers 1)"
            )

        return fill

    with contextlib.ExitStack() as objects:
        budget = Budget(2 * (remote.parts_in_flight() + 2))
        objects.callback(budget.close)
        found: dict[str, RangedObject] = {}
        for path, url, info, run in stands:
            fs, key = remote.filesystem(url)
            obj = found[path] = RangedObject(url, fs, key, info, budget, run=run)
            objects.callback(obj.close)
            objects.enter_context(read_elsewhere(path, _opener(obj), refused(url)))
        yield found


def _opener(obj: RangedObject) -> Callable[[], BinaryIO]:
    return lambda: cast(BinaryIO, obj.reader())


def add_runs(runs: dict[str, dict[int, int]]) -> None:
    """Another process's reads of this one's objects (:func:`standing_in`), by the path that
    stands for each (two reads of one URL have two): each object whose every run has now been
    read is held to its recorded CRC-32.

    Raises:
        StorageError: a run read twice gave other bytes, or the read that made the path is over;
            CheckpointFormatError: an object's bytes differ from its recorded CRC-32.
    """
    for path, crcs in runs.items():
        found = _STANDING.get(path)
        if found is None:
            raise StorageError(f"{path}: no read of an object stands behind it any more; read it again")
        found[0].add_runs(crcs)
        found[0].check_if_whole()
