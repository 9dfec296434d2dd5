"""Save and restore a whole training run in one call each, so a resume is exact.

File layout (a plain dict, loadable with ``torch.load(weights_only=True)``)::

    {"ckptkit": {"format": 1, "kind": "training_state", "world_size": W, "torch": "2.x"},
     "model": <state dict, plain keys>, "optimizer": ..., "scheduler": ..., "scaler": ...,
     "sampler": ..., "epoch": int, "step": int, "rng": [per-rank RNG state], "extra": {...}}

``optimizer``/``scheduler`` hold one state dict, or a list or dict of them, mirroring what was
passed. The model is saved with plain keys (wrappers removed), so the file also serves a
single-device model; loading adapts the keys to whatever wrapping the target has.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._devices import MapLocation
from ._fit import load_into_model
from ._read import read_checkpoint
from ._rng import capture_rng_state, restore_rng_state
from ._safety import AllowGlobals
from ._unwrap import unwrap_model
from .dist import collectives as _dist
from .dist.rank0 import save_on_master
from .errors import ArgumentError, ResumeError
from .prefix import WRAPPER_PREFIXES

FORMAT = 1


def _shape(obj: Any) -> str:
    if isinstance(obj, Mapping):
        return "dict"
    if isinstance(obj, Sequence):
        return "list"
    return "one"


def _states(obj: Any) -> Any:
    """state_dict() of one object, or of each in a list/tuple or dict, keeping the shape."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return {k: v.state_dict() for k, v in obj.items()}
    if isinstance(obj, Sequence):
        return [v.state_dict() for v in obj]
    return obj.state_dict()


def _load_states(what: str, objs: Any, saved: Any, saved_shape: str, source: str) -> None:
    if objs is None:
        return
    if saved is None:
        raise ResumeError(f"{source}: has no {what} state, but a {what} was passed to restore")
    shape = _shape(objs)
    if shape != saved_shape:
        raise ResumeError(f"{source}: saved {what} as {saved_shape!r}, but {shape!r} was passed to restore")
    if shape == "dict":
        if set(saved) != set(objs):
            raise ResumeError(f"{source}: {what} entries {sorted(saved)} do not match the ones passed, {sorted(objs)}")
        for k, v in objs.items():
            v.load_state_dict(saved[k])
    elif shape == "list":
        if len(saved) != len(objs):
            raise ResumeError(f"{source}: holds {len(saved)} {what} state(s), {len(objs)} were passed")
        for v, s in zip(objs, saved, strict=True):
            v.load_state_dict(s)
    else:
        objs.load_state_dict(saved)


def save_training_state(
    path: str | os.PathLike[str],
    *,
    model: Any,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    epoch: int = 0,
    step: int = 0,
    extra: Mapping[str, Any] | None = None,
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
        timeout: seconds other ranks wait for rank 0's write.

    Example:
        >>> save_training_state("ckpt/step_100.pt", model=ddp, optimizer=opt,  # doctest: +SKIP
        ...                     scheduler=sched, sampler=sampler, epoch=epoch, step=100)
    """
    save_on_master(
        build_training_state(
            model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, sampler=sampler,
            epoch=epoch, step=step, extra=extra, timeout=timeout,
        ),  # fmt: skip
        path,
        timeout=timeout,
    )


def build_training_state(*, timeout: float = _dist.DEFAULT_TIMEOUT_S, **parts: Any) -> dict[str, Any] | None:
    """The training-state dict on rank 0 (None elsewhere). Must be called on all ranks (RNG gather)."""
    import torch

    unknown = set(parts) - {"model", "optimizer", "scheduler", "scaler", "sampler", "epoch", "step", "extra"}
    if unknown or "model" not in parts:
        raise ArgumentError(f"training state takes model= and optimizer/scheduler/scaler/sampler/epoch/step/extra, not {sorted(unknown)}")
    model, optimizer, scheduler = parts["model"], parts.get("optimizer"), parts.get("scheduler")
    scaler, sampler, extra = parts.get("scaler"), parts.get("sampler"), parts.get("extra")
    rng = _dist.all_gather_object(capture_rng_state(), timeout_s=timeout, what="save_training_state RNG gather")
    state = None
    if _dist.rank() == 0:
        state = {
            "ckptkit": {
                "format": FORMAT,
                "kind": "training_state",
                "world_size": _dist.world_size(),
                "torch": str(torch.__version__),  # TorchVersion is not weights-only loadable
                # one object, a list or a dict: an optimizer state dict is itself a dict.
                "shapes": {"optimizer": _shape(optimizer), "scheduler": _shape(scheduler)},
            },
            "model": unwrap_model(model).state_dict(),
            "optimizer": _states(optimizer),
            "scheduler": _states(scheduler),
            "scaler": None if scaler is None else scaler.state_dict(),
            "sampler": None if sampler is None else sampler.state_dict(),
            "epoch": int(parts.get("epoch", 0)),
            "step": int(parts.get("step", 0)),
            "rng": rng,
            "extra": dict(extra or {}),
        }
    return state


@dataclass
class TrainingState:
    """What :func:`load_training_state` restored, and what it left to the caller.

    Attributes:
        epoch: the epoch the run was in when saved.
        step: the global step when saved.
        extra: the ``extra`` mapping that was saved.
        world_size: how many ranks saved it.
        rng: this rank's saved RNG state, or None (restored already unless
            ``restore_rng=False``; then call :meth:`restore_rng` when ready).
        checkpoint: the whole loaded checkpoint.
    """

    epoch: int
    step: int
    extra: dict[str, Any]
    world_size: int
    rng: dict[str, Any] | None
    checkpoint: dict[str, Any] = field(repr=False)

    def restore_rng(self) -> None:
        """Restore this rank's RNG state (for callers that deferred it)."""
        if self.rng is not None:
            restore_rng_state(self.rng)


