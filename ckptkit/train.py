"""ckptkit's reference DDP trainer: resumable, preemption-safe, elastic.

    ckptkit train --nproc 2 --out runs/demo                       # the built-in task, 2 processes
    torchrun --standalone --nproc_per_node=2 -m ckptkit.train --out runs/demo
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 \\
             --nproc_per_node=8 -m ckptkit.train --out /shared/run   # and node_rank=1 on the other
    ckptkit train --nproc 4 --model mypkg.nets:make_model --data mypkg.data:make_datasets

From code (under torchrun, or as one plain process):

    from ckptkit.train import TrainConfig, train
    train(TrainConfig(out="runs/x", epochs=10), model=MyNet(), data=(train_set, val_set))

It reads top to bottom like nanoGPT's train.py, with every gap closed: rank-0 atomic saves
that every rank waits for, weights-only loads, optimizer/scheduler/scaler/RNG/sampler state,
mid-epoch resume, an agreed stop on SIGTERM, and a ``latest`` pointer that only ever names a
complete file. Everything about checkpoints goes through ckptkit's public API.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ._trainlog import Logger


@dataclass
class TrainConfig:
    """Options of the reference trainer; each is also a flag (``max_steps`` is ``--max-steps``)."""

    out: str = "runs/ckptkit-demo"
    epochs: int = 3
    max_steps: int = 0
    batch_size: int = 64
    accum: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    seed: int = 0
    save_every: int = 50
    keep: int = 3
    resume: str = "auto"
    async_save: bool = False
    device: str = "auto"
    backend: str = "auto"
    amp: str = "none"
    sync_bn: bool = False
    num_workers: int = 0
    log_every: int = 10
    model: str = ""
    data: str = ""


_HELP = {
    "out": "folder for checkpoints/, metrics.jsonl and the final model.safetensors",
    "epochs": "passes over the training set",
    "max_steps": "stop after this many optimizer steps (0: run all epochs)",
    "batch_size": "samples per process per micro-batch",
    "accum": "micro-batches per optimizer step (DDP no_sync on all but the last)",
    "lr": "peak learning rate (linear warmup, cosine decay to 10%%)",
    "weight_decay": "AdamW weight decay",
    "warmup_steps": "learning-rate warmup steps",
    "seed": "same seed and options give the same run",
    "save_every": "optimizer steps between checkpoints (one is also saved at each epoch end)",
    "keep": "checkpoints kept in OUT/checkpoints",
    "resume": "auto (newest complete checkpoint in OUT), none, or a checkpoint path",
    "async_save": "write checkpoints in the background; training waits only for the host copy",
    "device": "auto (cuda:LOCAL_RANK with CUDA, else cpu), cuda or cpu",
    "backend": "auto (nccl on CUDA, gloo on CPU), nccl or gloo",
    "amp": "none, bf16 (autocast) or fp16 (autocast + GradScaler)",
    "sync_bn": "convert BatchNorm to SyncBatchNorm",
    "num_workers": "DataLoader worker processes",
    "log_every": "optimizer steps between log lines",
    "model": "pkg.module:factory returning your nn.Module (default: the built-in MLP)",
    "data": "pkg.module:factory returning (train_dataset, val_dataset) (default: the built-in task)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptkit.train", description="ckptkit's reference DDP trainer.")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=_HELP[f.name])
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=f.default, metavar=f.name.upper(),
                                help=f"{_HELP[f.name]} (default: {f.default!r})")  # fmt: skip
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    return TrainConfig(**vars(build_parser().parse_args(argv)))


# -- the built-in task: deterministic generated data a small model visibly learns ----------------


def default_data(seed: int = 0, n_train: int = 8192, n_val: int = 2048, dim: int = 32, classes: int = 10) -> tuple[Any, Any]:
    """Points labelled by a fixed random teacher network: learnable, not trivial."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(seed + 12345)
    # 1/sqrt(dim) keeps the teacher's tanh out of saturation, so its labels are learnable.
    w1, w2 = torch.randn(dim, 64, generator=g) / dim**0.5, torch.randn(64, classes, generator=g)
    x = torch.randn(n_train + n_val, dim, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def default_model(dim: int = 32, hidden: int = 128, classes: int = 10) -> Any:
    import torch.nn as nn

    return nn.Sequential(
        nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, classes),
    )  # fmt: skip


def _factory(spec: str) -> Any:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise SystemExit(f"ckptkit.train: expected pkg.module:factory, got {spec!r}")
    return getattr(importlib.import_module(module), name)()


