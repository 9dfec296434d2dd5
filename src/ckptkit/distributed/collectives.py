"""The one place ckptkit talks to torch.distributed.

Every helper works with and without a process group (as torchsnapshot's PGWrapper does): with
none, rank is 0, world size is 1 and collectives return their input. With one, small control
messages go over a dedicated gloo group with its own timeout, whatever the training backend is
(nccl cannot carry Python objects without a CUDA tensor round trip, and the default group's
30-minute timeout is too long to notice a dead rank 0).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import weakref
from typing import Any, TypeVar

import torch.distributed as dist

from ..errors import DistributedError, cause

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 1800.0
# (timeout, channel) -> weak references to (the default group it was made under, the control group).
# Weak, so destroy_process_group() really frees the groups while Python is alive: a gloo group
# still alive at interpreter exit can abort the process (a worker thread freeing a finished
# work needs the GIL during finalization; pytorch/pytorch#179291).
_control_groups: dict[tuple[float, str], tuple[Any, Any]] = {}


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


def _control_group(timeout_s: float, channel: str = "main") -> Any:
    # new_group is itself a collective; callers are documented as "must be called on all ranks",
    # so every rank creates the same groups in the same order. A background thread (async
    # saves) gets its own channel: two threads sharing one group would pair collectives wrongly.
    # A process may destroy its group and start a new one (a resume in the same process), which
    # destroys our subgroups too; holding the old WORLD keeps its id from being reused.
    world = dist.group.WORLD
    cached = _control_groups.get((timeout_s, channel))
    if cached is not None and cached[0]() is world:
        group = cached[1]()
        if group is not None:
            return group
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    # new_group can return on one rank before every other rank has connected. Rank 0 writing
    # (and maybe dying) then would leave a slower rank stuck connecting to it, under the store's
    # timeout, not ours: once every rank has passed this barrier, all their connections exist.
    dist.barrier(group=group)
    _control_groups[(timeout_s, channel)] = (weakref.ref(world), weakref.ref(group))
    return group


def _fail(what: str, e: BaseException, timeout_s: float) -> DistributedError:
    text = cause(e, typed=False)
    return DistributedError(
        f"{what} failed on rank {rank()} of {world_size()}: {text}. Another rank died, raised "
        f"before reaching this call, or did not make it within {timeout_s:g} s; this function "
        "must be called on all ranks"
    )


# torch's broadcast_object_list/all_gather_object read tensors back with .numpy(), and numpy
# is not a torch dependency: on a machine without it every object collective fails. These
# move pickled bytes in uint8 tensors and read them back through a buffer view instead.
# Peers are ranks of the same job, so unpickling their messages is as trusted as torch's own.


def _to_tensor(obj: Any) -> Any:
    import torch

    data = pickle.dumps(obj)
    # A copy torch owns: freeing a frombuffer tensor takes the GIL, and when gloo's worker thread
    # drops the last reference while destroy_process_group() holds the GIL, the process hangs
    # for good (torch 2.6: every `ckptkit train` under torchrun at its end).
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone() if data else torch.empty(0, dtype=torch.uint8)


def _from_tensor(t: Any, size: int) -> Any:
    raw = bytes(memoryview((ctypes.c_ubyte * size).from_address(t.data_ptr()))) if size else b""
    return pickle.loads(raw)


def broadcast_object(
    obj: T, *, src: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "broadcast", channel: str = "main"
) -> T:
    """Return ``src``'s ``obj`` on every rank. Must be called on all ranks."""
    if not is_distributed():
        return obj
    import torch

    try:
        group = _control_group(timeout_s, channel)
        payload = _to_tensor(obj) if rank() == src else None
        size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=src, group=group)
        if payload is None:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=src, group=group)
    except RuntimeError as e:  # DistBackendError and timeouts are RuntimeErrors
        raise _fail(what, e, timeout_s) from e
    return obj if rank() == src else _from_tensor(payload, int(size.item()))


def all_gather_object(obj: T, *, timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "all_gather") -> list[T]:
    """Return every rank's ``obj``, indexed by rank. Must be called on all ranks."""
    if not is_distributed():
        return [obj]
    import torch

    mine = _to_tensor(obj)
    try:
        group = _control_group(timeout_s)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size())]
        dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64), group=group)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: mine.numel()] = mine
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size())]
        dist.all_gather(parts, padded, group=group)
    except RuntimeError as e:
        raise _fail(what, e, timeout_s) from e
    return [_from_tensor(p, int(s.item())) for p, s in zip(parts, sizes, strict=True)]


def barrier(*, timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "barrier") -> None:
    """Wait for every rank (no-op without a process group). Must be called on all ranks."""
    if not is_distributed():
        return
    try:
        dist.barrier(group=_control_group(timeout_s))
    except RuntimeError as e:
        raise _fail(what, e, timeout_s) from e


def any_true(flag: bool, *, timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "any_true") -> bool:
    """True on every rank if ``flag`` is True on any rank. Must be called on all ranks."""
    if not is_distributed():
        return flag
    import torch

    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    try:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=_control_group(timeout_s))
    except RuntimeError as e:
        raise _fail(what, e, timeout_s) from e
    return bool(value.item())


def ensure_channel(timeout_s: float, channel: str, *, what: str = "control group set-up") -> None:
    """Create the control group for ``channel`` now (a collective; must be called on all ranks)."""
    if is_distributed():
        try:
            _control_group(timeout_s, channel)
        except RuntimeError as e:
            raise _fail(what, e, timeout_s) from e
