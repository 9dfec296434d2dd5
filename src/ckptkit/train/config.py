"""The trainer's options: one dataclass, each field also a command-line flag."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


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
