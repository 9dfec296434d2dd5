"""Save and restore a whole training run in one call each, so a resume is exact.

File layout (a plain dict, loadable with ``torch.load(weights_only=True)``)::

    {"ckptkit": {"format": 1, "kind": "training_state", "world_size": W, "torch": "2.x"},
     "model": <state dict, plain keys>, "optimizer": ..., "scheduler": ..., "scaler": ...,
     "sampler": ..., "epoch": int, "step": int, "rng": [per-rank RNG state], "extra": {...},
     "stateful": {name: state dict}}

``optimizer``/``scheduler`` hold one state dict, or a list or dict of them, mirroring what was
passed. The model is saved with plain keys (wrappers removed), so the file also serves a
single-device model; loading adapts the keys to whatever wrapping the target has. ``stateful``
holds any other named objects with ``state_dict()``/``load_state_dict()`` (an EMA model, a
second optimizer, a ``StatefulDataLoader``), as torchsnapshot's and torchtitan's app state do.
:mod:`ckptkit.ops.resume` reads it back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from ..distributed import collectives as _dist
from ..errors import ArgumentError
from ..model.unwrap import unwrap_model
from .rng import capture_rng_state

if TYPE_CHECKING:
    import torch
    from torch.optim.lr_scheduler import LRScheduler

    # What save_training_state and load_training_state take: one, a list, or a dict by name.
    Optimizers: TypeAlias = (
        torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | Mapping[str, torch.optim.Optimizer]
    )
    Schedulers: TypeAlias = LRScheduler | Sequence[LRScheduler] | Mapping[str, LRScheduler]

FORMAT = 1


def shape_of(obj: Any) -> str:
    """How several optimizers or schedulers were passed: ``one``, a ``list`` or a ``dict``."""
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


def is_module(obj: Any) -> bool:
    """An ``nn.Module`` (saved with plain keys, loaded with its wrapping adapted)."""
    return hasattr(obj, "state_dict") and hasattr(obj, "named_modules")


def build_training_state(*, timeout: float = _dist.DEFAULT_TIMEOUT_S, **parts: Any) -> dict[str, Any] | None:
    """The training-state dict on rank 0 (None elsewhere). Must be called on all ranks (RNG gather)."""
    import torch

    unknown = set(parts) - {
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "sampler",
        "epoch",
        "step",
        "extra",
        "stateful",
    }
    if unknown or "model" not in parts:
        raise ArgumentError(
            f"training state takes model= and optimizer/scheduler/scaler/sampler/epoch/step/extra/stateful, not {sorted(unknown)}"
        )
    stateful = dict(parts.get("stateful") or {})
    bad = [
        f"{k} ({type(v).__name__})"
        for k, v in stateful.items()
        if not (isinstance(k, str) and hasattr(v, "state_dict"))
    ]
    if bad:
        raise ArgumentError(f"stateful= maps names to objects with state_dict(); these are not: {', '.join(bad)}")
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
                "shapes": {"optimizer": shape_of(optimizer), "scheduler": shape_of(scheduler)},
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
            "stateful": {
                k: unwrap_model(v).state_dict() if is_module(v) else v.state_dict() for k, v in stateful.items()
            },
        }
    return state
