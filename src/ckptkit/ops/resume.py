"""Restore what ``save_training_state`` saved: everything checked first, then applied in order.

A resume that fails halfway is worse than one that fails at once: a sampler moved, an
optimizer loaded and then a model that does not fit leave a run that can neither go on nor be
retried cleanly. So every part is checked against what was passed (the model's keys and
shapes, the optimizers' and schedulers' shapes, the named objects) before any object changes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..distributed import collectives as _dist
from ..distributed.devices import MapLocation
from ..errors import ResumeError
from ..formats.pickles.safety import AllowGlobals
from ..model.fit import fit_to_model
from ..prefix import WRAPPER_PREFIXES
from ..training.rng import restore_rng_state
from ..training.state import FORMAT, is_module, shape_of
from .read import read_checkpoint

if TYPE_CHECKING:
    import torch

    from ..training.sampler import ResumableDistributedSampler
    from ..training.state import Optimizers, Schedulers


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


def _pairs(what: str, objs: Any, saved: Any, saved_shape: str, source: str) -> list[tuple[Any, Any]]:
    """``(object, its saved state)`` for one object or a list or dict of them; checks only."""
    if objs is None:
        return []
    if saved is None:
        raise ResumeError(f"{source}: has no {what} state, but a {what} was passed to restore")
    shape = shape_of(objs)
    if shape != saved_shape:
        raise ResumeError(f"{source}: saved {what} as {saved_shape!r}, but {shape!r} was passed to restore")
    if shape == "dict":
        if set(saved) != set(objs):
            raise ResumeError(f"{source}: {what} entries {sorted(saved)} do not match the ones passed, {sorted(objs)}")
        return [(v, saved[k]) for k, v in objs.items()]
    if shape == "list":
        if len(saved) != len(objs):
            raise ResumeError(f"{source}: holds {len(saved)} {what} state(s), {len(objs)} were passed")
        return list(zip(objs, saved, strict=True))
    return [(objs, saved)]


def load_training_state(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: Optimizers | None = None,
    scheduler: Schedulers | None = None,
    scaler: torch.amp.GradScaler | None = None,
    sampler: ResumableDistributedSampler | None = None,
    stateful: Mapping[str, Any] | None = None,
    strict: bool = True,
    restore_rng: bool = True,
    map_location: MapLocation = None,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    wrappers: Iterable[str] = WRAPPER_PREFIXES,
) -> TrainingState:
    """Restore what :func:`save_training_state` saved, in a fixed order.

    Everything is checked before anything changes: if the model does not fit (or an optimizer
    list, a named object is missing...), the error comes with every object as it was. Then, in
    order: sampler position, model weights, optimizer(s), scheduler(s), scaler, the named
    ``stateful`` objects, and RNG last, so nothing that runs during restoring draws from the
    restored generators. Each rank reads the file itself (not a collective) and takes its own
    RNG stream; a rank beyond the saved world size keeps its current RNG state (with a warning).

    Note that ``iter(DataLoader)`` draws one number from torch's global RNG unless the
    DataLoader has its own ``generator=``; give it one, or pass ``restore_rng=False`` and call
    ``state.restore_rng()`` after creating the iterator.

    Args:
        path: a file written by :func:`save_training_state`.
        model: the model to restore (plain, DDP or compiled, whatever was saved).
        optimizer: the optimizer(s) to restore, shaped as when saved (one, a list or a dict).
        scheduler: the scheduler(s) to restore, shaped as when saved.
        scaler: the GradScaler to restore.
        sampler: the :class:`ResumableDistributedSampler` whose position to restore.
        stateful: the named objects saved with ``stateful=`` (a subset may be restored).
        strict: a model key that does not fit raises (all of them listed at once).
        restore_rng: restore this rank's RNG state last (else call ``state.restore_rng()``).
        map_location: as for :func:`load_for_rank`.
        trust: as for :func:`load_for_rank`.
        allow_globals: as for :func:`load_for_rank`.
        wrappers: as for :func:`load_for_rank`.

    Raises:
        ResumeError: the file is not a training state, or does not hold what was passed.
        StateDictMismatchError: the model does not fit (nothing was changed).

    Example:
        >>> state = load_training_state(path, model=ddp, optimizer=opt, sampler=sampler,  # doctest: +SKIP
        ...                             stateful={"ema": ema_model})
        >>> for epoch in range(state.epoch, epochs): ...  # doctest: +SKIP
    """
    source = os.fspath(path)
    ckpt = read_checkpoint(source, map_location=map_location, trust=trust, allow_globals=allow_globals)
    meta = ckpt.get("ckptkit") if isinstance(ckpt, Mapping) else None
    if not isinstance(meta, Mapping) or meta.get("kind") != "training_state":
        raise ResumeError(f"{source}: not a ckptkit training state (save it with save_training_state)")
    if meta.get("format", 0) > FORMAT:
        raise ResumeError(f"{source}: written by a newer ckptkit (format {meta['format']}); upgrade ckptkit")

    # -- check everything
    if sampler is not None and ckpt.get("sampler") is None:
        raise ResumeError(f"{source}: has no sampler state, but a sampler was passed to restore")
    weights = fit_to_model(model, ckpt["model"], strict=strict, wrappers=wrappers, source=source)
    shapes = meta.get("shapes", {})
    states = (
        _pairs("optimizer", optimizer, ckpt.get("optimizer"), shapes.get("optimizer", "one"), source)
        + _pairs("scheduler", scheduler, ckpt.get("scheduler"), shapes.get("scheduler", "one"), source)
        + _pairs("scaler", scaler, ckpt.get("scaler"), "one", source)
    )
    named = _named(stateful or {}, ckpt.get("stateful") or {}, strict, wrappers, source)

    # -- then change things, RNG last
    if sampler is not None:
        sampler.load_state_dict(ckpt["sampler"])
    model.load_state_dict(weights, strict=strict)
    for obj, saved in states:
        obj.load_state_dict(saved)
    for obj, saved, is_mod in named:
        if is_mod:
            obj.load_state_dict(saved, strict=strict)
        else:
            obj.load_state_dict(saved)
    rank, saved_rng = _dist.rank(), ckpt.get("rng") or []
    rng = saved_rng[rank] if rank < len(saved_rng) else None
    if rng is None and saved_rng:
        warnings.warn(
            f"{source}: saved by {len(saved_rng)} rank(s); rank {rank} has no saved RNG state and keeps its own",
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


def _named(
    objs: Mapping[str, Any], saved: Mapping[str, Any], strict: bool, wrappers: Iterable[str], source: str
) -> list[tuple[Any, Any, bool]]:
    """``(object, state to load, is a module)`` for each named object passed; checks only."""
    missing = [name for name in objs if name not in saved]
    if missing:
        have = ", ".join(sorted(saved)) or "none"
        raise ResumeError(f"{source}: has no saved state for {', '.join(missing)} (stateful= names saved: {have})")
    out = []
    for name, obj in objs.items():
        if is_module(obj):  # adapted to its wrapping, checked like the model
            out.append(
                (
                    obj,
                    fit_to_model(obj, saved[name], strict=strict, wrappers=wrappers, source=f"{source} [{name}]"),
                    True,
                )
            )
        else:
            out.append((obj, saved[name], False))
    return out
