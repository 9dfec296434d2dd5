from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.io.atomic import TMP_SUFFIX
from fixtures.models import TiedLM, TinyNet


class Unpicklable:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("cannot pickle me")


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(TMP_SUFFIX))


@pytest.mark.parametrize("name", ["ckpt.pt", "ckpt.safetensors"])
def test_save_without_process_group_round_trips(tmp_path: Path, name: str) -> None:
    sd = TinyNet().state_dict()
    ckptkit.save_on_master(sd, tmp_path / name)
    loaded = ckptkit.read_checkpoint(tmp_path / name)
    assert list(loaded) == list(sd)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert leftovers(tmp_path) == []


def test_failed_save_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    ckptkit.save_on_master({"v": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match="cannot pickle me"):
        ckptkit.save_on_master({"v": torch.zeros(3), "bad": Unpicklable()}, path)
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match=r"nope does not exist; create the folder first"):
        ckptkit.save_on_master({"v": torch.ones(1)}, tmp_path / "nope" / "ckpt.pt")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_folder_is_a_clear_error(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ckptkit.errors.CheckpointWriteError, match="permission denied"):
            ckptkit.save_on_master({"v": torch.ones(1)}, tmp_path / "ckpt.pt")
    finally:
        tmp_path.chmod(0o700)


def test_saved_file_gets_umask_permissions_not_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        ckptkit.save_on_master({"v": torch.ones(1)}, tmp_path / "ckpt.pt")
    finally:
        os.umask(old)
    assert (tmp_path / "ckpt.pt").stat().st_mode & 0o777 == 0o644


def test_stale_temp_of_a_killed_writer_is_removed(tmp_path: Path) -> None:
    """kill -9 runs no cleanup, so its temp file stays; the next save of that path removes it."""
    path = tmp_path / "ckpt.pt"
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from ckptkit.io.atomic import atomic_write
        with atomic_write({str(path)!r}) as f:
            f.write(b"partial")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], check=False)
    assert proc.returncode == -signal.SIGKILL
    assert len(leftovers(tmp_path)) == 1 and not path.exists()
    ckptkit.save_on_master({"v": torch.ones(1)}, path)
    assert leftovers(tmp_path) == []
    assert torch.equal(ckptkit.read_checkpoint(path)["v"], torch.ones(1))


def test_temp_of_a_live_writer_is_left_alone(tmp_path: Path) -> None:
    from ckptkit.io.atomic import _HOST

    live = tmp_path / f".ckpt.pt.{_HOST}-{os.getpid()}-abcd1234{TMP_SUFFIX}"
    live.write_bytes(b"in progress")
    ckptkit.save_on_master({"v": torch.ones(1)}, tmp_path / "ckpt.pt")
    assert live.exists()


def test_safetensors_refuses_non_tensors_by_name(tmp_path: Path) -> None:
    with pytest.raises(ckptkit.errors.ArgumentError, match=r"2 entries are not: epoch \(int\), args \(dict\)"):
        ckptkit.save_on_master({"w": torch.ones(1), "epoch": 3, "args": {}}, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_safetensors_from_a_module_keeps_tied_weights(tmp_path: Path) -> None:
    lm = TiedLM()
    ckptkit.save_on_master(lm, tmp_path / "lm.safetensors")
    from safetensors import safe_open

    with safe_open(tmp_path / "lm.safetensors", framework="pt") as f:  # readable by safetensors itself
        assert sorted(f.keys()) == ["embed.weight", "norm.bias", "norm.weight"]
    loaded = ckptkit.read_checkpoint(tmp_path / "lm.safetensors")
    assert list(loaded) == list(lm.state_dict())
    assert loaded["head.weight"] is loaded["embed.weight"]


def test_safetensors_partial_views_are_stored_by_value(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32)
    sd = {"a": base[:6].view(2, 3), "b": base[4:], "t": base.view(3, 4).t()}  # overlapping, non-contiguous
    ckptkit.save_on_master(sd, tmp_path / "v.safetensors")
    loaded = ckptkit.read_checkpoint(tmp_path / "v.safetensors")
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.int8, torch.bool, torch.float64, torch.float8_e4m3fn, torch.uint32]
)
def test_safetensors_dtypes(tmp_path: Path, dtype: torch.dtype) -> None:
    t = (torch.arange(6) % 3).to(dtype).reshape(2, 3)
    ckptkit.save_on_master({"t": t, "empty": torch.zeros(0, 4, dtype=dtype)}, tmp_path / "d.safetensors")
    loaded = ckptkit.read_checkpoint(tmp_path / "d.safetensors")
    assert loaded["t"].dtype == dtype and torch.equal(loaded["t"].view(torch.uint8), t.view(torch.uint8))
    assert loaded["empty"].shape == (0, 4)


