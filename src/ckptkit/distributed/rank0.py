"""Rank-0 saving: one writer, every rank agrees on the outcome, nobody hangs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import errors
from .._write import write_checkpoint
from ..errors import CheckpointWriteError, CkptkitError
from ..io.remote import as_destination
from . import collectives as _dist


def rebuild_error(kind: str, message: str, *, default: type[CkptkitError] = CheckpointWriteError) -> CkptkitError:
    """The error rank 0 reported (by class name), raised on another rank."""
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, CkptkitError)):
        cls = default
    return cls(message)


def save_on_master(obj: Any, path: str | os.PathLike[str], *, timeout: float = _dist.DEFAULT_TIMEOUT_S) -> None:
    """Save ``obj`` from global rank 0; every rank returns once the file is complete and durable.

    Must be called on all ranks. Rank 0 writes atomically (temp file in the same folder,
    fsync, ``os.replace``, fsync of the folder), then tells every rank how it went over a gloo
    control group: if rank 0 fails (permission denied, disk full, an object that cannot be
    serialised) every rank raises a :class:`CkptkitError` naming the cause, instead of the
    other ranks waiting forever at a barrier. If rank 0 dies, the others raise
    :class:`DistributedError` once gloo notices the closed connection, or after ``timeout``
    seconds at the latest. Without a process group it simply saves. Other ranks' ``obj`` is
    ignored (it may be ``None``).

    Args:
        obj: what to save: anything ``torch.save`` takes, or for a ``.safetensors`` path a
            mapping of tensors (or a module).
        path: the destination; its folder must exist. A URL (``s3://bucket/key.pt``) is staged
            locally, uploaded and read back before any rank returns.
        timeout: seconds the other ranks wait for rank 0's write at most.

    Raises:
        CheckpointWriteError: the write failed (on every rank).
        ArgumentError: ``obj`` does not fit the format (on every rank).
        DistributedError: a rank died or did not reach this call in time.

    Example:
        >>> save_on_master(model.state_dict(), "ckpt/last.pt")  # doctest: +SKIP
    """
    write_and_agree(obj, as_destination(path), timeout=timeout, channel="main")


def write_and_agree(obj: Any, dest: Path | str, *, timeout: float, channel: str) -> None:
    """Rank 0 writes; every rank learns the outcome over the control group ``channel``."""
    # The group exists before rank 0 starts writing, so if rank 0 dies mid-write the others
    # see gloo's closed connection at once instead of waiting out a rendezvous timeout.
    _dist.ensure_channel(timeout, channel, what=f"save_on_master({dest})")
    failure: Exception | None = None
    status: tuple[str, str] | None = None
    if _dist.rank() == 0:
        try:
            write_checkpoint(obj, dest)
        except Exception as e:  # reported to every rank below, then re-raised
            failure = e
            if isinstance(e, CkptkitError):
                status = (type(e).__name__, str(e))
            else:
                status = ("CheckpointWriteError", f"cannot save {dest}: {type(e).__name__}: {e}")
    status = _dist.broadcast_object(status, timeout_s=timeout, what=f"save_on_master({dest})", channel=channel)
    if status is None:
        return
    if failure is not None:
        if isinstance(failure, CkptkitError):
            raise failure
        raise CheckpointWriteError(status[1]) from failure
    raise rebuild_error(status[0], f"rank 0 failed to save: {status[1]}")
