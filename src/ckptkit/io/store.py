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
from collections.abc import Iterator
from pathlib import Path

from ..errors import CkptkitError
from . import remote, upload
from .atomic import atomic_write


class Local:
    """A path on this machine."""

    remote = False
    holds_folders = True

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
    def reading(self) -> Iterator[str]:
        """A local file to read: the path itself, as the caller spelled it."""
        yield self.spelled

    @contextlib.contextmanager
    def writing(self) -> Iterator[str]:
        """A local path to write (atomically, by the writer): the path itself."""
        yield self.spelled

    def spell(self, text: str, local: str) -> str:
        """``text`` naming this place where it named ``local`` (the same path here)."""
        return text

    def rename(self, e: CkptkitError, local: str) -> CkptkitError:
        return e

    def child(self, name: str) -> Local:
        return Local(self.path / name)

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
    holds_folders = False  # ckptkit writes single objects to a store, not folders

    def __init__(self, url: str) -> None:
        self.given = url  # as written: a trailing / asks for a folder
        self.spelled = url.rstrip("/")

    def __repr__(self) -> str:
        return f"Remote({self.spelled!r})"

    @property
    def name(self) -> str:
        return remote.name_of(self.spelled)

    def as_given(self) -> str:
        """As the public API hands it back: the URL."""
        return self.spelled

    @contextlib.contextmanager
    def reading(self) -> Iterator[str]:
        """The object staged in a local file for the block's length (its CRC-32 held against the
        one ckptkit recorded when it wrote it); errors inside name the URL."""
        with remote.staged_read(self.spelled) as local:
            yield os.fspath(local)

    @contextlib.contextmanager
    def writing(self) -> Iterator[str]:
        """A local staging path to write; uploaded and read back when the block ends without error."""
        with upload.staged_write(self.spelled) as local:
            yield os.fspath(local)

    def spell(self, text: str, local: str) -> str:
        return remote.unstaged(text, Path(local), self.spelled)

    def rename(self, e: CkptkitError, local: str) -> CkptkitError:
        return remote.renamed(e, Path(local), self.spelled)

    def child(self, name: str) -> Remote:
        return Remote(remote.join(self.spelled, name))

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


def locate(path: str | os.PathLike[str] | Location) -> Location:
    """``path`` resolved: a URL (``s3://...``, any fsspec URL) is a :class:`Remote`, anything else a
    :class:`Local` path (a :class:`~pathlib.Path` never is a URL)."""
    if isinstance(path, (Local, Remote)):
        return path
    return Remote(os.fspath(path)) if remote.is_url(path) else Local(path)
