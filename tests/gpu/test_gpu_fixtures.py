"""Checkpoints a real GPU run wrote (``fixtures/make_gpu_fixtures.py``, on an H200), read on any
machine: with CUDA the tensors land on this rank's GPU, without it on the CPU, and the values are
those the GPU held (``*.expected.pt`` were moved to the CPU on that machine)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import ckptkit
from fixtures.models import TinyNet
from tests.gpu.test_cuda import _cpu, _locations
from tests.train.test_trainer import assert_same_tree


@pytest.fixture
def gpu_dir(fixtures_dir: Path) -> Path:
    return fixtures_dir / "gpu"


def test_the_fixtures_hold_cuda_storages(gpu_dir: Path) -> None:
    # Adam keeps its step counts on the CPU even for CUDA weights; RNG states are CPU tensors.
    assert _locations(gpu_dir / "ddp_cuda0.pt") == {"cuda:0", "cpu"}
    assert _locations(gpu_dir / "scaler_rng_cuda.pt") == {"cuda:0", "cpu"}
    for name in ("ddp_cuda0.pt", "scaler_rng_cuda.pt"):
        assert ckptkit.verify_checkpoint(gpu_dir / name).ok


def test_a_gpu_ddp_checkpoint_loads_onto_this_device(gpu_dir: Path) -> None:
    expected = torch.load(gpu_dir / "ddp_cuda0.expected.pt", weights_only=True)
    got = ckptkit.load_for_rank(gpu_dir / "ddp_cuda0.pt")
    here = torch.device(ckptkit.device_for_rank())
    assert {t.device for t in got["model"].values()} == {here}
    assert list(got["model"]) == [f"module.{k}" for k in expected["model"]]  # the file as it was
    assert_same_tree(_cpu({k.removeprefix("module."): v for k, v in got["model"].items()}), expected["model"])
    assert_same_tree(_cpu(got["optimizer"]), expected["optimizer"])
    model = TinyNet()
    ckptkit.load_for_rank(gpu_dir / "ddp_cuda0.pt", model=model, map_location="cpu")  # module. adapted
    assert_same_tree(model.state_dict(), expected["model"])


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_gpu_ddp_checkpoint_converts_to_plain_weights(gpu_dir: Path, tmp_path: Path, suffix: str) -> None:
    expected = torch.load(gpu_dir / "ddp_cuda0.expected.pt", weights_only=True)
    dst = tmp_path / f"single{suffix}"
    ckptkit.convert_checkpoint(gpu_dir / "ddp_cuda0.pt", dst, model_only=True)
    got = ckptkit.read_checkpoint(dst, map_location="cpu")
    assert_same_tree(dict(got), expected["model"])
    assert ckptkit.verify_checkpoint(dst).ok


def test_a_gpu_training_state_with_grad_scaler_resumes_here(gpu_dir: Path) -> None:
    expected = torch.load(gpu_dir / "scaler_rng_cuda.expected.pt", weights_only=True)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu", init_scale=1.0)
    torch.manual_seed(123)  # anything else: the resume must put the saved stream back
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        state = ckptkit.load_training_state(
            gpu_dir / "scaler_rng_cuda.pt", model=model, optimizer=opt, scaler=scaler, map_location="cpu"
        )
    assert state.step == 4
    assert_same_tree(model.state_dict(), expected["model"])
    assert_same_tree(_cpu(opt.state_dict()), expected["optimizer"])
    assert scaler.state_dict() == expected["scaler"] and expected["scaler"]["scale"] > 0
    assert torch.equal(torch.get_rng_state(), expected["cpu_rng"])
    if torch.cuda.is_available():
        assert torch.equal(torch.cuda.get_rng_state(0), expected["cuda_rng"][0])
    else:
        assert [w for w in seen if "CUDA RNG state" in str(w.message)]  # said, not silently dropped
