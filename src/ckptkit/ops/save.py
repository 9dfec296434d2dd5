"""Rank-0 saving: one writer, every rank agrees on the outcome, nobody hangs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import errors
from ..distributed import collectives as _dist
from ..errors import CheckpointWriteError, CkptkitError
from ..io.remote import as_destination
from ..training.state import build_training_state
from .write import write_checkpoint

if TYPE_CHECKING:
    import torch

    from ..training.sampler import ResumableDistributedSampler
    from ..training.state import Optimizers, Schedulers


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
        path: the destination; its folder must exist. A URL (``s3://bucket/key.pt``) is streamed
            to the store, committed and checked before any rank returns.
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


def save_training_state(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: Optimizers | None = None,
    scheduler: Schedulers | None = None,
    scaler: torch.amp.GradScaler | None = None,
    sampler: ResumableDistributedSampler | None = None,
    epoch: int = 0,
    step: int = 0,
    extra: Mapping[str, Any] | None = None,
    stateful: Mapping[str, Any] | None = None,
    timeout: float = _dist.DEFAULT_TIMEOUT_S,
) -> None:
    """Save everything an exact resume needs; rank 0 writes atomically.

    Must be called on all ranks: every rank's RNG state is gathered to rank 0 so each rank
    gets its own stream back on resume.

    Args:
        path: destination file (torch zip format).
        model: the model, wrapped (DDP, DataParallel, compiled) or not; saved with plain keys.
        optimizer: an optimizer, or a list or dict of them.
        scheduler: an LR scheduler, or a list or dict of them.
        scaler: an AMP ``GradScaler``.
        sampler: a :class:`ResumableDistributedSampler` (its epoch and global position).
        epoch: the current epoch.
        step: the global step (optimizer steps taken).
        extra: anything else to keep (weights-only loadable types: tensors, numbers,
            strings, lists, dicts).
        stateful: other objects to save by name, each with ``state_dict()`` (an EMA model, a
            second optimizer, a ``StatefulDataLoader``); modules are saved with plain keys.
        timeout: seconds other ranks wait for rank 0's write.

    Example:
        >>> save_training_state("ckpt/step_100.pt", model=ddp, optimizer=opt,  # doctest: +SKIP
        ...                     scheduler=sched, sampler=sampler, epoch=epoch, step=100)
    """
    save_on_master(
        build_training_state(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            sampler=sampler,
            epoch=epoch,
            step=step,
            extra=extra,
            stateful=stateful,
            timeout=timeout,
        ),
        path,
        timeout=timeout,
    )
