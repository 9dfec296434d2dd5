"""CheckpointFolder, AsyncSaver and StopSignal in one process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.io.atomic import TMP_SUFFIX
from ckptkit.training.rng import capture_rng_state, restore_rng_state
from fixtures.models import TiedLM, TinyNet


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
    with pytest.raises(ckptkit.errors.ArgumentError, match="keep must be at least 1"):
        ckptkit.CheckpointFolder(tmp_path, keep=0)


def test_async_save_equals_sync_save(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    done = []
    with ckptkit.AsyncSaver() as saver:
        state = capture_rng_state()
        original = model.fc1.weight.detach().clone()
        saver.save_training_state(tmp_path / "a.pt", model=model, optimizer=opt, step=1, on_done=lambda: done.append(1))
        with torch.no_grad():
            model.fc1.weight.add_(1.0)  # training goes on: the staged copy must not see this
        restore_rng_state(state)
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
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match="does not exist"):
        saver.wait()
    saver.wait()  # reported once


def test_stop_signal_catches_sigterm_and_restores_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with ckptkit.StopSignal() as stop:
        assert stop.should_stop() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.should_stop() is True
    assert signal.getsignal(signal.SIGTERM) is before


# -- CheckpointFolder with another suffix ---------------------------------------------------


# Was: latest() only opens torch zips, so a committed .safetensors checkpoint is never latest.
def test_safetensors_checkpoint_folder_has_a_latest(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    folder = ckptkit.CheckpointFolder(tmp_path / "c", suffix=".safetensors")
    path = folder.path_for(10)
    ckptkit.save_on_master({"w": torch.ones(3)}, path)
    folder.commit(path)
    assert folder.checkpoints() == [path]
    assert folder.latest() == path


# -- AsyncSaver and tied weights ------------------------------------------------------------


def _tied_pair(obj: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return obj["embed.weight"], obj["head.weight"]


# Was: AsyncSaver's host copy unties tied weights, so its file is bigger than a sync save.
@pytest.mark.parametrize("what", ["save", "save_training_state"])
def test_async_save_keeps_tied_weights_tied(tmp_path: Path, what: str) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    assert model.head.weight is model.embed.weight
    a, b = tmp_path / "async.pt", tmp_path / "sync.pt"
    with ckptkit.AsyncSaver() as saver:
        if what == "save":
            saver.save(model.state_dict(), a)
        else:
            saver.save_training_state(a, model=model, step=1)
    if what == "save":
        ckptkit.save_on_master(model.state_dict(), b)
    else:
        ckptkit.save_training_state(b, model=model, step=1)
    loaded = torch.load(a, weights_only=True)
    state = loaded if what == "save" else loaded["model"]
    t1, t2 = _tied_pair(state)
    assert torch.equal(t1, model.embed.weight.detach()) and torch.equal(t2, model.head.weight.detach())
    tied = t1.untyped_storage().data_ptr() == t2.untyped_storage().data_ptr()
    assert tied, "the tied keys were saved as two storages"
    assert a.stat().st_size == b.stat().st_size


# -- commit of a path that does not exist --------------------------------------------------


# Was: commit() points `latest` at a file that does not exist.
def test_commit_of_a_missing_file_is_refused(tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(tmp_path)
    with pytest.raises(ckptkit.CkptkitError) as info:
        folder.commit(folder.path_for(10))
    assert isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "latest").exists()


def test_a_checkpoint_folder_creates_itself(tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(tmp_path / "runs" / "x" / "checkpoints")
    ckptkit.save_on_master({"w": torch.ones(1)}, folder.path_for(1))
    folder.commit(folder.path_for(1))
    assert folder.latest() == folder.path_for(1)