def load_training_state(
    path: str | os.PathLike[str],
    *,
    model: Any,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    strict: bool = True,
    restore_rng: bool = True,
    map_location: MapLocation = None,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    wrappers: Iterable[str] = WRAPPER_PREFIXES,
) -> TrainingState:
    """Restore what :func:`save_training_state` saved, in a fixed order.

    Order: sampler position, model weights, optimizer(s), scheduler(s), scaler, and RNG last,
    so nothing that runs during restoring draws from the restored generators. Each rank
    reads the file itself (not a collective) and takes its own RNG stream; a rank beyond the
    saved world size keeps its current RNG state (with a warning).

    Note that ``iter(DataLoader)`` draws one number from torch's global RNG unless the
    DataLoader has its own ``generator=``; give it one, or pass ``restore_rng=False`` and call
    ``state.restore_rng()`` after creating the iterator.

    Args:
        path: a file written by :func:`save_training_state`.
        model, optimizer, scheduler, scaler, sampler: the objects to restore, shaped as when
            saved (one, a list or a dict of optimizers and schedulers).
        strict: a model key that does not fit raises (all of them listed at once).
        restore_rng: restore this rank's RNG state last (else call ``state.restore_rng()``).
        map_location, trust, allow_globals, wrappers: as for :func:`load_for_rank`.

    Raises:
        ResumeError: the file is not a training state, or does not hold what was passed.

    Example:
        >>> state = load_training_state(path, model=ddp, optimizer=opt, sampler=sampler)  # doctest: +SKIP
        >>> for epoch in range(state.epoch, epochs): ...  # doctest: +SKIP
    """
    source = os.fspath(path)
    ckpt = read_checkpoint(source, map_location=map_location, trust=trust, allow_globals=allow_globals)
    meta = ckpt.get("ckptkit") if isinstance(ckpt, Mapping) else None
    if not isinstance(meta, Mapping) or meta.get("kind") != "training_state":
        raise ResumeError(f"{source}: not a ckptkit training state (save it with save_training_state)")
    if meta.get("format", 0) > FORMAT:
        raise ResumeError(f"{source}: written by a newer ckptkit (format {meta['format']}); upgrade ckptkit")
    if sampler is not None:
        if ckpt.get("sampler") is None:
            raise ResumeError(f"{source}: has no sampler state, but a sampler was passed to restore")
        sampler.load_state_dict(ckpt["sampler"])
    load_into_model(model, ckpt["model"], strict=strict, wrappers=wrappers, source=source)
    shapes = meta.get("shapes", {})
    _load_states("optimizer", optimizer, ckpt.get("optimizer"), shapes.get("optimizer", "one"), source)
    _load_states("scheduler", scheduler, ckpt.get("scheduler"), shapes.get("scheduler", "one"), source)
    _load_states("scaler", scaler, ckpt.get("scaler"), "one", source)
    rank, saved = _dist.rank(), ckpt.get("rng") or []
    rng = saved[rank] if rank < len(saved) else None
    if rng is None and saved:
        warnings.warn(
            f"{source}: saved by {len(saved)} rank(s); rank {rank} has no saved RNG state and keeps its own",
            stacklevel=2,
        )
    result = TrainingState(
        epoch=int(ckpt["epoch"]),
        step=int(ckpt["step"]),
        extra=dict(ckpt.get("extra") or {}),
        world_size=int(meta.get("world_size", 1)),
        rng=rng,
        checkpoint=ckpt,
    )
    if restore_rng:
        result.restore_rng()
    return result