def test_async_staging_records_the_device_the_tensors_came_from(tmp_path: Path) -> None:
    """A staged host copy of a GPU tensor is saved with the GPU's tag, as a sync save would be
    (tests/gpu/test_cuda.py checks the whole path on a GPU; this checks the tagging on any machine)."""
    from ckptkit.formats.pickles import reader as torchpickle
    from ckptkit.formats.torchzip.container import TorchZip
    from ckptkit.ops.async_save import _STAGED_TAGS, _tag_as

    def tags(path: Path) -> set[str]:
        found: set[str] = set()
        with TorchZip(path) as z:
            torchpickle.loads(z.read(f"{z.prefix}data.pkl"), on_storage=lambda ref: found.add(ref.location))
        return found

    staged, other = torch.ones(4), torch.zeros(2)
    key = _tag_as(staged.untyped_storage(), "cuda:3")
    try:
        torch.save({"staged": staged, "other": other}, tmp_path / "during.pt")
    finally:
        _STAGED_TAGS.pop(key)
    torch.save({"staged": staged}, tmp_path / "after.pt")
    assert tags(tmp_path / "during.pt") == {"cuda:3", "cpu"}
    assert tags(tmp_path / "after.pt") == {"cpu"}


def test_a_staged_zero_size_copy_tags_no_other_zero_size_storage(tmp_path: Path) -> None:
    """Every zero-size storage has data_ptr 0: tags keyed by it tagged them all (issue 24, defect 4;
    tests/gpu/test_cuda.py has the whole path, an async save of a zero-size CUDA tensor)."""
    from ckptkit.formats.pickles import reader as torchpickle
    from ckptkit.formats.torchzip.container import TorchZip
    from ckptkit.ops.async_save import _STAGED_TAGS, _tag_as

    staged, other = torch.empty(0), torch.empty(0)
    key = _tag_as(staged.untyped_storage(), "cuda:0")
    try:
        torch.save({"other": other}, tmp_path / "other.pt")
    finally:
        _STAGED_TAGS.pop(key)
    found: set[str] = set()
    with TorchZip(tmp_path / "other.pt") as z:
        torchpickle.loads(z.read(f"{z.prefix}data.pkl"), on_storage=lambda ref: found.add(ref.location))
    assert found == {"cpu"}


def test_staged_tags_pickle_as_torchs_own_cuda_tags_do(tmp_path: Path) -> None:
    """Seen on an H200: the async save of a tied CUDA model differed from the sync one in data.pkl
    alone, where the shared storage's second reference reused the memoized tag string; torch's
    own CUDA tagger builds a new string at each call, emulated here."""
    from unittest import mock

    from ckptkit.ops.async_save import _STAGED_TAGS, _tag_as

    base = torch.arange(8.0)
    tied = {"embed": base, "head": base, "part": base[2:5]}  # three references to one storage
    with mock.patch("torch.serialization.location_tag", lambda storage: "cuda:" + str(0)):
        torch.save(tied, tmp_path / "sync.pt")
    key = _tag_as(base.untyped_storage(), "cuda:0")
    try:
        torch.save(tied, tmp_path / "staged.pt")
    finally:
        _STAGED_TAGS.pop(key)
    with zipfile.ZipFile(tmp_path / "sync.pt") as a, zipfile.ZipFile(tmp_path / "staged.pt") as b:
        assert a.read("sync/data.pkl") == b.read("staged/data.pkl")


Point = collections.namedtuple("Point", "x y")


def _async_cases() -> dict[str, object]:
    z = torch.tensor([1 + 2j, 3 - 4j])
    base = torch.arange(10.0)
    return {
        "views of one storage": {"whole": base, "part": base[2:5], "strided": base[::3]},
        "conjugate and negative views": {
            "conj": z.conj(),
            "conj part": z.conj()[1:],
            "neg": torch._neg_view(torch.ones(3)),
        },
        "requires_grad and a Parameter": {
            "leaf": torch.ones(2, requires_grad=True),
            "param": torch.nn.Parameter(torch.ones(3)),
        },
        "containers keep their type": {
            "nt": Point(torch.ones(1), 2),
            "dd": collections.defaultdict(list, {"k": torch.zeros(2)}),
            "list": [torch.ones(1), (torch.zeros(1), 3)],
        },
        "sparse": {"s": torch.eye(3).to_sparse()},
    }


@pytest.mark.parametrize("case", list(_async_cases()))
def test_async_save_writes_the_bytes_a_sync_save_writes(tmp_path: Path, case: str) -> None:
    obj = _async_cases()[case]
    with ckptkit.AsyncSaver() as saver:
        saver.save(obj, tmp_path / "async.pt")
    ckptkit.save_on_master(obj, tmp_path / "sync.pt")
    assert (tmp_path / "async.pt").read_bytes() == (tmp_path / "sync.pt").read_bytes()
