"""CheckpointFolder (and its one writer against rival processes), AsyncSaver and StopSignal."""

from __future__ import annotations

import gc
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.errors import CheckpointFormatError
from ckptkit.io import lease
from ckptkit.io.atomic import TMP_SUFFIX
from ckptkit.io.store import Location
from ckptkit.training.rng import capture_rng_state, restore_rng_state
from fixtures.models import TiedLM, TinyNet
from tests import not_regular
from tests.conftest import ROOT


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


# -- one writer per folder -------------------------------------------------------------------

RECORD = ".ckptkit-writer"  # the folder's writer record: host, pid, since, lease
_WRITER = """
import sys, torch, ckptkit
folder = ckptkit.CheckpointFolder(sys.argv[1], keep=1)
for line in sys.stdin:  # a step to save and commit, one a line, as a trainer would
    step = int(line)
    try:
        path = folder.path_for(step)
        ckptkit.save_on_master({"step": torch.tensor(step)}, path)
        folder.commit(path)
    except ckptkit.CkptkitError as e:
        print(f"refused: {e}", flush=True)
    else:
        print(f"committed {step}", flush=True)
"""


def _writer(folder: Path | str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(folder)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ask(proc: subprocess.Popen[str], step: int) -> str:
    """What the writer says about saving and committing ``step`` (it answers one line a step)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{step}\n")
    proc.stdin.flush()
    answer = proc.stdout.readline().strip()
    assert answer, proc.communicate()  # the writer died
    return answer


def _finish(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait() == 0, proc.communicate()


def _step_in(path: Path | str | None) -> int:
    assert path is not None
    return int(ckptkit.read_checkpoint(path)["step"])


# Was: a requeued job beside the old one on the same folder: each pruned the other's files,
# `latest` named a file the other had deleted, and nothing told either of them.
def test_a_second_live_writer_is_refused_naming_the_first(tmp_path: Path) -> None:
    first, second = _writer(tmp_path), _writer(tmp_path)
    try:
        assert _ask(first, 1) == "committed 1"
        refused = _ask(second, 2)
        assert refused.startswith(f"refused: cannot write to {tmp_path}: another writer holds it (host ")
        assert f"host {platform.node()}, pid {first.pid}, since " in refused and "another folder" in refused
        assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000000001.pt"]  # nothing written by it
        assert _ask(first, 3) == "committed 3"  # the first goes on undisturbed
        assert (tmp_path / "latest").read_text() == "step_000000003.pt\n" and _step_in(
            tmp_path / "step_000000003.pt"
        ) == 3
        _finish(first)  # done with the folder: its record goes with it
        assert not (tmp_path / RECORD).exists()
        assert _ask(second, 4) == "committed 4"
        _finish(second)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000000004.pt"]
    assert _step_in(ckptkit.CheckpointFolder(tmp_path).latest()) == 4


def test_a_killed_writers_lease_is_taken_over(tmp_path: Path) -> None:
    killed = _writer(tmp_path)
    assert _ask(killed, 1) == "committed 1"
    folder = ckptkit.CheckpointFolder(tmp_path, keep=1)
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match=f"pid {killed.pid}, since "):
        folder.path_for(2)
    killed.send_signal(signal.SIGKILL)  # kill -9 runs no cleanup: its record stays, naming a dead pid
    killed.wait()
    assert json.loads((tmp_path / RECORD).read_text())["pid"] == killed.pid
    fill(folder, [2])
    assert json.loads((tmp_path / RECORD).read_text())["pid"] == os.getpid()
    assert folder.checkpoints() == [folder.path_for(2)] and _step_in(folder.latest()) == 2  # it pruned the dead one's


def _record(folder: Path, *, host: str, expires: float) -> None:
    holder = dict(host=host, tag=host, pid=4242, since="2026-01-02T03:04:05+00:00", expires=expires, token="feedface")
    (folder / RECORD).write_text(json.dumps(holder))


def test_a_writer_on_another_host_holds_the_folder_until_its_lease_runs_out(tmp_path: Path) -> None:
    _record(tmp_path, host="other-node", expires=time.time() + 600)  # its pid means nothing here: the lease decides
    with pytest.raises(ckptkit.errors.CheckpointWriteError) as info:
        ckptkit.CheckpointFolder(tmp_path).path_for(1)
    assert "another writer holds it (host other-node, pid 4242, since 2026-01-02T03:04:05+00:00;" in str(info.value)
    _record(tmp_path, host="other-node", expires=time.time() - 1)  # it stopped renewing: dead
    folder = ckptkit.CheckpointFolder(tmp_path)
    fill(folder, [1])
    assert json.loads((tmp_path / RECORD).read_text())["host"] == platform.node()


def test_the_record_is_renewed_and_released(tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(tmp_path)
    fill(folder, [1])
    first = json.loads((tmp_path / RECORD).read_text())
    fill(folder, [2])  # each commit renews the lease
    second = json.loads((tmp_path / RECORD).read_text())
    assert second["expires"] > first["expires"] and second["token"] == first["token"]
    beat = _lease_thread(tmp_path)
    del folder
    gc.collect()
    beat.join(timeout=60)  # the collector only wakes the lease's thread, which releases the folder
    assert not beat.is_alive() and not (tmp_path / RECORD).exists()


def _lease_thread(folder: Path) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name == f"ckptkit lease {folder}")


# Was: the collector ran the release (I/O on the record) on whatever thread it interrupted; in the
# S3 tests that was moto's server thread, whose release then waited for that server: forever.
def test_a_collected_folder_is_released_on_its_lease_thread_never_the_collecting_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran_on = []
    delete = lease._delete

    def recorded(at: Location, version: str) -> None:
        ran_on.append(threading.current_thread().name)
        delete(at, version)

    monkeypatch.setattr(lease, "_delete", recorded)
    folder = ckptkit.CheckpointFolder(tmp_path)
    fill(folder, [1])
    beat = _lease_thread(tmp_path)
    del folder
    gc.collect()
    beat.join(timeout=60)
    assert ran_on == [beat.name] and not (tmp_path / RECORD).exists()


def test_a_writer_whose_lease_was_taken_over_stops_before_latest_moves(tmp_path: Path) -> None:
    """A writer stopped past its lease (SIGSTOP, a hung mount) comes back to a folder another took over."""
    folder = ckptkit.CheckpointFolder(tmp_path, keep=1)
    fill(folder, [1])
    _record(tmp_path, host="other-node", expires=time.time() + 600)  # what the other's takeover wrote
    ckptkit.save_on_master({"step": torch.tensor(2)}, tmp_path / "step_000000002.pt")
    with pytest.raises(ckptkit.errors.CheckpointWriteError) as info:
        folder.commit(tmp_path / "step_000000002.pt")
    assert f"no longer holds {tmp_path / RECORD}: host other-node, pid 4242, since " in str(info.value)
    assert (tmp_path / "latest").read_text() == "step_000000001.pt\n" and (tmp_path / "step_000000001.pt").exists()
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match="no longer holds"):
        folder.path_for(3)
    assert json.loads((tmp_path / RECORD).read_text())["host"] == "other-node"  # never overwritten


# Was: pruning counted every step file, so a checkpoint saved and not yet committed (another
# writer's, or this one's own) was deleted as one of the oldest.
def test_pruning_never_touches_an_uncommitted_checkpoint(tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(tmp_path, keep=1)
    ckptkit.save_on_master({"step": torch.tensor(5)}, folder.path_for(5))  # saved, its commit still to come
    fill(folder, [10, 20])
    assert [p.name for p in folder.checkpoints()] == ["step_000000005.pt", "step_000000020.pt"]
    assert _step_in(folder.latest()) == 20


def test_a_new_writer_prunes_what_the_one_before_committed(tmp_path: Path) -> None:
    fill(ckptkit.CheckpointFolder(tmp_path, keep=None), [1, 2])
    gc.collect()
    (tmp_path / "step_000000009.pt").write_bytes(b"a dead writer's, never committed")
    fill(ckptkit.CheckpointFolder(tmp_path, keep=2), [3, 4])
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_000000003.pt",
        "step_000000004.pt",
        "step_000000009.pt",
    ]


# Was: a reader got a path from latest() that the writer pruned before the reader opened it.
def test_open_latest_holds_the_checkpoint_while_the_writer_prunes_it(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    try:
        assert _ask(writer, 1) == "committed 1"
        reader = ckptkit.CheckpointFolder(tmp_path)
        with reader.open_latest() as path:
            assert path is not None and path.name == "step_000000001.pt"
            assert _ask(writer, 2) == "committed 2"  # keep=1: step 1 is pruned now
            assert not (tmp_path / "step_000000001.pt").exists()
            assert _step_in(path) == 1  # still readable, whole
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(TMP_SUFFIX)]  # the hold is gone
        with reader.open_latest(full=True) as path:
            assert reader.step_of(path) == 2 and _step_in(path) == 2
        _finish(writer)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


def test_open_latest_skips_a_torn_file_and_says_none_for_an_empty_folder(tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(tmp_path, keep=None)
    with folder.open_latest() as path:
        assert path is None
    fill(folder, [1])
    (tmp_path / "step_000000002.pt").write_bytes(b"torn")
    (tmp_path / "latest").write_text("step_000000002.pt\n")
    with folder.open_latest() as path:
        assert path is not None and _step_in(path) == 1


def test_open_latest_refuses_a_fifo_named_latest_instead_of_waiting_on_it(tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(tmp_path, keep=None)
    fill(folder, [1])
    os.mkfifo(tmp_path / "step_000000002.pt")
    (tmp_path / "latest").write_text("step_000000002.pt\n")
    with not_regular.deadline(), pytest.raises(CheckpointFormatError, match="is a FIFO, not a regular"):
        with folder.open_latest():
            pass


def test_every_reader_opens_a_checkpoints_folder_and_its_latest_as_the_checkpoint_named(tmp_path: Path) -> None:
    """`inspect runs/demo/checkpoints/` failed with a list of formats; `inspect .../latest` hex-dumped the pointer."""
    from click.testing import CliRunner

    from ckptkit.cli import main

    folder = ckptkit.CheckpointFolder(tmp_path / "checkpoints", keep=2)
    for step in (1, 2):
        path = folder.path_for(step)
        ckptkit.save_on_master({"model": {"w": torch.full((2,), float(step))}, "step": step}, path)
        folder.commit(path)
    for given in (tmp_path / "checkpoints", tmp_path / "checkpoints" / "latest"):
        assert ckptkit.read_checkpoint(given)["step"] == 2
        assert ckptkit.load_for_rank(given)["step"] == 2
        assert ckptkit.verify_checkpoint(given).ok
        assert ckptkit.inspect_checkpoint(given).path.endswith(Path(str(folder.path_for(2))).name)
        result = CliRunner().invoke(
            main, ["convert", str(given), str(tmp_path / "w.safetensors"), "--model-only", "--force"]
        )
        assert result.exit_code == 0, result.output
        assert torch.equal(ckptkit.read_checkpoint(tmp_path / "w.safetensors")["w"], torch.full((2,), 2.0))
        said = CliRunner().invoke(main, ["inspect", str(given)])
        assert said.exit_code == 0 and "Weights at 'model'" in said.stdout, said.output
