"""Where a checkpoint is: a local path or an object's URL, resolved once at the API's edge.

:func:`locate` is the one place that tells a URL from a path. What it returns answers the same
questions either way, so the code below the edge has one path: the readers and writers work on
a local file (the path itself, or a staging file a URL is read into or uploaded from), and
messages name the place as the caller spelled it.

Example:
    >>> here = locate("runs/a")
    >>> here.child("step_1.pt").spelled, here.remote
    ('runs/a/step_1.pt', False)
    >>> locate("s3://bucket/run").child("latest").spelled
    's3://bucket/run/latest'
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointNotFoundError, CkptkitError
from . import ranged, remote, streamed, upload
from .atomic import atomic_write, remove_stale_temps, temp_path
from .fileio import open_regular

# A checkpoints folder's pointer (CheckpointFolder writes it): a small file naming the newest
# committed checkpoint beside it. DeepSpeed's ``latest`` names a tag folder instead: not followed.
POINTER = "latest"
_POINTER_BYTES = 4096  # a name, not a checkpoint: anything larger is no pointer


def _pointed_name(data: bytes | None) -> str | None:
    if data is None or len(data) > _POINTER_BYTES:
        return None
    name = data.decode(errors="replace").strip()
    return name if name and "/" not in name and "\\" not in name and name not in (".", "..") else None


class Local:
    """A path on this machine."""

    remote = False
    checked: list[str] = []  # noqa: RUF012 - never appended to: a local file is checked by its writer

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.spelled = self.given = os.fspath(path)

    def __repr__(self) -> str:
        return f"Local({self.spelled!r})"

    @property
    def name(self) -> str:
        return self.path.name

    def as_given(self) -> Path:
        """As the public API hands it back: a Path."""
        return self.path

    @contextlib.contextmanager
    def reading(self, *, whole: bool = False, checked: bool = False) -> Iterator[str]:
        """A local file to read: the path itself, as the caller spelled it."""
        yield self.spelled

    @contextlib.contextmanager
    def writing(self) -> Iterator[str]:
        """A local path to write (atomically, by the writer): the path itself."""
        yield self.spelled

    @contextlib.contextmanager
    def writing_folder(self, *, published_by: Callable[[str], bool]) -> Iterator[str]:
        """A local path for a folder output (its writer publishes it atomically): the path itself,
        as given (a trailing / kept)."""
        yield self.given

    @contextlib.contextmanager
    def pinned(self) -> Iterator[str]:
        """A local path to this file that stays readable for the block, even if the file is deleted
        meanwhile: a hard link in a temp folder beside it (removed afterwards, or as debris once this
        process is dead), or a copy where the folder takes no links. Errors inside name the file.

        Raises:
            CheckpointNotFoundError: the file is not there (any more).
        """
        try:
            source = open_regular(self.path, folder=self.path.parent)  # held: removing its name now frees nothing
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.spelled}: no such file (removed)", filename=self.spelled) from None
        with source, self._pin_place() as local:
            if not _linked(self.path, local, source):
                with open(local, "xb") as copy:
                    shutil.copyfileobj(source, copy, 1 << 20)
            with remote.naming(local, self.spelled):
                yield os.fspath(local)

    @contextlib.contextmanager
    def _pin_place(self) -> Iterator[Path]:
        remove_stale_temps(self.path)  # pins of readers killed before they removed theirs
        folder = temp_path(self.path)
        try:
            folder.mkdir()
        except OSError:  # a folder this process may only read: a copy in a staging folder
            with remote.staging(self.spelled) as local:
                yield local
            return
        try:
            yield folder / self.path.name
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def spell(self, text: str, local: str) -> str:
        """``text`` naming this place where it named ``local`` (the same path here)."""
        return text

    def rename(self, e: CkptkitError, local: str) -> CkptkitError:
        return e

    def child(self, name: str) -> Local:
        return Local(self.path / name)

    def pointed(self) -> Local:
        """A checkpoints folder, or its ``latest`` pointer, as the file the pointer names (where
        that is a file beside it); anything else as it is."""
        pointer = self.path if self.path.name == POINTER else self.path / POINTER
        try:
            name = _pointed_name(pointer.read_bytes()) if pointer.is_file() else None
            target = pointer.parent / name if name else None
            return Local(target) if target is not None and target.is_file() else self
        except OSError:  # a name too long for a file (another tool's pointer): the format's readers say so
            return self

    def holds(self, other: Location) -> bool:
        """Whether ``other`` is directly in this folder."""
        return isinstance(other, Local) and other.path.parent.resolve() == self.path.resolve()

    def make_folder(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def is_file(self) -> bool:
        return self.path.is_file()

    def names(self) -> list[str]:
        """The names directly in this folder (none where it does not exist)."""
        return [p.name for p in self.path.iterdir()] if self.path.is_dir() else []

    def delete(self) -> None:
        self.path.unlink(missing_ok=True)
        remove_stale_temps(self.path)  # and what dead writers and readers left for it

    def read_small(self) -> bytes | None:
        return self.path.read_bytes() if self.path.is_file() else None

    def write_small(self, data: bytes) -> None:
        """Written atomically and durably."""
        with atomic_write(self.path) as f:
            f.write(data)


class Remote:
    """An object in a store fsspec opens (``s3://bucket/key``), read and written through local staging
    files (:mod:`.remote`, :mod:`.upload`)."""

    remote = True

    def __init__(self, url: str) -> None:
        self.given = url  # as written: a trailing / asks for a folder
        self.spelled = url.rstrip("/")
        self.checked: list[str] = []  # how each upload :meth:`writing` made was checked

    def __repr__(self) -> str:
        return f"Remote({self.spelled!r})"

    @property
    def name(self) -> str:
        return remote.name_of(self.spelled)

    def as_given(self) -> str:
        """As the public API hands it back: the URL."""
        return self.spelled

    @contextlib.contextmanager
    def reading(self, *, whole: bool = False, checked: bool = False) -> Iterator[str]:
        """A local path standing for the object, for the block's length: read through ranged GETs
        by the torch-free readers (:func:`~.ranged.ranged_read`), copied whole into it for torch;
        ``whole`` (torch reads it all): staged whole at once. Its CRC-32 is held against the one
        ckptkit recorded when it wrote it once every byte is read (``checked``: as the block ends,
        reading what the readers did not). A prefix stands for a folder of its objects, read the
        same way. Errors inside name the URL."""
        with remote.staged_read(self.spelled) if whole else ranged.ranged_read(self.spelled, complete=checked) as local:
            yield os.fspath(local)

    @contextlib.contextmanager
    def pinned(self) -> Iterator[str]:
        """The object in a local file of this process's own, for the block's length (as :meth:`reading`).

        Raises:
            CheckpointNotFoundError: no object there (any more).
        """
        with self.reading(whole=True) as local:
            yield local

    @contextlib.contextmanager
    def writing(self) -> Iterator[str]:
        """A local path standing for the object: a file written there atomically streams to the
        store and is committed as its write ends (:mod:`.streamed`), checked by the store's CRC-32
        of the object or by reading it back (said in :attr:`checked`); nothing is committed on error."""
        with streamed.streamed_write(self.spelled, self.checked) as local:
            yield os.fspath(local)

    @contextlib.contextmanager
    def writing_folder(self, *, published_by: Callable[[str], bool]) -> Iterator[str]:
        """A local folder standing for this prefix, for a folder output (its path ends with /):
        Hugging Face shards stream to an empty S3 prefix as they are written; the rest is uploaded
        when the block ends without error, the files ``published_by`` names (the index,
        ``.metadata``) last (:func:`~.streamed.streamed_folder`)."""
        with streamed.streamed_folder(self.spelled, published_by=published_by, checked=self.checked) as local:
            yield f"{local}/"

    def spell(self, text: str, local: str) -> str:
        return remote.unstaged(text, Path(local), self.spelled)

    def rename(self, e: CkptkitError, local: str) -> CkptkitError:
        return remote.renamed(e, Path(local), self.spelled)

    def child(self, name: str) -> Remote:
        return Remote(remote.join(self.spelled, name))

    def pointed(self) -> Remote:
        """As :meth:`Local.pointed`: a prefix or its ``latest`` object as the object it names."""
        folder = self.spelled.rsplit("/", 1)[0] if self.name == POINTER else self.spelled.rstrip("/")
        try:
            name = _pointed_name(remote.read_small(remote.join(folder, POINTER)))
            target = Remote(remote.join(folder, name)) if name else None
            return target if target is not None and target.is_file() else self
        except CkptkitError:  # no fsspec, no credentials, no store: reading the URL itself says which
            return self

    def holds(self, other: Location) -> bool:
        return isinstance(other, Remote) and other.spelled.rsplit("/", 1)[0] == self.spelled

    def make_folder(self) -> None:
        pass  # an object store has no folders: a prefix exists once an object is under it

    def is_file(self) -> bool:
        return remote.exists(self.spelled)  # an aborted or unfinished upload is no object

    def names(self) -> list[str]:
        return remote.list_names(self.spelled)

    def delete(self) -> None:
        remote.delete(self.spelled)

    def read_small(self) -> bytes | None:
        return remote.read_small(self.spelled)

    def write_small(self, data: bytes) -> None:
        """One PUT, read back."""
        upload.write_small(self.spelled, data)


Location = Local | Remote


def _linked(path: Path, link: Path, source: BinaryIO) -> bool:
    """Whether ``link`` now names the file open as ``source`` (``path`` may have been replaced since)."""
    try:
        os.link(path, link)
    except OSError:  # gone since it was opened, or a filesystem without hard links
        return False
    mine, linked = os.fstat(source.fileno()), os.stat(link)
    if (mine.st_dev, mine.st_ino) == (linked.st_dev, linked.st_ino):
        return True
    link.unlink()
    return False


def locate(path: str | os.PathLike[str] | Location) -> Location:
    """``path`` resolved: a URL (``s3://...``, any fsspec URL) is a :class:`Remote`, anything else a
    :class:`Local` path (a :class:`~pathlib.Path` never is a URL)."""
    if isinstance(path, (Local, Remote)):
        return path
    return Remote(os.fspath(path)) if remote.is_url(path) else Local(path)
