"""The training loop, in the order it runs: processes, parts, resume, epochs, the end.

``train`` reads top to bottom; each step is a small function below it, except the first and
the last, joining and leaving the process group, which are :mod:`.processes`. Everything about
checkpoints goes through ckptkit's public API: rank-0 atomic saves every rank waits for,
weights-only loads, the resumable sampler, an agreed stop on a signal, a ``latest`` pointer
that only ever names a complete file.
"""

from __future__ import annotations

import contextlib
import functools
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ckptkit
from ckptkit.errors import StateDictMismatchError, summarize

from .config import TrainConfig, check, check_environment, log_folder, run_path, spelled
from .log import Logger
from .processes import Env, end_processes, start_processes
from .schedule import LRSchedule, planned_steps
from .slurm import requeue, requeue_signal, term_ignored
from .task import default_data, default_model, factory, seed_generators


def train(cfg: TrainConfig, *, model: Any = None, data: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """Train, checkpointing as configured; returns the final metrics.

    Under torchrun (``WORLD_SIZE`` set), or as one of several srun tasks, it joins the process
    group; otherwise it runs as one process. Stopped by ``--requeue-signal`` in a SLURM job, it
    saves and rank 0 requeues the job (:mod:`.slurm`). Returns
    ``{"status": "done" | "preempted", "step", "epoch", "val_acc"}``.

    Example:
        >>> train(TrainConfig(out="runs/x", epochs=1), model=my_net, data=(train_set, val_set))  # doctest: +SKIP
    """
    check(cfg)
    check_environment(cfg)
    env = start_processes(cfg)  # 1. processes and devices
    log = Logger(log_folder(cfg) / "metrics.jsonl", enabled=env.master, progress=env.master and sys.stdout.isatty())
    run = _build(cfg, env, model, data)
    resumed = _resume(cfg, env, run)
    log.event(
        "start",
        world_size=env.world,
        backend=env.backend,
        device=str(env.device),
        planned_steps=run.schedule.horizon,
        config=asdict(cfg),
    )
    if resumed is not None:  # after [start]: the run, then where it continues from, then what to do about it
        log.event("resumed", **resumed)
        if run.schedule.horizon <= run.step:
            log.note(
                f"this run already finished ({cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''}, step {run.step}); pass --epochs N with N > {cfg.epochs} "
                f"to train on from here, or --out NEW to start another"
            )
    log.start_bar(total=run.schedule.horizon, done=run.step)
    # A signal on any rank: every rank stops at the same step. The requeue signal too: SLURM sends
    # it (#SBATCH --signal) before the time limit, and its default action would end the process.
    stop = ckptkit.StopSignal(
        tuple(dict.fromkeys((signal.SIGTERM, signal.SIGINT, signal.SIGHUP, requeue_signal(cfg.requeue_signal))))
    )
    saver = ckptkit.AsyncSaver() if cfg.async_save else None
    run.tick = time.perf_counter()
    val_acc = _evaluate(env, run, log) if run.step == 0 else math.nan  # the untrained baseline
    status = "done"
    while run.epoch < cfg.epochs and not run.finished(cfg):
        status = _run_epoch(cfg, env, run, log, stop, saver)
        if status == "preempted":
            break
        if run.sampler.position >= len(run.sampler.dataset):  # the epoch ran to its end, not cut by --max-steps
            val_acc = _evaluate(env, run, log)
            run.epoch += 1
            run.sampler.set_epoch(run.epoch)  # the checkpoint then says "epoch+1, position 0"
            _save(cfg, run, log, saver, "epoch end")
    result = _finish(cfg, env, run, log, stop, saver, status, val_acc)
    stopped_by = stop.stopped_by
    del run, stop, saver  # DDP holds the process group: free it before the group goes (see end_processes)
    end_processes(env)
    if status == "preempted" and env.master:  # last: every rank has saved, and a requeue ends the job's processes
        with term_ignored():  # SLURM's SIGTERM to a requeued job must not cut the line that says so
            outcome = requeue(stopped_by, signal_name=cfg.requeue_signal, max_requeues=cfg.max_requeues)  # type: ignore[arg-type]
            if outcome is not None:
                log.event(
                    "requeue",
                    requeued=outcome.requeued,
                    job=outcome.job,
                    requeues=outcome.requeues,
                    message=outcome.line,
                    line=outcome.line,
                )
    log.close()
    return result


# -- 2. the parts: model, optimizer, schedule, mixed precision, data --------------------------------


@dataclass
class _Run:
    """Everything the loop works on, and where it is."""

    net: Any
    opt: Any
    sched: Any
    schedule: LRSchedule
    scaler: Any
    amp_dtype: Any
    sampler: Any
    loader: Any
    loader_gen: Any
    val_loader: Any
    ckpts: Any
    loss_sum: Any  # summed over the samples since the last log line, across epoch ends
    step: int = 0
    epoch: int = 0
    last_saved: int = -1
    seen: int = 0
    tick: float = 0.0

    def finished(self, cfg: TrainConfig) -> bool:
        return bool(cfg.max_steps) and self.step >= cfg.max_steps


def _build(cfg: TrainConfig, env: Env, model: Any, data: tuple[Any, Any] | None) -> _Run:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    # Seeds: one model initialisation everywhere, then one RNG stream per rank (dropout).
    torch.manual_seed(cfg.seed)
    model = model if model is not None else (factory(cfg.model, "--model") if cfg.model else default_model())
    train_set, val_set = (
        data if data is not None else (factory(cfg.data, "--data") if cfg.data else default_data(cfg.seed))
    )
    seed_generators(cfg.seed + 1000 * env.rank)

    # Every rank a disjoint shard; the sampler knows its position within the epoch. The loader
    # has its own generator: iter(loader) would otherwise draw from the global RNG.
    sampler = ckptkit.ResumableDistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    loader_gen = torch.Generator()
    pin = env.device.type == "cuda"
    loader = DataLoader(
        train_set,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        generator=loader_gen,
        pin_memory=pin,
    )
    val_loader = DataLoader(
        val_set,
        batch_size=256,
        generator=torch.Generator(),
        pin_memory=pin,
        sampler=DistributedSampler(val_set, shuffle=False) if env.distributed else None,
    )

    model.to(env.device)
    if cfg.sync_bn and env.distributed:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    net = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None) if env.distributed else model
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = LRSchedule(cfg.warmup_steps, planned_steps(cfg, len(train_set), env.world, 0, 0, 0))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
    scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16")
    ckpts = ckptkit.CheckpointFolder(run_path(cfg, "checkpoints"), keep=cfg.keep)
    return _Run(
        net,
        opt,
        sched,
        schedule,
        scaler,
        amp_dtype,
        sampler,
        loader,
        loader_gen,
        val_loader,
        ckpts,
        loss_sum=torch.zeros((), device=env.device),
    )


