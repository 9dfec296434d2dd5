"""Rank functions for multi-process fault tests (imported by name in spawned processes)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from pathlib import Path

import torch

import ckptkit


def save_under_fault(rank: int, world: int, folder: str, fault: str) -> str:
    """Rank 0 saves under a fault; every rank must raise, and the old file must survive."""
    path = Path(folder) / "ckpt.pt"
    if rank == 0 and fault == "file too large":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    if rank == 0 and fault == "permission denied":
        subprocess.run(["chattr", "+i", folder], check=True)
    try:
        ckptkit.save_on_master({"w": torch.zeros(1 << 20)} if rank == 0 else None, path, timeout=30)  # 4 MiB
    except ckptkit.errors.CheckpointWriteError as e:
        return str(e)
    finally:
        if rank == 0 and fault == "permission denied":
            subprocess.run(["chattr", "-i", folder], check=False)
    return "no error"


class _Explodes:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("serialising failed on purpose")


class _Dies:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        os._exit(17)


def rank0_fails(rank: int, world: int, folder: str, how: str) -> str:
    obj = {"w": torch.ones(4), "x": _Explodes() if how == "raises" else _Dies()} if rank == 0 else None
    ckptkit.save_on_master(obj, Path(folder) / "ckpt.pt", timeout=20)
    return "returned"
