"""A folder of step-numbered checkpoints: keep the last K, point at the latest, survive debris."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .._verify import verify_checkpoint
from ..errors import ArgumentError, CheckpointFormatError, CheckpointNotFoundError, CheckpointWriteError, CkptkitError
from ..io.atomic import atomic_write
from . import collectives as _dist
from .rank0 import rebuild_error


class CheckpointFolder:
    """Step-numbered checkpoints in one folder, with a ``latest`` pointer and pruning.

    The folder is created if missing. Files are ``step_000000120.pt``. :meth:`commit` (after a save has returned, or from an
    :class:`AsyncSaver` ``on_done``) points ``latest`` at a complete file, atomically, and
    removes all but the newest ``keep``. :meth:`latest` finds the newest checkpoint that
    is intact, whatever a crash left behind: temp files are never candidates, a torn file is
    skipped for the one before it, and with ``latest(full=True)`` so is one with a flipped bit.

    Example:
        >>> ckpts = CheckpointFolder("runs/a/checkpoints", keep=3)  # doctest: +SKIP
        >>> path = ckpts.path_for(step)  # doctest: +SKIP
        >>> save_training_state(path, model=ddp, ...); ckpts.commit(path)  # doctest: +SKIP
    """

    POINTER = "latest"

    def __init__(self, folder: str | os.PathLike[str], *, keep: int | None = 3, suffix: str = ".pt") -> None:
        if keep is not None and keep < 1:
            raise ArgumentError(f"keep must be at least 1 (or None for all), got {keep}")
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)  # the first save needs it; every rank may do this
        except OSError as e:
            raise CheckpointWriteError(f"cannot create checkpoint folder {self.folder}: {e.strerror or e}") from e
        self.keep = keep
        self.suffix = suffix
        self._pattern = re.compile(rf"^step_(\d+){re.escape(suffix)}$")

    def path_for(self, step: int) -> Path:
        return self.folder / f"step_{step:09d}{self.suffix}"

    def step_of(self, path: str | os.PathLike[str]) -> int | None:
        m = self._pattern.match(Path(path).name)
        return int(m[1]) if m else None

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint files, oldest first (temp files never match)."""
        if not self.folder.is_dir():
            return []
        found = [(self.step_of(p), p) for p in self.folder.iterdir() if self.step_of(p) is not None]
        return [p for _, p in sorted(found)]

    def commit(self, path: str | os.PathLike[str]) -> None:
        """Point ``latest`` at ``path`` and prune. Any rank may call it; only global rank 0 acts.

        Raises:
            CheckpointNotFoundError: ``path`` does not exist (commit only complete files).
            ArgumentError: ``path`` is not in this folder.
        """
        if _dist.rank() != 0:
            return
        p = Path(path)
        if not p.is_file():
            raise CheckpointNotFoundError(f"{p}: cannot commit a checkpoint that does not exist; save it first, then commit", filename=str(p))
        if p.parent.resolve() != self.folder.resolve():
            raise ArgumentError(f"{p} is not in {self.folder}; commit files named by path_for(step)")
        name = p.name
        with atomic_write(self.folder / self.POINTER) as f:
            f.write(f"{name}\n".encode())
        if self.keep is not None:
            for old in self.checkpoints()[: -self.keep]:
                if old.name != name:
                    old.unlink(missing_ok=True)

    def latest(self, *, full: bool = False) -> Path | None:
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
                failure = e if isinstance(e, CkptkitError) else CheckpointFormatError(f"{self.folder}: cannot read it to pick a checkpoint ({e})")
                outcome = (None, (type(failure).__name__, str(failure)))
        answer, error = _dist.broadcast_object(outcome, what="CheckpointFolder.latest")
        if failure is not None:
            raise failure
        if error is not None:
            raise rebuild_error(error[0], f"rank 0 could not pick a checkpoint: {error[1]}", default=CheckpointFormatError)
        return Path(answer) if answer else None

    def _find(self, full: bool) -> Path | None:
        pointer = self.folder / self.POINTER
        candidates = list(reversed(self.checkpoints()))
        if pointer.is_file():
            named = self.folder / pointer.read_text(errors="replace").strip()
            if named in candidates:  # the pointer names the newest committed one; try it first
                candidates.remove(named)
                candidates.insert(0, named)
        for path in candidates:
            if verify_checkpoint(path, full=full).intact:
                return path
        return None
