"""Functions that run on every rank of a real gloo group (see tests/group.py).

They live in an importable module because spawned processes import them by name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import ckptkit
from fixtures.models import TinyNet


def save_each_rank_own_object(rank: int, world: int, path: str) -> dict[str, Any]:
    """Every rank offers a different object; only rank 0's may end up in the file."""
    ckptkit.save_on_master({"writer": torch.tensor([rank]), "payload": torch.full((1000,), float(rank))}, path)
    # Right after the call, this rank must see the complete file.
    seen = ckptkit.read_checkpoint(path)
    return {"writer": int(seen["writer"]), "payload_ok": bool(torch.equal(seen["payload"], torch.zeros(1000)))}


class _Explodes:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("serialising failed on purpose")


class _Dies:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        os._exit(13)  # rank 0's process vanishes mid-save, as under the OOM killer


def save_with_rank0_fault(rank: int, world: int, path: str, fault: str) -> None:
    obj: Any = {"w": torch.ones(2)}
    if rank == 0 and fault == "raise":
        obj["bad"] = _Explodes()
    if rank == 0 and fault == "die":
        obj["bad"] = _Dies()
    ckptkit.save_on_master(obj if rank == 0 else None, path, timeout=20)


def rank0_skips_the_call(rank: int, world: int, path: str) -> None:
    """The classic bug: `if rank == 0: save(...)` inverted; the others must not wait forever."""
    if rank != 0:
        ckptkit.save_on_master(None, path, timeout=3)
    else:
        import time

        time.sleep(8)


def load_into_live_ddp(rank: int, world: int, fixtures: str) -> bool:
    ddp = DDP(TinyNet())
    ckptkit.load_for_rank(Path(fixtures) / "plain.pt", model=ddp)
    ref = torch.load(Path(fixtures) / "plain.pt", weights_only=True)
    return all(torch.equal(ddp.module.state_dict()[k], v) for k, v in ref.items())


# --- exact resume ---------------------------------------------------------------------------


class IndexedData(Dataset):  # type: ignore[type-arg]
    """40 fixed samples that also return their index, so tests can see which were consumed."""

    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def train(
    rank: int, world: int, out: str, phase: str, total_steps: int, stop_at: int, batch: int = 4
) -> dict[str, Any]:
    """Train TinyNet under DDP; phase "straight" runs to the end, "first" saves at stop_at and
    returns, "resume" continues from that save to the end. Returns what each rank consumed."""
    torch.manual_seed(1000 + rank)  # per-rank RNG streams differ, so restoring the right one matters
    ckpt = Path(out) / "state.pt"
    model = TinyNet()
    ddp = DDP(model)  # broadcasts rank 0's initial weights
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    data = IndexedData()
    sampler = ckptkit.ResumableDistributedSampler(data, shuffle=True, seed=7)
    # The loader gets its own generator: iter(loader) would otherwise draw from the global RNG.
    loader = DataLoader(data, batch_size=batch, sampler=sampler, generator=torch.Generator().manual_seed(0))

    step, epoch = 0, 0
    if phase == "resume":
        state = ckptkit.load_training_state(
            ckpt, model=ddp, optimizer=opt, scheduler=sched, scaler=scaler, sampler=sampler
        )
        step, epoch = state.step, state.epoch
    consumed: list[tuple[int, int]] = []  # (epoch, sample index)
    while step < total_steps:
        sampler.set_epoch(epoch)
        for x, y, idx in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            sampler.advance(len(x))
            consumed += [(epoch, int(i)) for i in idx]
            step += 1
            if phase == "first" and step == stop_at:
                ckptkit.save_training_state(
                    ckpt,
                    model=ddp,
                    optimizer=opt,
                    scheduler=sched,
                    scaler=scaler,
                    sampler=sampler,
                    epoch=epoch,
                    step=step,
                )
                return {"consumed": consumed}
            if step == total_steps:
                break
        epoch += 1
    if rank == 0:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "scaler": scaler.state_dict(),
            },
            Path(out) / f"final_{phase}.pt",
        )
    # The next draw from each rank's RNG: equal only if each rank's stream was restored.
    return {"consumed": consumed, "next_draw": torch.rand(3).tolist()}
