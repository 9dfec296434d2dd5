"""save_on_master, load_for_rank and exact resume on real gloo process groups (2-3 processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptkit.io.atomic import TMP_SUFFIX
from tests.distributed import dist_workers as w
from tests.group import ok_values, run_group

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world", [2, 3])
def test_only_rank0_writes_and_every_rank_sees_the_complete_file(tmp_path: Path, world: int) -> None:
    path = tmp_path / "ckpt.pt"
    seen = ok_values(run_group(w.save_each_rank_own_object, world, tmp_path, str(path)))
    assert seen == [{"writer": 0, "payload_ok": True}] * world
    assert int(torch.load(path, weights_only=True)["writer"]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(TMP_SUFFIX)]


@pytest.mark.parametrize("world", [2, 3])
def test_rank0_exception_raises_on_every_rank(tmp_path: Path, world: int) -> None:
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"previous checkpoint")
    results = run_group(w.save_with_rank0_fault, world, tmp_path, str(path), "raise", timeout=60)
    for r in results:
        assert r.raised("CheckpointWriteError"), (r.rank, r.status, r.message)
        assert "serialising failed on purpose" in r.message
    assert path.read_bytes() == b"previous checkpoint"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(TMP_SUFFIX)]


def test_missing_folder_on_rank0_raises_on_every_rank(tmp_path: Path) -> None:
    results = run_group(w.save_with_rank0_fault, 3, tmp_path, str(tmp_path / "absent" / "c.pt"), "none", timeout=60)
    for r in results:
        assert r.raised("CheckpointWriteError") and r.raised("OSError"), (r.rank, r.status, r.message)
        assert "does not exist" in r.message


def test_rank0_dying_mid_save_does_not_hang_the_others(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    results = run_group(w.save_with_rank0_fault, 3, tmp_path, str(path), "die", timeout=90)
    assert results[0].status == "died" and results[0].exitcode == 13
    for r in results[1:]:
        assert r.raised("DistributedError"), (
            r.rank,
            r.status,
            r.message,
        )  # not hung: run_group's deadline would say so
    assert not path.exists()


def test_a_rank_that_skips_the_call_times_out_instead_of_hanging(tmp_path: Path) -> None:
    results = run_group(w.rank0_skips_the_call, 2, tmp_path, str(tmp_path / "c.pt"), timeout=60)
    assert results[1].raised("DistributedError")
    assert "must be called on all ranks" in results[1].message


def test_load_for_rank_into_live_ddp(tmp_path: Path, fixtures_dir: Path) -> None:
    assert ok_values(run_group(w.load_into_live_ddp, 2, tmp_path, str(fixtures_dir))) == [True, True]


def _final(out: Path, phase: str) -> dict:
    return torch.load(out / f"final_{phase}.pt", weights_only=True)


def _assert_equal_nested(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal_nested(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("stop_at", [7, 5])  # mid-epoch, and exactly at an epoch boundary
def test_resume_is_bit_exact(tmp_path: Path, stop_at: int) -> None:
    """12 steps straight == stop_at steps, save, a NEW process group, resume, finish."""
    total = 12  # 40 samples / 2 ranks / batch 4 = 5 steps an epoch: crosses two epoch boundaries
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    straight_dir.mkdir()
    split_dir.mkdir()
    straight = ok_values(run_group(w.train, 2, tmp_path, str(straight_dir), "straight", total, stop_at))
    first = ok_values(run_group(w.train, 2, tmp_path, str(split_dir), "first", total, stop_at))
    resumed = ok_values(run_group(w.train, 2, tmp_path, str(split_dir), "resume", total, stop_at))
    a, b = _final(straight_dir, "straight"), _final(split_dir, "resume")
    _assert_equal_nested(a, b)
    assert a["scaler"]["scale"] != 2.0**10  # the scaler's state moved, so restoring it mattered
    for rank in range(2):
        assert first[rank]["consumed"] + resumed[rank]["consumed"] == straight[rank]["consumed"]
        assert resumed[rank]["next_draw"] == straight[rank]["next_draw"]
    assert straight[0]["next_draw"] != straight[1]["next_draw"]  # the ranks' streams differ


def test_resume_with_more_ranks_continues_from_the_same_global_sample(tmp_path: Path) -> None:
    """2 ranks stop 2 steps into epoch 1 (16 of 40 samples); 3 ranks finish that epoch."""
    out = tmp_path / "run"
    out.mkdir()
    first = ok_values(run_group(w.train, 2, tmp_path, str(out), "first", 10, 7))
    resumed = ok_values(run_group(w.train, 3, tmp_path, str(out), "resume", 10, 7))
    before = [i for r in first for e, i in r["consumed"] if e == 1]
    after = [i for r in resumed for e, i in r["consumed"] if e == 1]
    assert len(before) == 16 and len(after) == 24
    assert sorted(before + after) == list(range(40))  # nothing replayed, nothing skipped
