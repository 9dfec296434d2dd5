"""CheckpointFolder, AsyncSaver and StopSignal in one process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.io.atomic import TMP_SUFFIX
from fixtures.models import TinyNet


def fill(folder: ckptkit.CheckpointFolder, steps: list[int]) -> None:
    for step in steps:
        ckptkit.save_on_master({"step": torch.tensor(step)}, folder.path_for(step))
        folder.commit(folder.path_for(step))


def test_commit_points_at_the_latest_and_keeps_the_last_k(tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(tmp_path, keep=2)
    fill(folder, [10, 20, 30])
    assert [p.name for p in folder.checkpoints()] == ["step_000000020.pt", "step_000000030.pt"]
    assert (tmp_path / "latest").read_text() == "step_000000030.pt\n"
    assert folder.latest() == folder.path_for(30)


def test_latest_survives_debris(tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(tmp_path, keep=None)
    fill(folder, [10, 20])
    (tmp_path / f".step_000000030.pt.host-1-abcd{TMP_SUFFIX}").write_bytes(b"half a checkpoint")
    folder.path_for(40).write_bytes(b"torn by a broken disk")  # not a zip: must be skipped
    (tmp_path / "latest").write_text("step_000000099.pt\n")  # names a file that is gone
    assert folder.latest() == folder.path_for(20)


def test_empty_or_missing_folder_has_no_latest(tmp_path: Path) -> None:
    assert ckptkit.CheckpointFolder(tmp_path / "nothing").latest() is None


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ckptkit.ArgumentError, match="keep must be at least 1"):
        ckptkit.CheckpointFolder(tmp_path, keep=0)


def test_async_save_equals_sync_save(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    done = []
    with ckptkit.AsyncSaver() as saver:
        state = ckptkit.capture_rng_state()
        original = model.fc1.weight.detach().clone()
        saver.save_training_state(tmp_path / "a.pt", model=model, optimizer=opt, step=1, on_done=lambda: done.append(1))
        with torch.no_grad():
            model.fc1.weight.add_(1.0)  # training goes on: the staged copy must not see this
        ckptkit.restore_rng_state(state)
        with torch.no_grad():
            model.fc1.weight.copy_(original)
        ckptkit.save_training_state(tmp_path / "b.pt", model=model, optimizer=opt, step=1)
    assert done == [1]
    a, b = (torch.load(tmp_path / n, weights_only=True) for n in ("a.pt", "b.pt"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["optimizer"]["state"][0][k], v) for k, v in b["optimizer"]["state"][0].items())


def test_async_save_error_surfaces_on_wait(tmp_path: Path) -> None:
    saver = ckptkit.AsyncSaver()
    saver.save({"w": torch.ones(1)}, tmp_path / "missing" / "x.pt")
    with pytest.raises(ckptkit.CheckpointWriteError, match="does not exist"):
        saver.wait()
    saver.wait()  # reported once


def test_stop_signal_catches_sigterm_and_restores_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with ckptkit.StopSignal() as stop:
        assert stop.should_stop() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.should_stop() is True
    assert signal.getsignal(signal.SIGTERM) is before
