"""Find the plain model inside DataParallel, DistributedDataParallel and torch.compile wrappers."""

from __future__ import annotations

from typing import Any


def unwrap_model(model: Any) -> Any:
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
            model = model._orig_mod
        elif isinstance(model, (DataParallel, DistributedDataParallel)):
            model = model.module
        else:
            return model
