"""ckptkit's reference DDP trainer: resumable, preemption-safe, elastic.

    ckptkit train --nproc 2 --out runs/demo                       # the built-in task, 2 processes
    torchrun --standalone --nproc_per_node=2 -m ckptkit.train --out runs/demo
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 \\
             --nproc_per_node=8 -m ckptkit.train --out /shared/run   # and node_rank=1 on the other
    ckptkit train --nproc 4 --model mypkg.nets:make_model --data mypkg.data:make_datasets
    sbatch examples/slurm/train.sbatch --out runs/demo   # srun, one task per GPU; requeues before the time limit

From code (under torchrun, or as one plain process):

    from ckptkit.train import TrainConfig, train
    train(TrainConfig(out="runs/x", epochs=10), model=MyNet(), data=(train_set, val_set))

It reads top to bottom like nanoGPT's train.py, with every gap closed: rank-0 atomic saves
that every rank waits for, weights-only loads, optimizer/scheduler/scaler/RNG/sampler state,
mid-epoch resume, an agreed stop on SIGTERM, and a ``latest`` pointer that only ever names a
complete file. Everything about checkpoints goes through ckptkit's public API.
"""

from __future__ import annotations

import os
import sys

from ckptkit.errors import CkptkitError

from . import failure
from .config import TrainConfig, build_parser, check, check_environment, flags_spelled, log_folder, parse_args, run_path
from .loop import train
from .processes import launched_group
from .slurm import launched_ranks
from .task import default_data, default_model

__all__ = [
    "TrainConfig",
    "build_parser",
    "check",
    "check_environment",
    "default_data",
    "default_model",
    "launched_group",
    "launched_ranks",
    "log_folder",
    "main",
    "parse_args",
    "run_path",
    "train",
]


def main(argv: list[str] | None = None) -> int:
    """Run the trainer on command-line arguments (``python -m ckptkit.train``).

    Returns 0 when it finished, or saved and stopped on a signal; 2 for a usage error and 1
    for any other ckptkit error, each told in one line by rank 0 (the others fail the same way).
    Under torchrun every error, a ckptkit one or not, is also recorded for the agent
    (:mod:`.failure`); under ``ckptkit train``, which tells the first of them, nothing is printed.
    """
    try:
        with flags_spelled():
            result = train(parse_args(argv))
    except Exception as e:
        failure.record(e)
        if os.environ.get(failure.QUIET):
            return failure.exit_code(e)
        if not isinstance(e, CkptkitError):
            raise  # a bug, here or in the user's code: its traceback is what helps
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":  # srun's tasks, before they join
            print(f"ckptkit.train: error: {e}", file=sys.stderr, flush=True)
        return failure.exit_code(e)
    return 0 if result["status"] in ("done", "preempted") else 1
