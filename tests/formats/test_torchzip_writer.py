"""ckptkit writes torch's zip format itself (torch's pickling, its own zip writer): every file
loads with torch.load exactly, memory-mapped or not, with every CRC right (issue 15)."""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.formats.torchzip import writer as zipwrite
from ckptkit.io import fileio

DTYPES = [
    d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    )
    if d is not None
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for an exact comparison of any dtype (float8 has no torch.equal)."""
    return t.contiguous().view(torch.uint8) if t.element_size() and t.numel() else t.reshape(-1).to(torch.uint8)


def _sample(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3, 40 * torch.tensor([], dtype=dtype).element_size()), generator=g, dtype=torch.uint8)
    return raw.view(dtype) if dtype != torch.bool else raw.bool()


def _loads_exactly(path: Path, expected: dict[str, torch.Tensor]) -> None:
    assert zipfile.ZipFile(path).testzip() is None  # every record's CRC-32 right
    assert ckptkit.verify_checkpoint(path).ok
    for mmap in (False, True):
        got = torch.load(path, weights_only=True, mmap=mmap)
        assert set(expected) <= set(got)
        for k, v in expected.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].stride() == v.stride(), k
            assert torch.equal(_bits(got[k]), _bits(v)), k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_loads_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    t = _sample(dtype)
    ckptkit.save_on_master({"t": t, "col": t[:, 1::3], "empty": t[:0]}, tmp_path / "x.pt")
    _loads_exactly(tmp_path / "x.pt", {"t": t, "col": t[:, 1::3], "empty": t[:0]})


def test_tied_weights_views_and_a_training_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    embed = torch.randn(1000, 64)  # 250 kB, and a 20 MB one: several write steps
    big = torch.randn(5 << 20)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    obj = {"embed": embed, "head": embed, "rows": embed[10:20], "big": big, "opt": opt.state_dict(), "epoch": 3}
    ckptkit.save_on_master(obj, tmp_path / "x.pt")
    _loads_exactly(tmp_path / "x.pt", {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)})
    got = torch.load(tmp_path / "x.pt", weights_only=True)
    ptr = got["embed"].untyped_storage().data_ptr()
    assert (
        got["head"].untyped_storage().data_ptr() == ptr == got["rows"].untyped_storage().data_ptr()
    )  # still one storage
    assert got["epoch"] == 3 and torch.equal(got["opt"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert (
        len([n for n in zipfile.ZipFile(tmp_path / "x.pt").namelist() if "/data/" in n]) == 2 + 6
    )  # embed, big; Adam: 2 x (step, exp_avg, exp_avg_sq)


def test_zip64_records_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zipwrite, "ZIP64_AT", 1000)  # sizes from 1000 bytes on take zip64: exercised without 4 GB
    t = torch.arange(5000, dtype=torch.float32)
    ckptkit.save_on_master({"t": t, "small": torch.ones(3)}, tmp_path / "x.pt")
    _loads_exactly(tmp_path / "x.pt", {"t": t, "small": torch.ones(3)})


def test_without_the_fast_crc_the_file_is_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    obj = {"w": torch.randn(3000), "b": torch.arange(7)}
    ckptkit.save_on_master(obj, tmp_path / "fast.pt")
    monkeypatch.setattr(fileio, "_crc32", zlib.crc32)
    ckptkit.save_on_master(obj, tmp_path / "zlib.pt")
    assert (tmp_path / "fast.pt").read_bytes() == (tmp_path / "zlib.pt").read_bytes()


def test_torch_save_is_the_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptkit.formats.torchzip.torch as ts

    def unknown_torch(*args: object, **kwargs: object) -> None:
        raise ts.FallBack("pretend this torch has another _save")

    obj = {"w": torch.randn(3000), "tied": None}
    obj["tied"] = obj["w"]
    monkeypatch.setattr(ts, "save_zip", unknown_torch)
    ckptkit.save_on_master(obj, tmp_path / "x.pt")
    _loads_exactly(tmp_path / "x.pt", {"w": obj["w"], "tied": obj["w"]})


@pytest.mark.parametrize("written", [9, 11])
def test_a_record_written_short_or_long_of_its_header_is_refused(tmp_path: Path, written: int) -> None:
    """add_written writes the header (its sizes from a DCP folder's .metadata) before the bytes
    come: a writer that delivers another count must fail, not leave a zip whose records lie."""
    with open(tmp_path / "out.zip", "wb") as f:
        w = zipwrite.ZipWriter(f)
        with pytest.raises(
            ckptkit.errors.CheckpointFormatError, match=rf"record a/data/0: {written} bytes written, its header says 10"
        ):
            w.add_written("a/data/0", 10, lambda: fileio.write_checked(f, b"x" * written))


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(300, 700, generator=g),
        "b": torch.randn(300, generator=g).to(torch.bfloat16),
        "tied": [torch.arange(10)] * 2,
        "step": 7,
    }


@pytest.mark.parametrize("in_flight", [1, 1 << 30])  # every record waits for the one before it; none waits
def test_records_written_behind_the_copies_are_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_flight: int
) -> None:
    """A state on a GPU is saved with each storage's copy to the host overlapping the writing of the
    ones before it; the file is byte for byte the one written in turn (here forced on the CPU)."""
    import ckptkit.formats.torchzip.torch as tz

    sd = _state()
    ckptkit.save_on_master(sd, tmp_path / "in_turn.pt")
    monkeypatch.setattr(tz, "_on_a_device", lambda obj: True)
    monkeypatch.setattr(tz, "IN_FLIGHT", in_flight)
    ckptkit.save_on_master(sd, tmp_path / "behind.pt")
    assert (tmp_path / "behind.pt").read_bytes() == (tmp_path / "in_turn.pt").read_bytes()


def test_a_write_failing_behind_the_copies_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer thread's error (a full disk) reaches the caller, and nothing is published."""
    import ckptkit.formats.torchzip.torch as tz

    monkeypatch.setattr(tz, "_on_a_device", lambda obj: True)
    real = zipwrite.ZipWriter.add_buffer

    def full(self: zipwrite.ZipWriter, name: str, buf: object, progress: object = None) -> int:
        if name.endswith("data/1"):
            raise OSError(28, "No space left on device")
        return real(self, name, buf, progress)  # type: ignore[arg-type]

    monkeypatch.setattr(zipwrite.ZipWriter, "add_buffer", full)
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match="no space left on the device"):
        ckptkit.save_on_master(_state(), tmp_path / "m.pt")
    assert list(tmp_path.iterdir()) == []


def test_only_a_state_on_a_device_is_written_behind() -> None:
    import ckptkit.formats.torchzip.torch as tz

    assert not tz._on_a_device({"w": torch.ones(2), "opt": {"state": {0: {"m": torch.zeros(2)}}}, "n": 3})
    assert tz._on_a_device({"w": torch.ones(2), "opt": [{"m": torch.zeros(2, device="meta")}]})
