from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ckptkit
from fixtures.models import TinyNet


def parts() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_round_trip_without_process_group(tmp_path: Path) -> None:
    model, opt, sched = parts()
    ckptkit.save_training_state(
        tmp_path / "s.pt",
        model=nn.DataParallel(model),
        optimizer=opt,
        scheduler=sched,
        epoch=3,
        step=17,
        extra={"best": 0.5},
    )
    raw = torch.load(tmp_path / "s.pt", weights_only=True)  # plain torch can read it, safely
    assert list(raw["model"]) == list(model.state_dict())  # saved unwrapped: plain keys
    m2, o2, s2 = parts()
    torch.manual_seed(123)
    state = ckptkit.load_training_state(tmp_path / "s.pt", model=m2, optimizer=o2, scheduler=s2)
    assert (state.epoch, state.step, state.extra, state.world_size) == (3, 17, {"best": 0.5}, 1)
    assert all(torch.equal(a, b) for a, b in zip(m2.state_dict().values(), model.state_dict().values(), strict=True))
    assert s2.state_dict() == sched.state_dict()


def test_several_optimizers_as_a_dict(tmp_path: Path) -> None:
    model, opt, _ = parts()
    opt2 = torch.optim.Adam(model.parameters())
    ckptkit.save_training_state(tmp_path / "s.pt", model=model, optimizer={"a": opt, "b": opt2})
    ckptkit.load_training_state(tmp_path / "s.pt", model=model, optimizer={"a": opt, "b": opt2})
    with pytest.raises(ckptkit.errors.ResumeError, match="saved optimizer as 'dict', but 'one' was passed"):
        ckptkit.load_training_state(tmp_path / "s.pt", model=model, optimizer=opt)


def test_missing_parts_are_named(tmp_path: Path) -> None:
    model, opt, _ = parts()
    ckptkit.save_training_state(tmp_path / "s.pt", model=model)
    with pytest.raises(ckptkit.errors.ResumeError, match="has no optimizer state"):
        ckptkit.load_training_state(tmp_path / "s.pt", model=model, optimizer=opt)
    sampler = ckptkit.ResumableDistributedSampler(range(4))
    with pytest.raises(ckptkit.errors.ResumeError, match="has no sampler state"):
        ckptkit.load_training_state(tmp_path / "s.pt", model=model, sampler=sampler)


def test_a_plain_checkpoint_is_not_a_training_state(fixtures_dir: Path) -> None:
    with pytest.raises(ckptkit.errors.ResumeError, match="not a ckptkit training state"):
        ckptkit.load_training_state(fixtures_dir / "train_ckpt.pt", model=TinyNet())


def test_fixtures_reproduce(fixtures_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(fixtures_dir / "make_fixtures.py"), "--check"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    if last.startswith("cannot compare bytes"):
        pytest.skip(last)
    assert last == "14/14 fixtures reproduce"
