"""The trainer's options: one dataclass whose fields carry their own help, each also a flag.

``check`` refuses values no run can use (a usage error, exit 2); ``check_environment`` refuses
what this machine or folder cannot provide (exit 1). ``ckptkit train`` runs both before it
starts a single worker, so a typo costs one line and creates nothing.

Example:
    >>> parse_args(["--epochs", "5", "--amp", "bf16"]).epochs
    5
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import importlib
import os
import sys
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn

from ckptkit.errors import ArgumentError, CheckpointNotFoundError, CheckpointWriteError, ClassNotFoundError


def _option(default: Any, help: str, *, choices: tuple[str, ...] | None = None, shown: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "shown": shown})


@dataclass
class TrainConfig:
    """Options of the reference trainer; each is also a flag (``max_steps`` is ``--max-steps``)."""

    out: str = _option(
        "runs/ckptkit-demo", "folder (or s3:// URL) for checkpoints/, metrics.jsonl and the final model.safetensors"
    )
    log_dir: str = _option(
        "", "local folder for metrics.jsonl; needed when OUT is a URL (object stores cannot append)", shown="OUT"
    )
    epochs: int = _option(3, "passes over the training set (a finished run trains on when given more)")
    max_steps: int = _option(0, "stop after this many optimizer steps (0: run all epochs)")
    batch_size: int = _option(64, "samples per process per micro-batch")
    accum: int = _option(1, "micro-batches per optimizer step (DDP no_sync on all but the last)")
    lr: float = _option(3e-3, "peak learning rate (linear warmup, cosine decay to 10%%)")
    weight_decay: float = _option(0.01, "AdamW weight decay")
    warmup_steps: int = _option(20, "learning-rate warmup steps")
    seed: int = _option(0, "same seed and options give the same run")
    save_every: int = _option(
        50, "optimizer steps between checkpoints (one is also saved at each epoch end; 0: only those)"
    )
    keep: int = _option(3, "checkpoints kept in OUT/checkpoints")
    resume: str = _option("auto", "auto (newest intact checkpoint in OUT), none, or a checkpoint path")
    async_save: bool = _option(False, "write checkpoints in the background; training waits only for the host copy")
    device: str = _option("auto", "auto: cuda:LOCAL_RANK with CUDA, else cpu", choices=("auto", "cuda", "cpu"))
    backend: str = _option("auto", "auto: nccl on CUDA, gloo on CPU", choices=("auto", "nccl", "gloo"))
    amp: str = _option("none", "bf16: autocast; fp16: autocast + GradScaler", choices=("none", "bf16", "fp16"))
    sync_bn: bool = _option(False, "convert BatchNorm to SyncBatchNorm (CUDA only)")
    num_workers: int = _option(0, "DataLoader worker processes")
    log_every: int = _option(10, "optimizer steps between log lines")
    requeue_signal: str = _option(
        "USR1",
        "in a SLURM job, the signal that saves and requeues it (#SBATCH --signal=B:USR1@90)",
        choices=("USR1", "TERM", "HUP"),
    )
    max_requeues: int = _option(-1, "requeue a SLURM job at most this many times in all (-1: no limit)")
    model: str = _option("", "pkg.module:factory returning your nn.Module", shown="the built-in MLP")
    data: str = _option("", "pkg.module:factory returning (train_dataset, val_dataset)", shown="the built-in task")


_FLAGS: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptkit_train_flags", default=False)


def spelled(keyword: str, flag: str) -> str:
    """An option as the trainer's caller spells it: ``flag`` within :func:`flags_spelled`
    (``python -m ckptkit.train``, ``ckptkit train``), else ``keyword`` (``train(TrainConfig(...))``)."""
    return flag if _FLAGS.get() else keyword


@contextlib.contextmanager
def flags_spelled() -> Iterator[None]:
    """Within this block, the trainer's messages name its flags instead of TrainConfig's fields."""
    token = _FLAGS.set(True)
    try:
        yield
    finally:
        _FLAGS.reset(token)


# (field, smallest allowed value)
_AT_LEAST = {
    "epochs": 0,
    "max_steps": 0,
    "batch_size": 1,
    "accum": 1,
    "warmup_steps": 0,
    "save_every": 0,
    "keep": 1,
    "num_workers": 0,
    "log_every": 1,
    "max_requeues": -1,
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, raised, instead of usage text and SystemExit(2)
        raise ArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser; its errors raise :class:`ckptkit.errors.ArgumentError`."""
    parser = _Parser(prog="ckptkit.train", description="ckptkit's reference DDP trainer.")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        default = f.default if f.default is not MISSING else None
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=meta["help"])
            continue
        kind = {"int": int, "float": float}.get(str(f.type), str)
        shown = meta["shown"] or repr(default)
        among = f"{', '.join(meta['choices'])}; " if meta["choices"] else ""
        parser.add_argument(
            flag,
            type=kind,
            default=default,
            metavar=f.name.upper(),
            choices=meta["choices"],
            help=f"{among}{meta['help']} (default: {shown})",
        )
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse and check the trainer's flags.

    Raises:
        ArgumentError: a malformed flag or a value no run can use.
    """
    args = build_parser().parse_args(argv)
    cfg = TrainConfig(**vars(args))
    check(cfg)
    return cfg


def check(cfg: TrainConfig) -> None:
    """Refuse values no run can use.

    Raises:
        ArgumentError: naming the flag, what it got and what it takes.
    """
    for name, least in _AT_LEAST.items():
        value = getattr(cfg, name)
        if value < least:
            raise ArgumentError(f"argument --{name.replace('_', '-')}: must be at least {least}, got {value}")
    if cfg.lr <= 0:
        raise ArgumentError(f"argument --lr: must be positive, got {cfg.lr}")
    if remote(cfg.out) and not cfg.log_dir:
        name = cfg.out.rstrip("/").rsplit("/", 1)[-1] or "run"
        raise ArgumentError(
            f"argument --out {cfg.out}: an object store cannot append to metrics.jsonl; also pass a local "
            f"folder for the log, e.g. --log-dir runs/{name}"
        )


def remote(path: str) -> bool:
    """Whether ``path`` is a URL (``s3://bucket/run``), which ckptkit's functions take as a path."""
    return "://" in path


def run_path(cfg: TrainConfig, name: str) -> str:
    """``name`` inside ``--out``: a path, or a URL that ckptkit's functions take as one."""
    return f"{cfg.out.rstrip('/')}/{name}" if remote(cfg.out) else os.path.join(cfg.out, name)


def log_folder(cfg: TrainConfig) -> Path:
    """Where ``metrics.jsonl`` goes: ``--log-dir``, else ``--out``."""
    return Path(cfg.log_dir or cfg.out)


def check_environment(cfg: TrainConfig) -> None:
    """Refuse what this machine or folder cannot provide, before anything starts.

    Raises:
        CheckpointWriteError: ``--out`` or ``--log-dir`` is a file, or no folder can be made there.
        CheckpointNotFoundError: ``--resume PATH`` does not exist.
        ClassNotFoundError: ``--model``/``--data`` cannot be imported.
        ArgumentError: ``--sync-bn`` or ``--backend nccl`` without CUDA.
    """
    # Rank 0 makes these folders once the workers have joined: there, a file in the way was a
    # traceback, and the other ranks' ends ("killed by SIGTERM") the line the user read.
    if not remote(cfg.out):
        _check_folder("--out", Path(cfg.out), "checkpoints/, metrics.jsonl and model.safetensors", below="checkpoints")
    if cfg.log_dir and not remote(cfg.log_dir):
        _check_folder("--log-dir", Path(cfg.log_dir), "metrics.jsonl")
    if cfg.resume not in ("auto", "none") and not remote(cfg.resume) and not os.path.exists(cfg.resume):
        raise CheckpointNotFoundError(
            f"--resume {cfg.resume}: no such checkpoint (auto picks the newest in --out)", filename=cfg.resume
        )
    for flag, spec in (("--model", cfg.model), ("--data", cfg.data)):
        if spec:
            resolve(spec, flag)
    if cfg.sync_bn or cfg.backend == "nccl" or cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            what = "--sync-bn" if cfg.sync_bn else "--backend nccl" if cfg.backend == "nccl" else "--device cuda"
            raise ArgumentError(
                f"{what} needs CUDA, and this machine has none (torch's SyncBatchNorm and nccl run on GPUs only)"
            )


def _check_folder(flag: str, folder: Path, holds: str, *, below: str = "") -> None:
    """Refuse a run's folder that the workers could not make or write in, naming what is in the way.

    Raises:
        CheckpointWriteError: a file stands at ``folder``, above it, or at ``folder/below``, or
            the nearest folder that exists cannot be written.
    """
    above = (folder, *folder.parents)
    blocker = next((p for p in ((folder / below,) if below else ()) + above if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        if blocker == folder:
            what = "a file is there"
        elif blocker in above:
            what = f"{blocker} is a file, so no folder can be made in it"
        else:
            what = f"{blocker} is a file, where the run keeps its {below} folder"
        # The suggestion renames the part that is a file, so that the whole path can be folders.
        fixed = _free(blocker) / folder.relative_to(blocker) if blocker in above else _free(folder)
        raise CheckpointWriteError(
            f"{flag} {folder}: {what}; {flag} names the folder for {holds}: pass another, e.g. {flag} {fixed}"
        )
    made = next(p for p in above if p.exists())  # "." at the latest, for a relative path
    if not os.access(made, os.W_OK | os.X_OK):
        raise CheckpointWriteError(
            f"{flag} {folder}: {made} is not writable by this user, so the run's files cannot be made there; "
            f"pass a folder you can write in, e.g. {flag} {Path.home() / 'runs' / folder.name}"
        )


def _free(path: Path) -> Path:
    """``path`` renamed so that nothing exists there: ``run`` -> ``run-run``, ``model.pt`` -> ``model-run``."""
    for n in range(1, 1000):
        candidate = path.with_name(f"{path.stem}-run{n if n > 1 else ''}")
        if not candidate.exists():
            return candidate
    return path.with_name(f"{path.stem}-run-{os.getpid()}")


def resolve(spec: str, flag: str) -> Any:
    """The callable ``pkg.module:factory`` names (not called).

    Raises:
        ArgumentError: ``spec`` is not ``pkg.module:factory``.
        ClassNotFoundError: the module or the name cannot be imported.
    """
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ArgumentError(f"{flag} {spec}: expected pkg.module:factory")
    try:
        return getattr(_import(module), name)
    except (ImportError, AttributeError) as e:
        raise ClassNotFoundError(
            f"{flag} {spec}: cannot import it ({type(e).__name__}: {e}); is the package in the current folder "
            "or on PYTHONPATH?"
        ) from e


def _import(module: str) -> Any:
    """Import ``module``, finding it in the current folder as ``python -m`` does.

    The workers run as ``python -m ckptkit.train``, so ``sys.path`` starts with the current
    folder there; the ``ckptkit`` command is a script, whose ``sys.path`` starts with the folder
    it is installed in. Without the same search here, ``ckptkit train --model mypkg.nets:make``
    refused a ``mypkg/`` in the current folder that every worker would have imported.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        searched = any(os.path.abspath(p or os.curdir) == here for p in sys.path if isinstance(p, str))
        if e.name != module.partition(".")[0] or searched:
            raise
    sys.path.insert(0, here)
    try:
        return importlib.import_module(module)
    except ImportError:
        sys.path.remove(here)  # found nowhere: leave the search path as it was
        raise