# -- 3. resume: rank 0 picks the newest intact checkpoint (every CRC checked), every rank loads it ---


def _resume(cfg: TrainConfig, env: Env, run: _Run) -> dict[str, Any] | None:
    """Load the checkpoint ``--resume`` names into ``run``; what the ``resumed`` record says, or None."""
    path = None if cfg.resume == "none" else run.ckpts.latest(full=True) if cfg.resume == "auto" else cfg.resume
    if path is None:
        return None
    try:
        state = ckptkit.load_training_state(
            path, model=run.net, optimizer=run.opt, scheduler=run.sched, scaler=run.scaler, sampler=run.sampler
        )
    except StateDictMismatchError as e:  # another run's checkpoint, or the model changed since
        raise _not_this_model(cfg, path, e) from e
    run.step, run.epoch, run.last_saved = state.step, state.epoch, state.step
    n = len(run.sampler.dataset)
    run.schedule.horizon = planned_steps(cfg, n, env.world, run.step, run.epoch, run.sampler.position)
    moved = f"; saved by {state.world_size} process(es), now {env.world}" if state.world_size != env.world else ""
    return dict(
        step=run.step,
        epoch=run.epoch,
        path=str(path),
        sample=run.sampler.position,
        saved_world_size=state.world_size,
        world_size=env.world,
        line=f"resumed from step {run.step} (checkpoint {path}){moved}",
    )


def _not_this_model(cfg: TrainConfig, path: Path | str, e: StateDictMismatchError) -> StateDictMismatchError:
    """The mismatch, with where the checkpoint came from and how to start fresh instead."""
    shapes = [f"{k}: checkpoint {list(a)} vs model {list(b)}" for k, a, b in e.mismatched]
    parts = [f"{len(e.missing)} missing key(s) ({summarize(e.missing)})"] * bool(e.missing)
    parts += [f"{len(e.unexpected)} unexpected key(s) ({summarize(e.unexpected)})"] * bool(e.unexpected)
    parts += [f"{len(shapes)} shape mismatch(es) ({summarize(shapes, 4)})"] * bool(shapes)
    auto, fresh = spelled("resume='auto'", "--resume auto"), spelled("TrainConfig(resume='none')", "--resume none")
    came = (
        f", the newest checkpoint in {run_path(cfg, 'checkpoints')}, which {auto} (the default) picked"
        if cfg.resume == "auto"
        else ""
    )
    return StateDictMismatchError(
        f"cannot resume from {path}{came}: it does not fit this model: {'; '.join(parts)}. It is another run's, or the "
        f"model changed since: to start fresh, pass {fresh} or {spelled('another out', 'another --out')}; to continue "
        "it, use the model that saved it",
        missing=e.missing,
        unexpected=e.unexpected,
        mismatched=e.mismatched,
    )


# -- 4. one epoch: optimizer steps of --accum micro-batches; log, maybe stop, maybe save ------------


