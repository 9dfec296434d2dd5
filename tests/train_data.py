"""Small, slightly slow data for trainer tests: kills can land at a chosen step.

Used as ``--data tests.train_data:small`` (workers run from the repository root)."""

from __future__ import annotations

import time
from typing import Any

from torch.utils.data import Dataset

from ckptkit.train import default_data


class Slow(Dataset):  # type: ignore[type-arg]
    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.delay)
        return self.inner[i]


def small() -> tuple[Any, Any]:
    train, val = default_data(seed=0, n_train=512, n_val=128)
    return Slow(train, 0.0005), val
