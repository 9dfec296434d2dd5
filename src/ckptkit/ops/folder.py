"""A folder of step-numbered checkpoints: keep the last K, point at the latest, survive debris."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..distributed import collectives as _dist
from ..errors import ArgumentError, CheckpointFormatError, CheckpointNotFoundError, CheckpointWriteError, CkptkitError
from ..io.store import Location, locate
from .save import rebuild_error
from .verify import verify_checkpoint


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

    Example:
        >>> ckpts = CheckpointFolder("runs/a/checkpoints", keep=3)  # doctest: +SKIP
        >>> path = ckpts.path_for(step)  # doctest: +SKIP
        >>> save_training_state(path, model=ddp, ...); ckpts.commit(path)  # doctest: +SKIP
    """

    POINTER = "latest"

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

    def path_for(self, step: int) -> Path | str:
        """Where step ``step``'s checkpoint goes: a Path, or a URL string for a URL folder."""
        return self._at.child(f"step_{step:09d}{self.suffix}").as_given()

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
        self._at.child(self.POINTER).write_small(f"{at.name}\n".encode())  # atomic; on a store, one PUT read back
        self._prune(at.name)

    def _prune(self, name: str) -> None:
        """Remove all but the newest ``keep``, once ``latest`` names ``name``."""
        if self.keep is None:
            return
        for old in self._checkpoints()[: -self.keep]:
            if old.name != name:
                old.delete()

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

    def _pointer(self) -> str | None:
        data = self._at.child(self.POINTER).read_small()
        return data.decode(errors="replace").strip() if data is not None else None

    def _find(self, full: bool) -> Path | str | None:
        candidates = [c.as_given() for c in reversed(self._checkpoints())]
        if name := self._pointer():
            named = self._at.child(name).as_given()
            if named in candidates:  # the pointer names the newest committed one; try it first
                candidates.remove(named)
                candidates.insert(0, named)
        for path in candidates:
            if verify_checkpoint(path, full=full).intact:
                return path
        return None
