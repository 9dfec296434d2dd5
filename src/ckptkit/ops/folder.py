"""A folder of step-numbered checkpoints: keep the last K, point at the latest, survive debris,
admit one writer at a time."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ..distributed import collectives as _dist
from ..errors import ArgumentError, CheckpointFormatError, CheckpointNotFoundError, CheckpointWriteError, CkptkitError
from ..io import lease as _lease
from ..io.store import POINTER, Location, locate
from .save import rebuild_error
from .verify import verify_checkpoint


def _read_only(e: BaseException | None) -> bool:
    return isinstance(e, PermissionError) or getattr(e, "errno", None) == errno.EROFS


_REREADS = 16  # listings open_latest makes while a writer prunes each candidate before it is held


class CheckpointFolder:
    """Step-numbered checkpoints in one folder, with a ``latest`` pointer and pruning.

    The folder is created if missing. Files are ``step_000000120.pt``. :meth:`commit` (after a save has returned, or from an
    :class:`AsyncSaver` ``on_done``) points ``latest`` at a complete file, atomically, and
    removes all but the newest ``keep``. :meth:`latest` finds the newest checkpoint that
    is intact, whatever a crash left behind: temp files are never candidates, a torn file is
    skipped for the one before it, and with ``latest(full=True)`` so is one with a flipped bit.

    The folder may be a URL (``s3://bucket/run``, any fsspec URL; ``pip install 'ckptkit[s3]'``):
    then paths are URL strings, a checkpoint object appears only once its upload is committed and
    read back (by :func:`save_on_master`), ``latest`` is one small object written after that, and
    old objects are deleted only after it. :meth:`latest` reads each candidate into a staging file.

    One process writes a folder at a time. The first :meth:`path_for` or :meth:`commit` on global
    rank 0 makes this process the folder's writer, in a lease recorded in ``.ckptkit-writer`` (its
    host, pid and since when), renewed while it lives and removed when it is done. A second
    writer (an old job still running beside its requeued copy, two runs given one folder) is
    refused at once, with an error naming the first; a dead writer's lease is taken over (on its
    host: its pid is gone; from any host: its lease ran out, 60 s after it last renewed). Pruning
    removes only files this folder committed. A reader in another process opens the latest
    checkpoint with :meth:`open_latest`, which the writer's pruning cannot pull away.

    Example:
        >>> ckpts = CheckpointFolder("runs/a/checkpoints", keep=3)  # doctest: +SKIP
        >>> path = ckpts.path_for(step)  # doctest: +SKIP
        >>> save_training_state(path, model=ddp, ...); ckpts.commit(path)  # doctest: +SKIP
    """

    POINTER = POINTER  # the one name, kept in io.store (every reader follows it)

    def __init__(self, folder: str | os.PathLike[str], *, keep: int | None = 3, suffix: str = ".pt") -> None:
        if keep is not None and keep < 1:
            raise ArgumentError(f"keep must be at least 1 (or None for all), got {keep}")
        self._at = locate(folder)  # a local folder, or an object store's prefix (no folders, no rename)
        self.remote = self._at.remote
        self.folder: Path | str = self._at.as_given()
        try:
            self._at.make_folder()  # the first save needs it; every rank may do this
        except OSError as e:
            raise CheckpointWriteError(f"cannot create checkpoint folder {self.folder}: {e.strerror or e}") from e
        self.keep = keep
        self.suffix = suffix
        self._pattern = re.compile(rf"^step_(\d+){re.escape(suffix)}$")
        self._lease: _lease.Lease | None = None  # rank 0's, once it writes here
        self._committed: set[str] = set()  # what pruning may remove: names this folder committed

    def path_for(self, step: int) -> Path | str:
        """Where step ``step``'s checkpoint goes: a Path, or a URL string for a URL folder.

        On global rank 0 the first call makes this process the folder's writer.

        Raises:
            CheckpointWriteError: another live process writes this folder (the message names its host,
                pid and since when), or took it over after this process's lease lapsed.
        """
        at = self._at.child(f"step_{step:09d}{self.suffix}")
        if _dist.rank() == 0:
            self._hold(f"write {at.spelled}", renew=False)
        return at.as_given()

    def _hold(self, doing: str, *, renew: bool) -> None:
        """Make this process the folder's writer, or check that it still is."""
        if self._lease is None:
            try:
                self._lease = _lease.hold(self._at)
            except OSError as e:  # CheckpointWriteError, StorageError
                if renew or not _read_only(e.__cause__):
                    raise
                return  # a reader naming a file in a folder it cannot write is no rival writer
            # What the writers before this one committed (the pointer moves only once a file is
            # whole), as the pointer names them: a dead writer's uncommitted files stay untouched.
            newest = self.step_of(self._pointer() or "")
            if newest is not None:
                self._committed |= {c.name for c in self._checkpoints() if (self.step_of(c.name) or 0) <= newest}
        if renew:
            self._lease.check(doing)
        elif self._lease.lost is not None:
            raise CheckpointWriteError(f"cannot {doing}: {self._lease.lost}")

    def step_of(self, path: str | os.PathLike[str]) -> int | None:
        m = self._pattern.match(locate(path).name)
        return int(m[1]) if m else None

    def checkpoints(self) -> list[Path | str]:
        """Complete checkpoint files (or committed objects), oldest first (temp files and
        unfinished uploads never match)."""
        return [c.as_given() for c in self._checkpoints()]

    def _checkpoints(self) -> list[Location]:
        found = sorted((step, name) for name in self._at.names() if (step := self.step_of(name)) is not None)
        return [self._at.child(name) for _, name in found]

    def commit(self, path: str | os.PathLike[str]) -> None:
        """Point ``latest`` at ``path`` and prune. Any rank may call it; only global rank 0 acts.

        Raises:
            CheckpointNotFoundError: ``path`` does not exist (commit only complete files).
            ArgumentError: ``path`` is not in this folder.
        """
        if _dist.rank() != 0:
            return
        at = locate(path)
        if not self._at.holds(at):
            raise ArgumentError(f"{at.spelled} is not in {self.folder}; commit files named by path_for(step)")
        if not at.is_file():  # an aborted or unfinished upload is no object either
            raise CheckpointNotFoundError(
                f"{at.spelled}: cannot commit a checkpoint that does not exist; save it first, then commit",
                filename=at.spelled,
            )
        self._hold(f"commit {at.spelled}", renew=True)  # the lease renewed and held before latest moves
        self._committed.add(at.name)
        self._at.child(self.POINTER).write_small(f"{at.name}\n".encode())  # atomic; on a store, one PUT read back
        self._prune(at.name)

    def _prune(self, name: str) -> None:
        """Remove all but the newest ``keep`` committed files, once ``latest`` names ``name``. Files
        this folder did not commit (being written, saved and not yet committed) are never touched."""
        if self.keep is None:
            return
        present = {c.name for c in self._checkpoints()}
        self._committed &= present | {name}
        for old in sorted(self._committed, key=lambda n: self.step_of(n) or 0)[: -self.keep]:
            if old != name:
                self._at.child(old).delete()
                self._committed.discard(old)

    def latest(self, *, full: bool = False) -> Path | str | None:
        """The newest checkpoint that is intact, or None. Must be called on all ranks: rank 0
        decides and every rank gets its answer, so no two ranks resume from different files.

        Args:
            full: also read every payload byte of a candidate (its CRC-32s), so that a file
                with a flipped bit is skipped for the one before it. By default a candidate
                needs only readable headers, pickle and bounds (what a crash can tear), and the
                newest one is chosen without reading its tensors.

        Raises:
            CheckpointFormatError: rank 0 could not read the folder (on every rank).
        """
        outcome: tuple[str | None, tuple[str, str] | None] = (None, None)
        failure: Exception | None = None
        if _dist.rank() == 0:
            try:
                choice = self._find(full)
                outcome = (str(choice) if choice else None, None)
            except (CkptkitError, OSError) as e:
                failure = (
                    e
                    if isinstance(e, CkptkitError)
                    else CheckpointFormatError(f"{self.folder}: cannot read it to pick a checkpoint ({e})")
                )
                outcome = (None, (type(failure).__name__, str(failure)))
        answer, error = _dist.broadcast_object(outcome, what="CheckpointFolder.latest")
        if failure is not None:
            raise failure
        if error is not None:
            raise rebuild_error(
                error[0], f"rank 0 could not pick a checkpoint: {error[1]}", default=CheckpointFormatError
            )
        return locate(answer).as_given() if answer else None

    @contextlib.contextmanager
    def open_latest(self, *, full: bool = False) -> Iterator[Path | None]:
        """The newest intact checkpoint as a local file held open for the block, or None.

        For a reader beside the writer (an evaluation or a monitor): :meth:`latest` names a file
        that the writer's next commit may prune before the reader opens it. Here the file is held
        first (a hard link beside it; for a URL, a staging copy) and checked after, so it stays
        readable for the whole block whatever the writer does, and a candidate pruned before it
        was held is skipped for the one that replaced it. Not collective: call it in one process.
        Pass the path to :func:`read_checkpoint`, :func:`load_for_rank` and the rest; its name is
        the checkpoint's (``folder.step_of(path)`` gives the step).

        Args:
            full: check every payload byte of a candidate (its CRC-32s), as :meth:`latest` does.

        Raises:
            CheckpointFormatError: the folder cannot be read.

        Example:
            >>> with CheckpointFolder("runs/a/checkpoints").open_latest() as path:  # doctest: +SKIP
            ...     if path is not None:
            ...         state = read_checkpoint(path)
        """
        for _ in range(_REREADS):
            for candidate in self._candidates():
                with contextlib.ExitStack() as held:
                    try:
                        local = Path(held.enter_context(candidate.pinned()))
                    except CheckpointNotFoundError:
                        break  # pruned since the listing: a newer one was committed; list again
                    except CkptkitError:
                        raise
                    except OSError as e:
                        raise CheckpointFormatError(f"{self.folder}: cannot read it to pick a checkpoint ({e})") from e
                    if verify_checkpoint(local, full=full).intact:
                        yield local
                        return
            else:
                yield None
                return
        raise CheckpointNotFoundError(
            f"{self.folder}: checkpoints were pruned {_REREADS} times before one could be opened; "
            "the writer commits faster than this reader lists: try again",
            filename=str(self.folder),
        )

    def _candidates(self) -> list[Location]:
        """The checkpoint files, newest first; the one ``latest`` names before all."""
        candidates = list(reversed(self._checkpoints()))
        if name := self._pointer():
            named = [c for c in candidates if c.name == name]
            candidates = named + [c for c in candidates if c.name != name]
        return candidates

    def _pointer(self) -> str | None:
        data = self._at.child(self.POINTER).read_small()
        return data.decode(errors="replace").strip() if data is not None else None

    def _find(self, full: bool) -> Path | str | None:
        for candidate in self._candidates():  # the pointer names the newest committed one; tried first
            path = candidate.as_given()
            if verify_checkpoint(path, full=full).intact:
                return path
        return None
