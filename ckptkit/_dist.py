"""The one place ckptkit talks to torch.distributed.

Every helper works with and without a process group (as torchsnapshot's PGWrapper does): with
none, rank is 0, world size is 1 and collectives return their input. With one, small control
messages go over a dedicated gloo group with its own timeout, whatever the training backend is
(nccl cannot carry Python objects without a CUDA tensor round trip, and the default group's
30-minute timeout is too long to notice a dead rank 0).
"""

from __future__ import annotations

import datetime
import os
from typing import Any, TypeVar

import torch.distributed as dist

from ._errors import DistributedError

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 1800.0
# timeout -> (the default group it was made under, the control group)
_control_groups: dict[float, tuple[Any, Any]] = {}


def is_distributed() -> bool:
    """True when a default process group is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank, 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks, 1 without a process group."""
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """This process's rank on its node: torchrun's ``LOCAL_RANK``, else 0."""
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(value)
    except ValueError:
        return 0


def _control_group(timeout_s: float) -> Any:
    # new_group is itself a collective; callers are documented as "must be called on all ranks",
    # so every rank creates the same groups in the same order.
    # A process may destroy its group and start a new one (a resume in the same process), which
    # destroys our subgroups too; holding the old WORLD keeps its id from being reused.
    world = dist.group.WORLD
    cached = _control_groups.get(timeout_s)
    if cached is not None and cached[0] is world:
        return cached[1]
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    _control_groups[timeout_s] = (world, group)
    return group


def _fail(what: str, e: BaseException, timeout_s: float) -> DistributedError:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return DistributedError(
        f"{what} failed on rank {rank()} of {world_size()}: {text}. Another rank died, raised "
        f"before reaching this call, or did not make it within {timeout_s:g} s; this function "
        "must be called on all ranks"
    )


def broadcast_object(obj: T, *, src: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "broadcast") -> T:
    """Return ``src``'s ``obj`` on every rank. Must be called on all ranks."""
    if not is_distributed():
        return obj
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=src, group=_control_group(timeout_s))
    except RuntimeError as e:  # DistBackendError and timeouts are RuntimeErrors
        raise _fail(what, e, timeout_s) from e
    return box[0]


def all_gather_object(obj: T, *, timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "all_gather") -> list[T]:
    """Return every rank's ``obj``, indexed by rank. Must be called on all ranks."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    try:
        dist.all_gather_object(out, obj, group=_control_group(timeout_s))
    except RuntimeError as e:
        raise _fail(what, e, timeout_s) from e
    return out


def barrier(*, timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "barrier") -> None:
    """Wait for every rank (no-op without a process group). Must be called on all ranks."""
    if not is_distributed():
        return
    try:
        dist.barrier(group=_control_group(timeout_s))
    except RuntimeError as e:
        raise _fail(what, e, timeout_s) from e
