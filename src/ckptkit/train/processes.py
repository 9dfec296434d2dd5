"""The trainer's processes: joining the process group with a device per rank, and leaving it.

The loop (:mod:`.loop`) starts with :func:`start_processes` and ends with
:func:`end_processes`; between them it only reads the :class:`Env` they share. torch is imported
inside each function so that ``ckptkit train --help`` starts without it.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ckptkit

from .config import TrainConfig, log_folder
from .slurm import torch_env


@dataclass
class Env:
    """Where this process runs: its device, the group's backend, and its place in the group.

    Attributes:
        device: the ``torch.device`` this rank trains on.
        backend: the process group's backend, or ``"none"`` for a single process.
        distributed: True under torchrun (``WORLD_SIZE`` set) or as one of several srun tasks.
        rank: this process's rank, 0 for a single process.
        world: how many processes train, 1 for a single process.
    """

    device: Any
    backend: str
    distributed: bool
    rank: int
    world: int

    @property
    def master(self) -> bool:
        """True on rank 0, the one that writes files and logs."""
        return self.rank == 0


def start_processes(cfg: TrainConfig) -> Env:
    """Pick this rank's device, join the process group under torchrun or srun, and make the output folder.

    An srun task (no torchrun) gets torchrun's variables from SLURM's first (:func:`.slurm.torch_env`),
    so everything below, ``ckptkit.device_for_rank`` included, reads one set of names.

    Args:
        cfg: the run's configuration (``device``, ``backend``, ``out``).

    Returns:
        The :class:`Env` the rest of the loop runs in.
    """
    import torch
    import torch.distributed as dist

    os.environ.update(torch_env(os.environ))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    # cuda:LOCAL_RANK, wrapping around when more ranks than GPUs share a node (2 processes on 1 GPU over gloo)
    device = torch.device(ckptkit.device_for_rank(cuda_available=use_cuda) if use_cuda else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    distributed = "WORLD_SIZE" in os.environ
    if distributed and not dist.is_initialized():
        join_launched(backend)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if rank == 0:
        log_folder(cfg).mkdir(parents=True, exist_ok=True)  # checkpoints/: CheckpointFolder's (a URL has no folders)
    return Env(device, backend if distributed else "none", distributed, rank, world)


def join_launched(backend: str) -> None:
    """Join the default process group as torchrun (or srun, its variables made torchrun's) set it
    up: ``env://``. torchrun's store outlives a failed attempt; without a fresh key prefix per
    attempt, restarted workers read the dead attempt's gloo addresses and fail to connect (seen
    with torch 2.13 under --max-restarts; cf. pytorch/pytorch#167288).

    Example:
        >>> join_launched("gloo")  # doctest: +SKIP
    """
    import torch.distributed as dist

    os.environ.update(torch_env(os.environ))
    store, env_rank, env_world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"ckptkit/attempt_{attempt}", store), rank=env_rank, world_size=env_world
    )


@contextlib.contextmanager
def launched_group(backend: str = "gloo") -> Iterator[int]:
    """In the process group torchrun or srun started (:func:`join_launched`) for the block, left
    at its end; yields this process's rank.

    Example:
        >>> with launched_group() as rank:  # doctest: +SKIP
        ...     report = ckptkit.convert_checkpoint("ckpt.dcp", "/shared/hf/", ranks=True)
    """
    import torch.distributed as dist

    join_launched(backend)
    try:
        yield dist.get_rank()
    finally:
        gc.collect()
        dist.destroy_process_group()


def end_processes(env: Env) -> None:
    """Leave the process group while Python is fully alive (the caller has dropped the DDP model
    that holds it): destroy_process_group() then tears every gloo group down now, not during
    interpreter exit, where a gloo worker thread can abort the process (pytorch#179291)."""
    import torch.distributed as dist

    if env.distributed:
        gc.collect()  # DDP's reference cycles
        dist.destroy_process_group()
