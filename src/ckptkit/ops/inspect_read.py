"""What ``inspect`` reads of a checkpoint: its object tree, what counts as a tensor there, and each
tensor's description, torch-free where the format allows (a pickle or header alone; a DCP folder's
``.metadata``; a ZeRO folder's pickles), else loaded with torch.

Example:
    >>> loaded = read_view(registry.detect("fixtures/ddp.pt").open(Path("fixtures/ddp.pt")))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ..formats.pickles.safety import AllowGlobals
from ..formats.producers import Producer, generic_ema, is_averaged, recognise
from ..formats.spec import Info, TensorInfo, View


class Loaded(NamedTuple):
    """What ``inspect`` read: the object tree, what counts as a tensor there, how to describe each,
    the metadata to show, a whole pickled module's class, who wrote it where the format says, and
    notes on where the weights come from."""

    obj: Any
    is_tensor: Callable[[Any], bool]
    info: Info
    meta: dict[str, Any]
    module: str = ""
    producer: Producer | None = None
    notes: list[str] = []


def read_view(view: View) -> Loaded:
    """An opened view, described from its pickles, headers or metadata alone: no tensor bytes."""
    view.close()  # the names, shapes and offsets are read; no tensor bytes are needed
    info, meta, producer = view.describe()
    return Loaded(view.obj, view.is_leaf, info, meta, view.pickled_module, producer, view.notes)


def read_with_torch(path: Path, trust: bool, allow_globals: AllowGlobals) -> Loaded:
    import torch

    from .read import read_checkpoint  # deferred: the torch-free path above needs no torch

    obj = read_checkpoint(path, map_location="cpu", trust=trust, allow_globals=allow_globals)

    def info(name: str, t: Any) -> tuple[TensorInfo, Any, int]:
        storage = t.untyped_storage()
        size = t.numel() * t.element_size()
        return (
            TensorInfo(name, list(t.shape), str(t.dtype).removeprefix("torch."), str(t.device), size),
            storage.data_ptr(),
            storage.nbytes(),
        )

    return Loaded(obj, lambda v: isinstance(v, torch.Tensor), info, {})


def name_producer(
    obj: Any,
    weights_at: str | None,
    is_tensor: Callable[[Any], bool],
    *,
    hint: Producer | None = None,
) -> Producer | None:
    """Who wrote the checkpoint (``hint``: what its format says, a ZeRO or Trainer folder; else
    :mod:`ckptkit.formats.producers`' rules), where its weights and any EMA copy are; None where
    no rule recognises it.

    Example:
        >>> name_producer({"state_dict": {}, "arch": "vit"}, "state_dict", bool).name  # doctest: +SKIP
        'timm'
    """
    found = hint if hint is not None else recognise(obj, is_tensor=is_tensor)
    if (
        found is not None
        and found.ema is None
        and found.name not in ("deepspeed", "hf-trainer", "accelerate", "hf-pretrained")
    ):
        found.ema = generic_ema(obj, found.weights or weights_at, is_tensor)
    if found is None and (ema := generic_ema(obj, weights_at, is_tensor)):
        averaged = is_averaged(obj[ema], is_tensor)
        found = Producer(
            "averaged-model" if averaged else "training-checkpoint",
            f"a training checkpoint whose {ema} is a torch.optim.swa_utils.AveragedModel (SWA/EMA)"
            if averaged
            else "a training checkpoint (no framework's marks)",
            weights=weights_at,
            ema=ema,
        )
    if found is not None and found.weights is None:
        found.weights = weights_at
    return found