def _lr_lambda(warmup: int, horizon: list[int]) -> Any:
    def factor(step: int) -> float:  # linear warmup, then cosine to 10% at horizon[0]
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, horizon[0] - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _planned_steps(cfg: TrainConfig, n: int, world: int, step: int, epoch: int, position: int) -> int:
    """Optimizer steps done plus those left at this world size (the LR schedule's horizon).

    After a resume with the same world size this is the original horizon, so the schedule is
    unchanged; with another world size the schedule still ends where training ends."""
    per_epoch = math.ceil(math.ceil(n / world) / cfg.batch_size / cfg.accum)
    this_epoch = math.ceil(math.ceil(max(n - position, 0) / world) / cfg.batch_size / cfg.accum)
    left = this_epoch + max(cfg.epochs - epoch - 1, 0) * per_epoch if epoch < cfg.epochs else 0
    return min(step + left, cfg.max_steps) if cfg.max_steps else step + left


# -- training ---------------------------------------------------------------------------------------


def train(cfg: TrainConfig, *, model: Any = None, data: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """Train, checkpointing as configured; returns the final metrics.

    Under torchrun (``WORLD_SIZE`` set) it joins the process group; otherwise it runs as one
    process. Returns ``{"status": "done" | "preempted", "step", "epoch", "val_acc", ...}``.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import ckptkit

    # -- processes and devices
    distributed = "WORLD_SIZE" in os.environ
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:  # ranks beyond the GPU count share GPUs (e.g. 2 processes on 1 GPU over gloo)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if distributed and not dist.is_initialized():
        # torchrun's store outlives a failed attempt; without a fresh key prefix per attempt,
        # restarted workers read the dead attempt's gloo addresses and fail to connect (seen
        # with torch 2.13 under --max-restarts; cf. pytorch/pytorch#167288).
        store, env_rank, env_world = next(dist.rendezvous("env://"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"ckptkit/attempt_{attempt}", store),
                                rank=env_rank, world_size=env_world)  # fmt: skip
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    master = rank == 0
    out = Path(cfg.out)
    if master:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    log = Logger(out / "metrics.jsonl", enabled=master, progress=master and sys.stdout.isatty())

    # -- seeds: one model initialisation everywhere, one RNG stream per rank (dropout)
    torch.manual_seed(cfg.seed)
    model = model if model is not None else (_factory(cfg.model) if cfg.model else default_model())
    train_set, val_set = data if data is not None else (_factory(cfg.data) if cfg.data else default_data(cfg.seed))
    torch.manual_seed(cfg.seed + 1000 * rank)

    # -- data: every rank a disjoint shard; the sampler knows its position within the epoch
    sampler = ckptkit.ResumableDistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    # The loader's own generator: iter(loader) would otherwise draw from the global RNG.
    loader_gen = torch.Generator()
    pin = device.type == "cuda"
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                        generator=loader_gen, pin_memory=pin)  # fmt: skip
    val_loader = DataLoader(val_set, batch_size=256, generator=torch.Generator(), pin_memory=pin,
                            sampler=DistributedSampler(val_set, shuffle=False) if distributed else None)  # fmt: skip

    # -- model, optimizer, schedule, mixed precision
    model.to(device)
    if cfg.sync_bn and device.type != "cuda":
        raise SystemExit("ckptkit.train: --sync-bn needs CUDA (torch's SyncBatchNorm runs on GPUs only)")
    if cfg.sync_bn and distributed:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if distributed else model
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    horizon = [_planned_steps(cfg, len(train_set), world, 0, 0, 0)]  # a list: updated after a resume
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg.warmup_steps, horizon))
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")

    # -- resume: rank 0 picks the newest complete checkpoint, every rank loads that one
    ckpts = ckptkit.CheckpointFolder(out / "checkpoints", keep=cfg.keep)
    step, epoch = 0, 0
    resume_path = None if cfg.resume == "none" else ckpts.latest() if cfg.resume == "auto" else Path(cfg.resume)
    if resume_path is not None:
        state = ckptkit.load_training_state(resume_path, model=net, optimizer=opt, scheduler=sched, scaler=scaler, sampler=sampler)
        step, epoch = state.step, state.epoch
        horizon[0] = _planned_steps(cfg, len(train_set), world, step, epoch, sampler.position)
        log.event("resumed", step=step, epoch=epoch, path=str(resume_path), sample=sampler.position,
                  saved_world_size=state.world_size, world_size=world)  # fmt: skip
    log.start_bar(total=horizon[0], done=step)
    saver = ckptkit.AsyncSaver() if cfg.async_save else None
    stop = ckptkit.StopSignal()
    last_saved = step if resume_path is not None else -1

    def save(reason: str) -> None:
        nonlocal last_saved
        if step == last_saved:
            return
        started = time.perf_counter()
        path = ckpts.path_for(step)
        parts: dict[str, Any] = dict(model=net, optimizer=opt, scheduler=sched, scaler=scaler, sampler=sampler, epoch=epoch, step=step)
        if saver is not None:
            saver.save_training_state(path, on_done=lambda: ckpts.commit(path), **parts)
        else:
            ckptkit.save_training_state(path, **parts)
            ckpts.commit(path)
        last_saved = step
        log.event("save", step=step, reason=reason, blocking_s=round(time.perf_counter() - started, 6), async_save=saver is not None)

    # -- the loop: optimizer steps of `accum` micro-batches; save, log, maybe stop, at step ends
    log.event("start", world_size=world, backend=backend if distributed else "none", device=str(device),
              planned_steps=horizon[0], config=asdict(cfg))  # fmt: skip
    done = lambda: bool(cfg.max_steps) and step >= cfg.max_steps  # noqa: E731
    status, loss_sum, seen, tick = "done", torch.zeros((), device=device), 0, time.perf_counter()
    val_acc = float("nan")
    if step == 0:  # the untrained baseline, so the log shows learning (eval draws no random numbers)
        val_acc = _evaluate(net, val_loader, device, dist if distributed else None, log, step, epoch)
    while epoch < cfg.epochs and not done():
        sampler.set_epoch(epoch)
        loader_gen.manual_seed(cfg.seed + epoch)
        batches = iter(loader)
        while not done():
            micro = [b for _, b in zip(range(cfg.accum), batches, strict=False)]
            if not micro:
                break
            net.train()
            opt.zero_grad(set_to_none=True)
            for i, (x, y) in enumerate(micro):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                sync = contextlib.nullcontext() if i == len(micro) - 1 or not distributed else net.no_sync()
                with sync:
                    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                        loss = F.cross_entropy(net(x), y)
                    scaler.scale(loss / len(micro)).backward()
                loss_sum += loss.detach() * len(x)
                seen += len(x)
                sampler.advance(len(x))
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            log.advance(epoch)
            if step % cfg.log_every == 0 or step == horizon[0]:
                tick = _log_train(log, dist if distributed else None, loss_sum, seen, step, epoch, sched, tick, world)
                loss_sum.zero_()
                seen = 0
            if stop.should_stop():
                status = "preempted"
                break
            if cfg.save_every and step % cfg.save_every == 0:
                save("interval")
        if status == "preempted":
            break
        if sampler.position >= len(train_set):  # the epoch ran to its end (not cut by max_steps)
            val_acc = _evaluate(net, val_loader, device, dist if distributed else None, log, step, epoch)
            epoch += 1
            sampler.set_epoch(epoch)  # the checkpoint then says "epoch+1, position 0"
            save("epoch end")

    # -- the end: last checkpoint, then the plain single-device weights
    # Cut by --max-steps mid-epoch, or resumed with nothing left to do: evaluate what we have.
    if status == "done" and (sampler.position not in (0, len(train_set)) or math.isnan(val_acc)):
        val_acc = _evaluate(net, val_loader, device, dist if distributed else None, log, step, epoch)
    save("preempted" if status == "preempted" else "final")
    if saver is not None:
        saver.close()
    if status == "done":
        ckptkit.save_on_master(ckptkit.unwrap_model(net).state_dict(), out / "model.safetensors")
    stop.restore()
    log.event("end", status=status, step=step, epoch=epoch, val_acc=val_acc)
    log.close()
    if distributed:
        # DDP holds the process group; free it (and its reference cycles) while Python is fully
        # alive, so destroy_process_group() tears every gloo group down now and not during
        # interpreter exit, where a gloo worker thread can abort the process (pytorch#179291).
        del net, save, opt, sched
        gc.collect()
        dist.destroy_process_group()
    return {"status": status, "step": step, "epoch": epoch, "val_acc": val_acc}


def _log_train(log: Logger, dist: Any, loss_sum: Any, seen: int, step: int, epoch: int, sched: Any, tick: float, world: int) -> float:
    import torch

    totals = torch.stack([loss_sum.float(), torch.tensor(float(seen), device=loss_sum.device)])
    if dist is not None:
        dist.all_reduce(totals)  # metrics averaged over every rank's samples
    now = time.perf_counter()
    loss = (totals[0] / totals[1].clamp(min=1)).item()
    rate = totals[1].item() / max(now - tick, 1e-9)
    log.metric(step=step, epoch=epoch, loss=round(loss, 6), lr=sched.get_last_lr()[0], samples_per_s=round(rate, 1))
    return now


def _evaluate(net: Any, loader: Any, device: Any, dist: Any, log: Logger, step: int, epoch: int) -> float:
    import torch
    import torch.nn.functional as F

    net.eval()
    totals = torch.zeros(3, device=device)  # loss sum, correct, count
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = net(x)
            totals += torch.stack([F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
    if dist is not None:
        dist.all_reduce(totals)
    acc = (totals[1] / totals[2]).item()
    log.metric(step=step, epoch=epoch, val_loss=round((totals[0] / totals[2]).item(), 6), val_acc=round(acc, 4))
    return acc


def main(argv: list[str] | None = None) -> int:
    result = train(parse_args(argv))
    return 0 if result["status"] in ("done", "preempted") else 1


if __name__ == "__main__":
    sys.exit(main())
