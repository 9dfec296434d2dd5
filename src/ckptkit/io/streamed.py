"""Writing an object as a stream: its parts go to the store while the writer produces them.

A single-file output to ``s3://`` is not written to a local file and then uploaded: the writer
writes into :class:`PartStream`, which sends each part of a multipart upload as it fills,
several at once, each with its CRC-32. The first part is held until the end, where a writer may
still patch it (a safetensors header's CRC-32s). What the writer's own check needs of the bytes
(a header, a zip's directory: :class:`~.atomic.Kept`) goes to a sparse local file, the rest left
a hole, and the check runs on it before the commit. The commit is the completion of the upload
with the whole object's CRC-32, checked as a staged file's upload is (:mod:`.upload`).

Memory holds the first part (8 MiB, or a longer first write), the part filling and the parts in
flight (:func:`~.remote.parts_in_flight`), 16 MiB each until an object passes about 16 GiB, when
parts grow to stay within S3's 10,000. Local disk holds what the check keeps.

Example:
    >>> with streamed_write("s3://bucket/single.pt") as local:  # doctest: +SKIP
    ...     write_checkpoint(state, local)  # streamed, checked and committed as it is written
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import CheckpointWriteError, CkptkitError
from . import remote, upload
from .atomic import Kept, Opener, folder_route, folder_written_elsewhere, written_elsewhere
from .crcmath import crc32_combine
from .fileio import crc32
from .remote import filesystem, naming, protocols, staging

STREAM_PART = 16 << 20  # a streamed part (the first and the growing later ones aside)
_STEP = 1000  # parts of one size before the next size: 10,000 parts reach about 860 GiB


def _head_size() -> int:
    """How long the first part is: held to the end for patches, so kept short (S3's parts but the
    last are 5 MiB at least); a first write longer than this (a header) is held whole."""
    return min(remote.PART_SIZE, 8 << 20)


def _part_size(number: int) -> int:
    """How long part ``number`` (2, 3, ...) is: half a staged upload's part, since memory holds the
    parts in flight and the one filling (not a file's pages); S3 allows 10,000 parts, so later
    parts grow."""
    return min(remote.PART_SIZE, STREAM_PART) * (1 + (number - 2) // _STEP)


class _All:
    """Keeps every byte (a writer without a :class:`~.atomic.Kept`): a whole local copy."""

    def feed(self, offset: int, data: bytes | memoryview) -> list[tuple[int, int]]:
        return [(offset, offset + len(data))]


class PartStream(io.RawIOBase):
    """A file whose bytes become the object at ``url`` as they are written (see the module).

    Seekable only within the first part, which is held until :meth:`commit`; ``truncate(0)`` at
    the start begins again (a writer that falls back to another one).
    """

    def __init__(self, url: str, image: Path, kept: Callable[[], Kept] | None) -> None:
        super().__init__()
        self.url, self.image_path, self._kept = url, image, kept or _All
        self.fs, self.key = filesystem(url)
        self.bucket, self.path, _ = self.fs.split_path(self.key)
        self.image = open(image, "wb")  # noqa: SIM115 - closed by close()
        self.in_flight = remote.parts_in_flight()
        self.pool = concurrent.futures.ThreadPoolExecutor(self.in_flight, thread_name_prefix="ckptkit-part")
        self._begin()

    def _begin(self) -> None:
        self.head = bytearray()  # part 1, held for patches
        self.filling = bytearray()  # the part being filled
        self.size = self.pos = 0
        self.sent: list[concurrent.futures.Future[tuple[dict[str, Any], int, int]]] = []  # in part order
        self.pending: set[concurrent.futures.Future[tuple[dict[str, Any], int, int]]] = set()  # not yet ended
        self.upload: dict[str, str] | None = None
        self.checked = False
        self.kept = self._kept()

    # -- the file ----------------------------------------------------------------------------

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence] + offset
        if not 0 <= pos <= self.size:
            raise io.UnsupportedOperation(f"{self.url}: seek to {pos} outside the {self.size} bytes written")
        self.pos = pos
        return pos

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a stream to a store has no file descriptor")

    def truncate(self, size: int | None = None) -> int:
        if (self.pos if size is None else size) != 0:
            raise io.UnsupportedOperation(f"{self.url}: a stream can only begin again (truncate to 0)")
        self._abort()
        self.image.truncate(0)
        self._begin()
        return 0

    def write(self, data: Any) -> int:
        with memoryview(data) as whole, whole.cast("B") as view:
            n = len(view)
            if self.pos < self.size:  # a patch: only where the bytes are still held
                if self.pos + n > len(self.head):
                    raise CheckpointWriteError(
                        f"cannot write {self.url}: the writer went back to byte {self.pos}, past the part still "
                        "held; this is a ckptkit bug, please report it with the command that did it"
                    )
                self.head[self.pos : self.pos + n] = view
                os.pwrite(self.image.fileno(), view, self.pos)
                self.pos += n
                return n
            for start, end in self.kept.feed(self.pos, view):
                os.pwrite(self.image.fileno(), view[start - self.pos : end - self.pos], start)
            rest = view
            if self.size == 0 or len(self.head) < _head_size():  # the first part (all of a first write)
                take = len(rest) if self.size == 0 else min(len(rest), _head_size() - len(self.head))
                self.head += rest[:take]
                rest = rest[take:]
            while rest:
                number = len(self.sent) + 2
                take = min(len(rest), _part_size(number) - len(self.filling))
                self.filling += rest[:take]
                rest = rest[take:]
                if len(self.filling) == _part_size(number):
                    data, self.filling = self.filling, bytearray()
                    self._send(number, data)
            self.size += n
            self.pos = self.size
            return n

    # -- the upload ----------------------------------------------------------------------------

    def _send(self, number: int, data: bytearray) -> None:
        """Part ``number`` sent on a pool thread, once fewer than the pool's threads are in flight;
        a part that failed meanwhile fails the write here, not at the end."""
        if self.upload is None:
            upload.abort_left_uploads(self.fs, self.key)
            with upload.storing(self.url):
                self.upload, self.checked = upload.create_upload(self.fs, self.bucket, self.path, None)
        self._settle()
        while len(self.pending) >= self.in_flight:  # memory holds the parts in flight: wait for one
            concurrent.futures.wait(self.pending, return_when=concurrent.futures.FIRST_COMPLETED)
            self._settle()
        future = self.pool.submit(self._part, self.upload, number, data)
        self.sent.append(future)
        self.pending.add(future)

    def _settle(self) -> None:
        """The parts that ended leave :attr:`pending`; the first that failed raises its error."""
        for f in [f for f in self.pending if f.done()]:
            self.pending.discard(f)
            f.result()

    def _part(self, ids: dict[str, str], number: int, data: bytearray) -> tuple[dict[str, Any], int, int]:
        body = upload.PartBody(data)  # read a piece at a time: the client holds no copy
        try:
            crc = crc32(data)
            with upload.storing(self.url):
                listed = upload.send_part(self.fs, ids, number, body, crc, checked=self.checked)
            return listed, crc, len(data)
        finally:  # the client's objects (or a failure's traceback) may outlive the call: the part goes now
            body.data.release()
            with contextlib.suppress(BufferError):
                data.clear()

    def finish(self) -> None:
        """All bytes written: the last part sent, every part in, the local image complete."""
        if self.filling:
            data, self.filling = self.filling, bytearray()
            self._send(len(self.sent) + 2, data)
        for f in self.sent:
            f.result()
        self.image.truncate(self.size)
        self.image.close()

    def commit(self) -> str:
        """The object committed and checked (:func:`~.upload.committed_check`); which check ran."""
        head = bytes(self.head)
        crc = crc32(head)
        with upload.storing(self.url):
            if self.upload is None:  # it fits in one part: one PUT
                upload.abort_left_uploads(self.fs, self.key)
                echoed = upload.put_one(self.fs, self.bucket, self.path, head, crc)
            else:
                first = upload.send_part(self.fs, self.upload, 1, upload.PartBody(head), crc, checked=self.checked)
                parts = [first]
                for f in self.sent:
                    listed, part_crc, length = f.result()
                    parts.append(listed)
                    crc = crc32_combine(crc, part_crc, length)
                echoed = upload.complete_upload(self.fs, self.upload, parts, crc, checked=self.checked, size=self.size)
                self.upload = None  # committed: nothing to abort
        return upload.committed_check(self.fs, self.key, self.url, size=self.size, crc=crc, echoed=echoed)

    def _abort(self) -> None:
        for f in self.sent:
            f.cancel()
        concurrent.futures.wait(self.sent)
        if self.upload is not None:
            upload.abort_upload(self.fs, self.upload)
            self.upload = None

    def close(self) -> None:
        """Without :meth:`commit`, nothing is published: an upload begun is aborted."""
        if not self.closed:
            self._abort()
            self.pool.shutdown(wait=True)
            self.image.close()
        super().close()


@contextlib.contextmanager
def _opened(
    url: str, image: Path, done: list[str], *, check: Callable[[Path], None] | None, kept: Callable[[], Kept] | None
) -> Iterator[BinaryIO]:
    """What :func:`~.atomic.atomic_write` writes for ``image``'s path: the stream, checked and
    committed when the block ends without error; aborted otherwise."""
    with PartStream(url, image, kept) as stream:
        yield stream  # type: ignore[misc]  # a RawIOBase: the writers call write/seek/tell
        stream.finish()
        if check is not None:
            check(image)
        done.append(stream.commit())


@contextlib.contextmanager
def streamed_write(url: str, checked: list[str] | None = None) -> Iterator[Path]:
    """A local path to write, standing for ``url``: a file written to it by
    :func:`~.atomic.atomic_write` streams to ``url`` (:class:`PartStream`) and is committed when
    that write ends; one written otherwise is uploaded when the block ends
    (:func:`~.upload.staged_write`'s way). Which check ran is appended to ``checked``. A write
    that fails commits nothing; a streamed file is committed as its atomic write ends (as a local
    file is renamed into place then), not when this block does. Stores other than S3 are always
    written the staged way."""
    fs, _ = filesystem(url)  # a missing extra fails before anything is written
    if "s3" not in protocols(fs):
        with upload.staged_write(url, checked) as local:
            yield local
        return
    done: list[str] = []
    with staging(url) as local, naming(local, url):
        with written_elsewhere(local, lambda **how: _opened(url, local, done, **how)):
            yield local
        if not done:
            done.append(upload.upload_verified(local, url))
        if checked is not None:
            checked += done


@contextlib.contextmanager
def streamed_folder(
    url: str, *, published_by: Callable[[str], bool], checked: list[str] | None = None
) -> Iterator[Path]:
    """A local folder path standing for the prefix ``url``, for a folder output's writer.

    On S3, into a prefix holding no objects: each file the writer creates with
    :func:`~.atomic.streamed_file` (a Hugging Face shard) streams to the store, and is checked and
    committed as it ends, as are those a convert's workers stream there (:func:`streaming_into`);
    what else it writes (the index, ``config.json``) is uploaded when the block ends, the files
    ``published_by`` names last (:func:`~.upload.upload_folder`). A prefix that holds objects already (``--force``), and other
    stores, are staged whole and uploaded when the block ends: a write that fails there leaves the
    earlier folder as it was, where streaming would have unpublished it first. A write that fails
    removes the files it streamed (never published: the index comes last). Which check each file
    passed is appended to ``checked``.
    """
    fs, _ = filesystem(url)  # a missing extra fails before anything is written
    streams = "s3" in protocols(fs) and not remote.list_names(url)
    route = _Route(url, published_by)
    with staging(url) as local, naming(local, url):
        try:
            with folder_written_elsewhere(local, route) if streams else contextlib.nullcontext():
                yield local
            sent = route.committed()
            checks = [how for name in sorted(sent) for how in sent[name]]
            checks += upload.upload_folder(local, url, published_by=published_by, sent=set(sent))
        except BaseException:
            route.remove()  # committed, never published: gone again
            raise
    if checked is not None:
        checked += checks


class _Route:
    """Where the new files of a folder output streaming to the prefix ``url`` go (each file as
    the writer made it, in its temp folder): ``done``, each streamed file's name -> the check it
    passed (empty until it is committed)."""

    def __init__(self, url: str, published_by: Callable[[str], bool]) -> None:
        self.url, self.published_by = url, published_by
        self.done: dict[str, list[str]] = {}
        self.others: set[str] = set()  # what other processes stream (a worker stopped may not say)

    def __call__(self, path: Path) -> Opener | None:
        if self.published_by(path.name):
            return None  # after the folder's check, as the block ends
        done = self.done[path.name] = []
        return lambda **how: _opened(remote.join(self.url, path.name), path, done, **how)

    def committed(self) -> dict[str, list[str]]:
        return {name: how for name, how in self.done.items() if how}

    def remove(self) -> None:
        """Delete what was committed, and what other processes were to stream: one stopped
        mid-shard (terminated, killed) left its multipart upload open, so that is aborted too."""
        for name in sorted(set(self.committed()) | self.others):
            with contextlib.suppress(CkptkitError):
                remote.delete(remote.join(self.url, name))
            if name in self.others:
                fs, key = filesystem(remote.join(self.url, name))
                upload.abort_left_uploads(fs, key)


def folder_stand_in(folder: Path) -> str | None:
    """The prefix the new files of ``folder`` (a folder output's temp folder) stream to, if they
    do: another process writing some of them (a convert's worker) streams them there too
    (:func:`streaming_into`)."""
    route = folder_route(folder)
    return route.url if isinstance(route, _Route) else None


@contextlib.contextmanager
def streaming_into(folder: Path, url: str | None) -> Iterator[dict[str, list[str]]]:
    """In another process than the one whose :func:`streamed_folder` made ``folder`` (a convert's
    worker): within the block, the new files it writes there stream to the prefix ``url`` (None:
    written locally, as usual), each checked and committed as it ends. Yields each streamed
    file's name -> its check (empty: not committed), for the first process (:func:`add_streamed`);
    a failure removes what was committed (the index, the first process's, comes later)."""
    if url is None:
        yield {}
        return
    route = _Route(url, lambda name: False)  # a worker writes shards alone
    try:
        with folder_written_elsewhere(folder, route):
            yield route.done
    except BaseException:
        route.remove()
        raise


def expect_streamed(folder: Path, names: list[str]) -> None:
    """Files of ``folder`` another process will stream (:func:`streaming_into`): if this
    process's write fails, they are removed too, whatever that process could say."""
    route = folder_route(folder)
    if isinstance(route, _Route):
        route.others.update(names)


def add_streamed(folder: Path, sent: dict[str, list[str]]) -> None:
    """Files another process streamed for ``folder`` (:func:`streaming_into`): this process's
    write takes them as its own, so they are not uploaded again, and are removed if it fails."""
    route = folder_route(folder)
    if isinstance(route, _Route):
        route.done.update(sent)
