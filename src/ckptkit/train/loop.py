"""The training loop: processes and devices, seeds, data, model, resume, the loop, the end."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ckptkit

from .config import TrainConfig, check, check_environment
from .log import Logger
from .task import default_data, default_model, factory


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

    check(cfg)
    check_environment(cfg)

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
    model = model if model is not None else (factory(cfg.model, "--model") if cfg.model else default_model())
    train_set, val_set = data if data is not None else (factory(cfg.data, "--data") if cfg.data else default_data(cfg.seed))
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
    if cfg.sync_bn and distributed:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if distributed else model
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    horizon = [_planned_steps(cfg, len(train_set), world, 0, 0, 0)]  # a list: updated after a resume
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg.warmup_steps, horizon))
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")

    # -- resume: rank 0 picks the newest intact checkpoint (every CRC checked), every rank loads that one
    ckpts = ckptkit.CheckpointFolder(out / "checkpoints", keep=cfg.keep)
    step, epoch = 0, 0
    resume_path = None if cfg.resume == "none" else ckpts.latest(full=True) if cfg.resume == "auto" else Path(cfg.resume)
    if resume_path is not None:
        state = ckptkit.load_training_state(resume_path, model=net, optimizer=opt, scheduler=sched, scaler=scaler, sampler=sampler)
        step, epoch = state.step, state.epoch
        horizon[0] = _planned_steps(cfg, len(train_set), world, step, epoch, sampler.position)
        log.event("resumed", step=step, epoch=epoch, path=str(resume_path), sample=sampler.position,
                  saved_world_size=state.world_size, world_size=world)  # fmt: skip
        if horizon[0] <= step:
            log.note(f"this run already finished ({cfg.epochs} epochs, step {step}); pass --epochs N with N > {cfg.epochs} "
                     f"to train on from here, or --out NEW to start another")  # fmt: skip
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
    # A preempted run's last evaluation is from before the stop: not the model it saved.
    log.event("end", status=status, step=step, epoch=epoch, **({"val_acc": val_acc} if status == "done" else {}))
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