def _run_epoch(cfg: TrainConfig, env: Env, run: _Run, log: Logger, stop: Any, saver: Any) -> str:
    import torch
    import torch.nn.functional as F

    run.sampler.set_epoch(run.epoch)
    run.loader_gen.manual_seed(cfg.seed + run.epoch)
    batches = iter(run.loader)
    while not run.finished(cfg):
        micro = [b for _, b in zip(range(cfg.accum), batches, strict=False)]
        if not micro:
            return "done"
        run.net.train()
        run.opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(micro):
            x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            # DDP averages gradients only on the last micro-batch of the step.
            sync = contextlib.nullcontext() if i == len(micro) - 1 or not env.distributed else run.net.no_sync()
            with sync:
                with torch.autocast(env.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype is not None):
                    loss = F.cross_entropy(run.net(x), y)
                run.scaler.scale(loss / len(micro)).backward()
            run.loss_sum += loss.detach() * len(x)
            run.seen += len(x)
            run.sampler.advance(len(x))
        run.scaler.step(run.opt)
        run.scaler.update()
        run.sched.step()
        run.step += 1
        log.advance(run.epoch)
        if run.step % cfg.log_every == 0 or run.step == run.schedule.horizon:
            _log_train(env, run, log)
        if stop.should_stop():
            return "preempted"
        if cfg.save_every and run.step % cfg.save_every == 0:
            _save(cfg, run, log, saver, "interval")
    return "done"


def _save(cfg: TrainConfig, run: _Run, log: Logger, saver: Any, reason: str) -> None:
    """Must be called on all ranks. Rank 0 writes; ``latest`` moves once the file is complete."""
    if run.step == run.last_saved:
        return
    started = time.perf_counter()
    path = run.ckpts.path_for(run.step)
    parts: dict[str, Any] = dict(
        model=run.net,
        optimizer=run.opt,
        scheduler=run.sched,
        scaler=run.scaler,
        sampler=run.sampler,
        epoch=run.epoch,
        step=run.step,
    )
    if saver is not None:
        saver.save_training_state(path, on_done=functools.partial(run.ckpts.commit, path), **parts)
    else:
        ckptkit.save_training_state(path, **parts)
        run.ckpts.commit(path)
    run.last_saved = run.step
    log.event(
        "save",
        step=run.step,
        reason=reason,
        blocking_s=round(time.perf_counter() - started, 6),
        async_save=saver is not None,
    )


def _log_train(env: Env, run: _Run, log: Logger) -> None:
    import torch
    import torch.distributed as dist

    totals = torch.stack([run.loss_sum.float(), torch.tensor(float(run.seen), device=run.loss_sum.device)])
    if env.distributed:
        dist.all_reduce(totals)  # metrics averaged over every rank's samples
    now = time.perf_counter()
    loss = (totals[0] / totals[1].clamp(min=1)).item()
    rate = totals[1].item() / max(now - run.tick, 1e-9)
    log.metric(
        step=run.step, epoch=run.epoch, loss=round(loss, 6), lr=run.sched.get_last_lr()[0], samples_per_s=round(rate, 1)
    )
    run.loss_sum.zero_()
    run.seen, run.tick = 0, now


def _evaluate(env: Env, run: _Run, log: Logger) -> float:
    """Accuracy on the validation set, over every rank's shard (draws no random numbers)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    run.net.eval()
    totals = torch.zeros(3, device=env.device)  # loss sum, correct, count
    with torch.no_grad():
        for x, y in run.val_loader:
            x, y = x.to(env.device), y.to(env.device)
            logits = run.net(x)
            totals += torch.stack(
                [
                    F.cross_entropy(logits, y, reduction="sum"),
                    (logits.argmax(1) == y).sum(),
                    torch.tensor(len(y), device=env.device),
                ]
            )
    if env.distributed:
        dist.all_reduce(totals)
    acc = (totals[1] / totals[2]).item()
    log.metric(step=run.step, epoch=run.epoch, val_loss=round((totals[0] / totals[2]).item(), 6), val_acc=round(acc, 4))
    return acc


# -- 5. the end: the last checkpoint, then the plain single-device weights --------------------------


def _finish(
    cfg: TrainConfig, env: Env, run: _Run, log: Logger, stop: Any, saver: Any, status: str, val_acc: float
) -> dict[str, Any]:
    # Cut by --max-steps mid-epoch, or resumed with nothing left to do: evaluate what we have.
    if status == "done" and (run.sampler.position not in (0, len(run.sampler.dataset)) or math.isnan(val_acc)):
        val_acc = _evaluate(env, run, log)
    _save(cfg, run, log, saver, "preempted" if status == "preempted" else "final")
    if saver is not None:
        saver.close()
    if status == "done":
        ckptkit.save_on_master(ckptkit.unwrap_model(run.net).state_dict(), run_path(cfg, "model.safetensors"))
    stop.restore()
    # A preempted run's last evaluation is from before the stop: not the model it saved.
    extra: dict[str, Any] = {"val_acc": val_acc} if status == "done" else {}
    log.event("end", status=status, step=run.step, epoch=run.epoch, **extra)
    return {"status": status, "step": run.step, "epoch": run.epoch, "val_acc": val_acc}
