"""``convert`` proves what it copies: every payload byte against the source's recorded CRC-32.

Sources are torch zips (``torch.save``) and safetensors files ckptkit wrote (per-tensor CRC-32s
in ``ckptkit.crc32``); a flipped bit in either must stop ``convert`` with the tensor named and no
output, on the fast path (bytes copied kernel-side) and on the torch path alike, with and
without the fast CRC library.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from ckptkit.formats.pickles import reader as lp
from ckptkit.formats.safetensors.codec import read_header
from ckptkit.formats.torchzip.container import TorchZip
from ckptkit.io import crcmath, fileio
from ckptkit.io.atomic import TMP_SUFFIX

BIG = "fc1.weight"  # 6 MiB: CRC'd through a mapping of the source
SMALL = "fc2.bias"  # 40 bytes: CRC'd from a read


def ddp_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {
        "fc1.weight": torch.randn(1536, 1024, generator=g),
        "fc1.bias": torch.randn(1536, generator=g),
        "fc2.weight": torch.randn(10, 1536, generator=g),
        "fc2.bias": torch.randn(10, generator=g),
    }
    return {f"module.{k}": v for k, v in sd.items()}


def make_source(folder: Path, suffix: str) -> Path:
    path = folder / f"src{suffix}"
    if suffix == ".pt":
        torch.save(ddp_state(), path)
    else:
        ckptkit.write_checkpoint(ddp_state(), path)  # ckptkit's writer records per-tensor CRC-32s
    return path


def payload_range(path: Path, key: str) -> tuple[int, int]:
    """``(offset, length)`` of tensor ``key``'s bytes in the file."""
    if path.suffix == ".safetensors":
        with open(path, "rb") as f:
            header, start = read_header(f, source=str(path))
        begin, end = header[key]["data_offsets"]
        return start + begin, end - begin
    with TorchZip(path) as z:
        t = lp.tensor_of(lp.loads(z.read(f"{z.prefix}data.pkl"))[key])
        assert t is not None
        rec = z.storage(t.storage.key)
        return rec.data_offset, rec.size


def flip(path: Path, key: str, where: float = 0.5) -> None:
    offset, length = payload_range(path, key)
    data = bytearray(path.read_bytes())
    data[offset + int(length * where)] ^= 0x10
    path.write_bytes(bytes(data))


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(TMP_SUFFIX) or p.name.startswith("out"))


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("key", [BIG, SMALL])
@pytest.mark.parametrize("out", [".pt", ".safetensors"])
@pytest.mark.parametrize("src_suffix", [".pt", ".safetensors"])
def test_cli_convert_refuses_a_flipped_payload_bit(tmp_path: Path, src_suffix: str, out: str, key: str) -> None:
    src = make_source(tmp_path, src_suffix)
    flip(src, f"module.{key}")
    code, stdout, stderr = run("convert", src, tmp_path / f"out{out}")
    assert code == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "damaged" in lines[0] and f"module.{key}" in lines[0] and str(src) in lines[0], stderr
    assert "Traceback" not in stderr and stdout == ""
    assert leftovers(tmp_path) == []  # no DST, no temp file


@pytest.mark.parametrize("trust", [False, True], ids=["fast", "torch"])
@pytest.mark.parametrize("out", [".pt", ".safetensors"])
@pytest.mark.parametrize("src_suffix", [".pt", ".safetensors"])
def test_convert_checkpoint_refuses_a_flipped_payload_bit(
    tmp_path: Path, src_suffix: str, out: str, trust: bool
) -> None:
    src = make_source(tmp_path, src_suffix)
    flip(src, f"module.{BIG}", where=0.9)
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match=rf"damaged: tensor module\.{BIG}\b") as e:
        ckptkit.convert_checkpoint(src, tmp_path / f"out{out}", trust=trust)
    assert "fc1.bias" not in str(e.value) and "fc2" not in str(e.value)  # only the damaged tensor is named
    assert leftovers(tmp_path) == []


def test_every_damaged_tensor_is_named_at_once(tmp_path: Path) -> None:
    src = make_source(tmp_path, ".pt")
    flip(src, f"module.{BIG}")
    flip(src, f"module.{SMALL}")
    with pytest.raises(ckptkit.errors.CheckpointFormatError) as e:
        ckptkit.convert_checkpoint(src, tmp_path / "out.pt")
    assert f"module.{BIG}" in str(e.value) and f"module.{SMALL}" in str(e.value)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("out", [".pt", ".safetensors"])
