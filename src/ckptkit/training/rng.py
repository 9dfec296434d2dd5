"""Capture and restore every global random number generator a training step may draw from.

The captured state holds only tensors, ints, floats, strings, tuples and None, so it loads with
``torch.load(weights_only=True)``: numpy's state array is stored as a tensor.
"""

from __future__ import annotations

import random
import warnings
from typing import Any


def capture_rng_state() -> dict[str, Any]:
    """Return the state of Python's, numpy's (when installed), torch's CPU and CUDA generators.

    Example:
        >>> state = capture_rng_state()
        >>> a = random.random(); restore_rng_state(state); a == random.random()
        True
    """
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        state["numpy"] = None
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    # Only touch CUDA if this process already uses it: initialising it here would grab memory
    # on every visible device.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    else:
        state["cuda"] = None
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned (restore it after anything that draws).

    Example:
        >>> restore_rng_state(capture_rng_state())
    """
    import torch

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    torch.set_rng_state(state["torch"].cpu())
    if state.get("numpy") is not None:
        try:
            import numpy as np
        except ImportError:
            warnings.warn("checkpoint holds numpy RNG state but numpy is not installed; skipped", stacklevel=2)
        else:
            n = state["numpy"]
            keys = n["keys"].numpy().astype(np.uint32)
            np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    cuda = state.get("cuda")
    if cuda and not torch.cuda.is_available():
        warnings.warn("checkpoint holds CUDA RNG state but CUDA is unavailable here; skipped", stacklevel=2)
    elif cuda:
        count = torch.cuda.device_count()
        if count != len(cuda):
            warnings.warn(
                f"checkpoint holds CUDA RNG state for {len(cuda)} device(s), this process sees {count}; "
                f"restored the first {min(count, len(cuda))}",
                stacklevel=2,
            )
        for i, s in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(s, device=i)
