"""The built-in task: deterministic generated data a small model visibly learns, and how a
``pkg.module:factory`` option names the user's own model or data instead."""

from __future__ import annotations

import contextlib
import random
from typing import Any

from .config import resolve


def default_data(
    seed: int = 0, n_train: int = 8192, n_val: int = 2048, dim: int = 32, classes: int = 10
) -> tuple[Any, Any]:
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
        nn.Linear(dim, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, classes),
    )


def factory(spec: str, flag: str) -> Any:
    """Call the factory ``pkg.module:factory`` names (``flag`` names it in errors)."""
    return resolve(spec, flag)()


def seed_generators(seed: int) -> None:
    """Seed torch's, Python's and numpy's global generators. Checkpoints restore all three and a
    user's ``--data`` may draw from any, so one left unseeded makes two runs of a seed differ."""
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    with contextlib.suppress(ImportError):  # numpy is optional for the trainer (tests/train/test_trainer.py)
        import numpy

        numpy.random.seed(seed % 2**32)  # numpy takes 0 to 2**32 - 1; torch and Python take any int