def test_a_flip_in_a_storage_shared_by_views_names_every_view(tmp_path: Path, out: str) -> None:
    base = torch.randn(2 << 20)  # 8 MiB, two views over it: the zip's CRC covers the whole storage
    src = tmp_path / "src.pt"
    torch.save({"a": base[: 1 << 20], "b": base[1 << 20 :]}, src)
    clean = ckptkit.convert_checkpoint(src, tmp_path / f"clean{out}", to="keep")
    assert clean.fast
    got = ckptkit.read_checkpoint(tmp_path / f"clean{out}")
    assert torch.equal(got["a"], base[: 1 << 20]) and torch.equal(got["b"], base[1 << 20 :])
    with TorchZip(src) as z:
        rec = z.storage("0")
    data = bytearray(src.read_bytes())
    data[rec.data_offset + 5] ^= 0x01  # inside a's bytes
    src.write_bytes(bytes(data))
    with pytest.raises(
        ckptkit.errors.CheckpointFormatError, match=r"damaged: tensors a, b in record src/data/0 \(CRC-32 recorded"
    ):
        ckptkit.convert_checkpoint(src, tmp_path / f"out{out}", to="keep")
    assert leftovers(tmp_path) == []


def test_a_flip_in_a_deflated_record_is_caught(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(4096.0), "b": torch.ones(3)}, tmp_path / "stored.pt")
    src = tmp_path / "deflated.pt"
    with zipfile.ZipFile(tmp_path / "stored.pt") as zin, zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    ok = ckptkit.convert_checkpoint(src, tmp_path / "clean.pt", to="keep")
    assert ok.fast and torch.equal(ckptkit.read_checkpoint(tmp_path / "clean.pt")["w"], torch.arange(4096.0))
    info = next(i for i in zipfile.ZipFile(src).infolist() if i.filename.endswith("data/0"))
    data = bytearray(src.read_bytes())
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + 20] ^= 0x40  # inside the deflated stream
    src.write_bytes(bytes(data))
    with pytest.raises(
        ckptkit.errors.CheckpointFormatError,
        match=r"damaged: tensor w in record stored/data/0 \(compressed bytes that do not inflate",
    ):
        ckptkit.convert_checkpoint(src, tmp_path / "out.pt", to="keep")
    assert leftovers(tmp_path) == []


def _unsupported(*args: object) -> int:
    raise OSError(95, "Operation not supported")


@pytest.mark.parametrize("copy", ["copy_file_range", "short copies", "read-write"])
@pytest.mark.parametrize("out", [".pt", ".safetensors"])
@pytest.mark.parametrize("src_suffix", [".pt", ".safetensors"])
def test_a_clean_convert_gives_the_source_tensors_and_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src_suffix: str, out: str, copy: str
) -> None:
    src = make_source(tmp_path, src_suffix)
    if copy == "short copies":  # the kernel may copy less than asked: the CRC must cover what it copied
        kernel_copy = os.copy_file_range
        monkeypatch.setattr(os, "copy_file_range", lambda i, o, n, *a: kernel_copy(i, o, min(n, 1_000_003), *a))
    elif copy == "read-write":  # a filesystem without copy_file_range: the copy goes through Python, CRC'd as read
        monkeypatch.setattr(os, "copy_file_range", _unsupported)
    seen: list[tuple[int, int]] = []
    report = ckptkit.convert_checkpoint(src, tmp_path / f"out{out}", progress=lambda n, total: seen.append((n, total)))
    assert report.fast and report.renamed == 4
    got = ckptkit.read_checkpoint(tmp_path / f"out{out}")
    expected = {k.removeprefix("module."): v for k, v in ddp_state().items()}
    assert list(got) == list(expected) and all(torch.equal(got[k], v) for k, v in expected.items())
    assert ckptkit.verify_checkpoint(tmp_path / f"out{out}").ok
    payload = sum(v.numel() * v.element_size() for v in expected.values())
    assert seen and {t for _, t in seen} == {src.stat().st_size}  # progress still reports the copy
    assert payload <= sum(n for n, _ in seen) <= src.stat().st_size


@pytest.mark.parametrize("size", [0, 1, 7, 4096, (1 << 20) + 3, (9 << 20) + 1])
def test_the_fast_crc_gives_zlibs_values(size: int) -> None:
    data = random.Random(size).randbytes(size)
    assert fileio.crc32(data) == zlib.crc32(data)
    assert fileio.crc32(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)  # continuing a running CRC
    half = size // 2
    assert fileio.crc32(data[half:], fileio.crc32(data[:half])) == zlib.crc32(data)


