"""Find the plain model inside DataParallel, DistributedDataParallel and torch.compile wrappers,
and the plain weights inside an AveragedModel's state dict."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..formats.producers import averaged_count

if TYPE_CHECKING:
    import torch


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Return the module inside DDP / DataParallel / torch.compile wrappers, in any nesting.

    FSDP is left alone: its state dict is sharded and needs its own API.

    Example:
        >>> import torch.nn as nn
        >>> inner = nn.Linear(2, 2)
        >>> unwrap_model(nn.DataParallel(inner)) is inner
        True
    """
    from torch.nn import DataParallel
    from torch.nn.parallel import DistributedDataParallel

    while True:
        # OptimizedModule lives in torch._dynamo, whose import costs seconds; match it by name.
        if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod  # type: ignore[assignment]  # a Module, whatever nn.Module.__getattr__ says
        elif isinstance(model, (DataParallel, DistributedDataParallel)):
            model = model.module
        else:
            return model


def without_averaged_count(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """An averaging wrapper's state dict without its count (``AveragedModel``'s ``n_averaged``,
    mmengine's EMA ``steps``), so that its ``module.`` (and a DDP model's ``module.module.``) reads
    as a wrapper prefix; any other state dict as it is.

    Example:
        >>> list(without_averaged_count({"module.fc.weight": 0, "n_averaged": 1}))
        ['module.fc.weight']
    """
    count = averaged_count(state_dict)
    if count is None:
        return state_dict
    kept: OrderedDict[str, Any] = OrderedDict((k, v) for k, v in state_dict.items() if k != count)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:  # per-module versions: renamed with the keys by the prefix functions
        kept._metadata = meta  # type: ignore[attr-defined]
    return kept
