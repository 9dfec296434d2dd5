"""Atomic, durable folder replacement: a folder output appears complete or not at all.

The files are written into a temp folder beside the destination (same filesystem), each fsynced
by its writer; then the temp folder is fsynced and renamed to the destination, and the parent
fsynced. An existing destination is swapped out in one step (``renameat2(RENAME_EXCHANGE)``,
Linux) and then removed, so a reader sees the old folder or the new one, never a mix. Temp
folders carry the writer's host and pid as :mod:`.atomic`'s temp files do, so the next writer
removes those a killed writer left.

Example:
    >>> with atomic_folder("out") as tmp:  # doctest: +SKIP
    ...     (tmp / "model.safetensors").write_bytes(payload)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import ArgumentError, CheckpointWriteError, CkptkitError, spell, summarize
from .atomic import (
    describe_error,
    folder_route,
    folder_written_elsewhere,
    fsync_dir,
    name_stem,
    remove_stale_temps,
    temp_path,
)

_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the kernel, libc or filesystem cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(b))


def _install(tmp: Path, dest: Path) -> None:
    """Put the finished ``tmp`` at ``dest``, replacing a folder there; the old one goes last."""
    if not dest.exists():
        os.rename(tmp, dest)  # onto nothing, or onto an empty folder created meanwhile
        return
    if _exchange(tmp, dest):
        shutil.rmtree(tmp)  # now the old folder
        return
    # Not a temp name: were this process killed between the renames, the old folder must stay
    # for the user to find (remove_stale_temps would delete a dead writer's temp folder).
    old = dest.with_name(f".{name_stem(dest)}.replaced-{os.getpid()}-{os.urandom(4).hex()}")
    os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike[str], *, check: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A temp folder that replaces ``path`` atomically and durably when the block succeeds.

    Write the files inside the yielded folder and fsync each. On any exception (including
    KeyboardInterrupt) the temp folder is removed and ``path`` is left as it was. OS errors are
    re-raised as :class:`CheckpointWriteError` naming the cause. The caller decides whether an
    existing ``path`` may be replaced.

    Args:
        path: the folder to write; its parent must exist.
        check: called with the temp folder's path once the block has finished and the folder is
            fsynced, before it replaces ``path``: verify what was written there. If it raises, the
            temp folder is removed, ``path`` is left as it was, and the exception propagates
            unchanged.

    Example:
        >>> def has_index(tmp: Path) -> None:  # doctest: +SKIP
        ...     if not (tmp / "model.safetensors.index.json").is_file():
        ...         raise CheckpointWriteError(f"{tmp}: no index was written; out/ is left as it was")
        >>> with atomic_folder("out", check=has_index) as tmp:  # doctest: +SKIP
        ...     write_shards(tmp)
    """
    dest = Path(path)
    parent = dest.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise CheckpointWriteError(f"cannot write {dest}: {parent} {what}; create the folder first")
    if dest.is_symlink():  # the swap would replace the link, not the folder it points to
        raise CheckpointWriteError(
            f"cannot write folder {dest}: it is a symbolic link; give the folder it points to, {dest.resolve()}"
        )
    if dest.exists() and not dest.is_dir():
        raise CheckpointWriteError(f"cannot write folder {dest}: a file has that name; remove it or choose another")
    remove_stale_temps(dest)
    tmp = temp_path(dest)
    mine = True  # whether a folder at ``tmp`` can only be this call's
    checking = False
    # The temp folder is made inside this try, as atomic_write makes its file: a signal turned
    # into an exception just after mkdir returns must still remove it. The name is unique and
    # mkdir fails if it exists, so a folder there is ours unless mkdir failed.
    try:
        try:
            os.mkdir(tmp)
        except OSError:  # nothing made (another writer's name, a read-only or full filesystem)
            mine = False
            raise
        route = folder_route(dest)  # a folder standing for a store's prefix: its files stream there
        with folder_written_elsewhere(tmp, route) if route is not None else contextlib.nullcontext():
            yield tmp
        fsync_dir(tmp)
        if check is not None:
            checking = True
            check(tmp)
            checking = False
        _install(tmp, dest)
        fsync_dir(parent)
    except BaseException as e:
        if mine:
            shutil.rmtree(tmp, ignore_errors=True)  # absent (interrupted before mkdir) is fine
        if isinstance(e, OSError) and not isinstance(e, CkptkitError) and not checking:  # ours say their own cause
            raise CheckpointWriteError(describe_error(e, dest)) from e
        raise


def check_folder_destination(src: Path, dest: Path, *, force: bool, owned: Callable[[str], bool], what: str) -> None:
    """Raise unless ``dest`` may become a folder output: absent, empty, or (``force``) one holding
    only files of its own kind (``owned(name)``, described as ``what``), never the source's folder.

    The output replaces the whole folder, so anything else there would be lost with it.
    """
    if dest.is_symlink():
        raise ArgumentError(f"{dest} is a symbolic link; give the folder it points to ({dest.resolve()}) or a new path")
    if dest.exists() and not dest.is_dir():
        raise ArgumentError(
            f"{dest} is a file; this output is a folder: give a new folder's path, e.g. {dest.with_suffix('')}/"
        )
    if not dest.is_dir():
        return
    if src.resolve() == dest.resolve() or dest.resolve() in src.resolve().parents:
        raise ArgumentError(f"{dest} holds the source {src}; write to another folder (SRC is never modified)")
    present = sorted(e.name for e in os.scandir(dest))
    if present and not force:
        raise ArgumentError(f"{dest} exists and is not empty; pass {spell('force=True', '--force')} to replace it")
    others = [n for n in present if not owned(n)]
    if others:
        raise ArgumentError(
            f"{dest} holds {summarize(others)} besides {what}; the output replaces the whole folder, "
            "so write to a new folder (or move those files out first)"
        )