@pytest.mark.parametrize("combine", ["chosen", "python"])
def test_crc32_combine_gives_the_crc_of_the_joined_bytes(combine: str) -> None:
    """The whole-record CRC of a tensor copied piece by piece (DCP chunks), by ISA-L where
    installed and by the Python fallback, each length's shift computed once and reused."""
    fn = crcmath.crc32_combine if combine == "chosen" else crcmath.python_crc32_combine
    rng = random.Random(7)
    for n, m in [(0, 0), (5, 0), (0, 5), (1, 1), (4096, 3), (70_000, 70_000), (3, (1 << 20) + 5)]:
        for _ in range(2):  # the second time through, the Python fallback's shift comes from its cache
            a, b = rng.randbytes(n), rng.randbytes(m)
            assert fn(zlib.crc32(a), zlib.crc32(b), m) == zlib.crc32(a + b), (n, m)


def test_a_read_error_while_checking_a_copy_fails_it_and_copies_nothing_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CRC thread reads the source itself; its OSError (EIO) once passed for "copy_file_range
    unsupported", and the step just copied was copied again through Python: a longer output
    whose CRC-32 still matched the source."""
    data = random.Random(5).randbytes((33 << 20) + 7)  # a mapped 32 MiB step, then a short one read back
    (tmp_path / "src").write_bytes(data)
    real_pread, calls = os.pread, []

    def failing_pread(fd: int, n: int, at: int) -> bytes:
        calls.append(n)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        return real_pread(fd, n, at)

    monkeypatch.setattr(os, "pread", failing_pread)
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", "wb") as dst:
        with pytest.raises(OSError, match="Input/output error"):
            fileio.copy_range(src, dst, 0, len(data), crc=True)
    assert calls and (tmp_path / "dst").stat().st_size <= len(data)


@pytest.mark.skipif(not hasattr(os, "copy_file_range"), reason="the CRC job runs beside a kernel copy only")
def test_a_failed_crc_job_is_waited_for_before_raising(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRC job reads the source the caller closes once the copy raises: it must have ended."""
    (tmp_path / "src").write_bytes(bytes(4 << 20))
    ended: list[str] = []
    real_in_background = fileio.in_background

    def crc_fails(*_: object) -> int:
        raise OSError(5, "Input/output error")

    def in_background(fn: Any, *args: Any) -> Any:
        wait = real_in_background(fn, *args)

        def waited() -> Any:
            try:
                return wait()
            finally:
                ended.append("crc")

        return waited

    monkeypatch.setattr(fileio, "in_background", in_background)
    monkeypatch.setattr(fileio, "_crc_of_mapped", crc_fails)
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", "wb") as dst:
        with pytest.raises(OSError, match="Input/output error"):
            fileio.copy_range(src, dst, 0, 4 << 20, crc=True)
    assert ended == ["crc"]


def test_the_fast_crc_library_is_used_where_installed() -> None:
    isal = pytest.importorskip("isal.isal_zlib")
    assert fileio._crc32 is isal.crc32


@pytest.mark.parametrize("out", [".pt", ".safetensors"])
@pytest.mark.parametrize("src_suffix", [".pt", ".safetensors"])
def test_zlibs_crc_converts_and_catches_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src_suffix: str, out: str
) -> None:
    src = make_source(tmp_path, src_suffix)
    ckptkit.convert_checkpoint(src, tmp_path / f"fast{out}")
    monkeypatch.setattr(fileio, "_crc32", zlib.crc32)  # what a platform without an isal wheel runs
    ckptkit.convert_checkpoint(src, tmp_path / f"zlib{out}")
    assert (tmp_path / f"zlib{out}").read_bytes() == (tmp_path / f"fast{out}").read_bytes()
    assert ckptkit.verify_checkpoint(tmp_path / f"zlib{out}").ok
    flip(src, f"module.{BIG}")
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match=rf"damaged: tensor module\.{BIG}\b"):
        ckptkit.convert_checkpoint(src, tmp_path / f"out{out}")
    assert leftovers(tmp_path) == []


def test_without_the_library_installed_zlib_is_used(tmp_path: Path) -> None:
    src = make_source(tmp_path, ".pt")
    flip(src, f"module.{SMALL}")
    code = (
        "import sys, zlib; sys.modules['isal'] = None  # as if no wheel was installed\n"
        "from ckptkit.io import fileio; assert fileio._crc32 is zlib.crc32, fileio._crc32\n"
        "from ckptkit.cli import main; main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "convert", str(src), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert f"module.{SMALL}" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert leftovers(tmp_path) == []
