from __future__ import annotations

import io
import random

import numpy as np
import torch

from ckptkit.training.rng import capture_rng_state, restore_rng_state


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), np.random.randn()


def test_capture_restore_round_trip_through_a_weights_only_file() -> None:
    np.random.randn()  # leave a cached gaussian in numpy's state
    state = capture_rng_state()
    expected = draws()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(loaded)
    assert draws() == expected


def test_cuda_state_is_absent_without_cuda() -> None:
    if torch.cuda.is_available():
        import pytest

        pytest.skip("CUDA present: tests/gpu/test_cuda.py covers its state")
    assert capture_rng_state()["cuda"] is None
