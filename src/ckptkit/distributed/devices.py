"""Which device each rank loads onto, and the ``map_location`` that puts tensors there.

Without a ``map_location``, torch puts every storage back on the device it was saved from, so
every DDP rank piles onto ``cuda:0`` (pytorch/pytorch#23138) and a GPU checkpoint fails on a
CPU-only machine. ckptkit sends accelerator storages to this rank's device instead.
"""

from __future__ import annotations

from typing import Any

from ..errors import NO_CUDA_FIX, ArgumentError
from . import collectives

MapLocation = Any  # str | torch.device | dict[str, str] | Callable[[storage, str], storage]


def device_for_rank(
    *, local_rank: int | None = None, cuda_available: bool | None = None, device_count: int | None = None
) -> str:
    """The device this process should load onto: ``cuda:LOCAL_RANK`` or ``cpu``.

    When more processes than GPUs share a node (several ranks on one GPU), ranks wrap around
    the GPUs (``LOCAL_RANK % device_count``) instead of pointing at a GPU that does not exist.

    Example:
        >>> device_for_rank(local_rank=3, cuda_available=True, device_count=8)
        'cuda:3'
        >>> device_for_rank(local_rank=3, cuda_available=False)
        'cpu'
    """
    if cuda_available is None or (cuda_available and device_count is None):
        import torch

        cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
        device_count = torch.cuda.device_count() if cuda_available else 0
    if not cuda_available or not device_count:
        return "cpu"
    rank = collectives.local_rank() if local_rank is None else local_rank
    return f"cuda:{rank % device_count}"


def restore_to(device: str) -> MapLocation:
    """A ``map_location`` sending accelerator storages to ``device`` and CPU ones to the CPU."""
    if device == "cpu":
        return "cpu"
    from torch.serialization import default_restore_location

    def restore(storage: Any, location: str) -> Any:
        # CPU stays CPU because some state must be on the CPU (torch.set_rng_state takes a CPU
        # ByteTensor); accelerator tags (cuda:N, mps, xpu...) go to this rank's device.
        return default_restore_location(storage, "cpu" if location == "cpu" else device)

    return restore


def check_device(map_location: MapLocation, source: str) -> None:
    """Refuse a ``map_location`` naming CUDA on a machine without it, before anything is read."""
    import torch

    if (
        isinstance(map_location, (str, torch.device))
        and torch.device(map_location).type == "cuda"
        and not torch.cuda.is_available()
    ):
        raise ArgumentError(
            f"{source}: map_location={str(map_location)!r} names a CUDA device, but this machine has no CUDA; {NO_CUDA_FIX}"
        )


def single_device(map_location: MapLocation, source: str, kind: str) -> str:
    """The one device a format without location tags (safetensors, DCP) loads onto."""
    import torch

    if map_location is None:
        return device_for_rank()
    if isinstance(map_location, (str, torch.device)):
        check_device(map_location, source)
        return str(map_location)
    raise ArgumentError(f'{source}: {kind} takes a device as map_location ("cpu", "cuda:0"), not {map_location!r}')


class Placement:
    """Where a read puts tensors, from the caller's ``map_location`` (None: this rank's device),
    resolved once for whichever format the source turns out to be.

    Example:
        >>> Placement("cpu", "ckpt.pt").device("ckpt.pt", "a safetensors file")
        'cpu'
    """

    def __init__(self, map_location: MapLocation, source: str) -> None:
        self._requested, self._source = map_location, source

    @property
    def map_location(self) -> MapLocation:
        """For formats whose storages record their device (torch's): accelerator storages to this
        rank's device and CPU ones to the CPU by default, else the caller's, checked."""
        if self._requested is None:
            return restore_to(device_for_rank())
        check_device(self._requested, self._source)
        return self._requested

    def device(self, source: str, what: str) -> str:
        """For formats that record none (safetensors, DCP, ZeRO): the one device."""
        return single_device(self._requested, source, what)
