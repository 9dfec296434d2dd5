"""Train a model with DDP, checkpointed by ckptkit: one file to copy, and to read top to bottom.

    python train_ddp.py                                      # one process: the CPU, or one GPU
    torchrun --standalone --nproc_per_node=2 train_ddp.py    # DDP over gloo on CPUs
    torchrun --standalone --nproc_per_node=8 train_ddp.py --out runs/big --epochs 20   # 8 GPUs: nccl, one each

What each part of ckptkit does here:

- Every --save-every steps, ``save_training_state`` saves the model, the optimizer, the
  scheduler, the sampler's place in the epoch and every rank's RNG. It is ``save_on_master``
  underneath: rank 0 writes the file atomically and every rank waits until it is complete.
  ``CheckpointFolder`` then points ``latest`` at it and keeps the newest --keep files.
- SIGTERM, SIGINT (Ctrl-C) or SIGHUP on any rank (a scheduler preempting the job, say): every
  rank stops at the same step, saves, and exits 0.
- Killed outright (SIGKILL, a lost node): run the same command again. ``load_training_state``
  resumes from the newest complete checkpoint, and the run ends with the same weights, bit for
  bit, as a run that was never stopped (with the same number of processes, on the same hardware).
- --init-from FILE starts a new run from weights saved anywhere (DDP's ``module.`` keys,
  torch.compile's ``_orig_mod.``, saved on any GPU) with ``load_for_rank``.
- At the end ``save_on_master`` writes OUT/model.safetensors: plain keys, for inference.

To train your own model, replace ``make_data`` and ``make_model``; the rest stays as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import ckptkit

# -- options ---------------------------------------------------------------------------------------

parser = argparse.ArgumentParser(description="Train a model with DDP, checkpointed by ckptkit.")
parser.add_argument("--out", default="runs/train_ddp", help="folder for checkpoints/ and model.safetensors")
parser.add_argument("--epochs", type=int, default=5, help="passes over the training set")
parser.add_argument("--batch-size", type=int, default=32, help="samples per process per step")
parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
parser.add_argument("--warmup-steps", type=int, default=20, help="steps of linear warmup, then cosine decay")
parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
parser.add_argument("--keep", type=int, default=3, help="checkpoints kept in OUT/checkpoints")
parser.add_argument("--log-every", type=int, default=10, help="steps between log lines")
parser.add_argument("--seed", type=int, default=0, help="the same seed and options give the same run")
parser.add_argument("--resume", choices=("auto", "none"), default="auto", help="auto: from the newest checkpoint")
parser.add_argument("--init-from", default="", help="weights to start a new run from (not used when resuming)")
args = parser.parse_args()

# -- processes and devices -------------------------------------------------------------------------
# torchrun sets WORLD_SIZE, RANK and LOCAL_RANK. Run with plain python, this is one process
# without a process group, and every ckptkit call below works the same (a barrier is a no-op).

distributed = "WORLD_SIZE" in os.environ
if distributed:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
device = torch.device(ckptkit.device_for_rank())  # cuda:LOCAL_RANK, or cpu without CUDA
if device.type == "cuda":
    torch.cuda.set_device(device)


def log(message: str) -> None:
    if rank == 0:
        print(message, flush=True)


# -- data and model: replace these two with yours --------------------------------------------------


def make_data(seed: int, n_train: int = 4096, n_val: int = 1024, dim: int = 32) -> tuple[TensorDataset, TensorDataset]:
    """Points labelled by a fixed random teacher network: learnable, not trivial, no download."""
    g = torch.Generator().manual_seed(seed + 12345)
    w1, w2 = torch.randn(dim, 64, generator=g) / dim**0.5, torch.randn(64, 10, generator=g)
    x = torch.randn(n_train + n_val, dim, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def make_model(dim: int = 32, hidden: int = 128, classes: int = 10) -> nn.Module:
    # Dropout draws random numbers at every step: an exact resume must restore each rank's RNG.
    return nn.Sequential(
        nn.Linear(dim, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, classes),
    )


def seed_everything(seed: int) -> None:
    """torch's, Python's and numpy's generators: a checkpoint restores all three, and data
    augmentation may draw from any, so one left unseeded makes two runs of one seed differ."""
    torch.manual_seed(seed)
    random.seed(seed)
    with contextlib.suppress(ImportError):  # numpy is optional for torch
        import numpy

        numpy.random.seed(seed % 2**32)


train_set, val_set = make_data(args.seed)
seed_everything(args.seed)  # the same initial weights on every rank
model = make_model().to(device)
seed_everything(args.seed + rank)  # then one random stream per rank (dropout)

# Each rank trains on its own shard, in DistributedSampler's order; the sampler also counts the
# samples consumed, so a resume mid-epoch goes on from the next one, not the epoch's start.
sampler = ckptkit.ResumableDistributedSampler(train_set, shuffle=True, seed=args.seed)
# The loaders get generators of their own: iter(DataLoader) otherwise draws from the global RNG,
# the one a resume restores, and every later dropout mask would shift.
loader_gen = torch.Generator()
loader = DataLoader(
    train_set, batch_size=args.batch_size, sampler=sampler, generator=loader_gen, pin_memory=device.type == "cuda"
)
val_loader = DataLoader(val_set, batch_size=256, generator=torch.Generator())

opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
steps_per_epoch = math.ceil(math.ceil(len(train_set) / world) / args.batch_size)  # as DistributedSampler pads
total_steps = args.epochs * steps_per_epoch


def lr_factor(step: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak at the last step."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

# -- resume: the newest intact checkpoint in OUT; else --init-from's weights; else from scratch -----

ckpts = ckptkit.CheckpointFolder(os.path.join(args.out, "checkpoints"), keep=args.keep)  # made if missing
step, epoch = 0, 0
path = ckpts.latest() if args.resume == "auto" else None  # must be called on all ranks: rank 0 picks for all
if path is not None:
    # Everything is checked before anything changes (a model that does not fit raises, naming every
    # key); then the sampler's place, weights, optimizer, scheduler, and this rank's RNG last.
    state = ckptkit.load_training_state(path, model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    step, epoch = state.step, state.epoch
    log(f"resumed from step {step} (epoch {epoch}) of {path}")
elif args.init_from:
    # Weights only, onto this rank's device, whatever wrapped the model that saved them.
    ckptkit.load_for_rank(args.init_from, model=model)
    log(f"initialised from {args.init_from}")

# Wrapped after loading: DDP starts every rank from rank 0's weights, which are the loaded ones.
net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if distributed else model

# -- checkpoints and evaluation --------------------------------------------------------------------

stop = ckptkit.StopSignal()  # SIGTERM, SIGINT or SIGHUP on any rank: every rank stops at the same step
last_saved, saved_path = step, path


def save() -> None:
    """Save the training state at this step. Must be called on all ranks."""
    global last_saved, saved_path
    if step == last_saved:
        return
    path = ckpts.path_for(step)
    ckptkit.save_training_state(
        path, model=net, optimizer=opt, scheduler=sched, sampler=sampler, epoch=epoch, step=step
    )  # model saved with plain keys; all ranks return once rank 0's file is complete
    ckpts.commit(path)  # only now does `latest` name it: a kill mid-save leaves the previous one
    last_saved, saved_path = step, path


@torch.no_grad()
def evaluate() -> float:
    """Validation accuracy, on rank 0: the plain model in eval mode, so no collective and no random draw."""
    model.eval()
    correct = sum(int((model(x.to(device)).argmax(1) == y.to(device)).sum()) for x, y in val_loader)
    model.train()
    return correct / len(val_set)


# -- the loop --------------------------------------------------------------------------------------

stopped = False
while epoch < args.epochs and not stopped:
    sampler.set_epoch(epoch)  # a new epoch starts at its first sample; a resumed one keeps its place
    loader_gen.manual_seed(args.seed + epoch)  # DataLoader workers' seeds: the same after a resume
    net.train()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over the ranks here
        opt.step()
        sched.step()
        sampler.advance(len(x))  # the samples this rank consumed: what the checkpoint's place counts
        step += 1
        if step % args.log_every == 0:
            log(f"step {step} | epoch {epoch} | loss {loss.item():.4f} | lr {sched.get_last_lr()[0]:.2e}")
        stopped = stop.should_stop()  # one small all-reduce: the same answer on every rank
        if stopped or step % args.save_every == 0:
            save()
        if stopped:
            break
    else:  # the epoch ran to its end
        epoch += 1
        if rank == 0:
            log(f"epoch {epoch} done at step {step} | val_acc {evaluate():.4f}")

# -- the end ---------------------------------------------------------------------------------------

save()  # the steps since the last checkpoint
if stopped:
    log(f"stopped by a signal at step {step}; saved {saved_path}; run the same command to resume")
else:
    weights = os.path.join(args.out, "model.safetensors")
    ckptkit.save_on_master(ckptkit.unwrap_model(net).state_dict(), weights)  # must be called on all ranks
    log(f"done: {epoch} epochs, {step} steps; weights in {weights}")
stop.restore()
if distributed:
    dist.destroy_process_group()
