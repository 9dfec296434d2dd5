"""The learning-rate schedule and its horizon: how many optimizer steps the run will take."""

from __future__ import annotations

import math

from .config import TrainConfig


class LRSchedule:
    """Linear warmup, then cosine decay to 10% at ``horizon`` (a callable object, so LambdaLR
    saves its two numbers with the scheduler's state)."""

    def __init__(self, warmup: int, horizon: int) -> None:
        self.warmup, self.horizon = warmup, horizon

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.horizon - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def planned_steps(cfg: TrainConfig, n: int, world: int, step: int, epoch: int, position: int) -> int:
    """Optimizer steps done plus those left at this world size (the LR schedule's horizon).

    After a resume with the same world size this is the original horizon, so the schedule is
    unchanged; with another world size the schedule still ends where training ends."""
    per_epoch = math.ceil(math.ceil(n / world) / cfg.batch_size / cfg.accum)
    this_epoch = math.ceil(math.ceil(max(n - position, 0) / world) / cfg.batch_size / cfg.accum)
    left = this_epoch + max(cfg.epochs - epoch - 1, 0) * per_epoch if epoch < cfg.epochs else 0
    return min(step + left, cfg.max_steps) if cfg.max_steps else step + left
