"""Kernel copies: ``copy_range`` copies byte-exact at any offsets within a page, CRC-checked,
and where the kernel refuses (an O_APPEND file, a filesystem without copy_file_range) it goes
on through Python from where it stopped, copying no byte twice."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest

from ckptkit.errors import CheckpointFormatError
from ckptkit.io import fileio

MiB = 1 << 20


def _copy(
    tmp_path: Path, data: bytes, src_at: int, length: int, *, pad: int = 1, mode: str = "wb", crc: bool = True
) -> int:
    (tmp_path / "src").write_bytes(data)
    seen: list[int] = []
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", mode) as dst:
        dst.write(b"h" * pad)
        value = fileio.copy_range(src, dst, src_at, length, seen.append, crc=crc)
        dst.write(b"tail")  # the file position is where the copy ended
    assert (tmp_path / "dst").read_bytes() == b"h" * pad + data[src_at : src_at + length] + b"tail"
    assert sum(seen) == length
    return value


@pytest.mark.parametrize(
    ("src_at", "pad", "length"),
    [
        (4096 + 64, 64, 3 * MiB),  # the same offset within a page
        (4096 + 64, 0, 3 * MiB),  # another offset within a page
        (4096 + 64, 128, MiB - 1),
        (17, 9000, (33 * MiB) + 5),  # odd offsets (a DCP chunk), past one 32 MiB checked step
    ],
)
@pytest.mark.parametrize("crc", [True, False])
def test_a_copy_is_byte_exact_at_any_page_offset(tmp_path: Path, src_at: int, pad: int, length: int, crc: bool) -> None:
    data = random.Random(length).randbytes(src_at + length + 4096)
    want = data[src_at : src_at + length]
    assert _copy(tmp_path, data, src_at, length, pad=pad, crc=crc) == (zlib.crc32(want) if crc else 0)


def test_a_source_that_ends_early_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(bytes(3 * MiB))
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", "wb") as dst:
        dst.write(b"x")
        with pytest.raises(CheckpointFormatError, match=r"src: ended early at byte 3145728"):
            fileio.copy_range(src, dst, 4096, 4 * MiB, crc=True)
    assert (tmp_path / "dst").stat().st_size == 1 + 3 * MiB - 4096


def test_an_append_only_destination_still_copies(tmp_path: Path) -> None:
    """copy_file_range does not write to an O_APPEND file: the copy goes through Python."""
    (tmp_path / "dst").write_bytes(b"")
    data = random.Random(4).randbytes(4 * MiB)
    assert _copy(tmp_path, data, 100, 3 * MiB, mode="ab") == zlib.crc32(data[100 : 100 + 3 * MiB])


@pytest.mark.parametrize("after", [0, 1])
def test_a_refused_kernel_copy_falls_back_and_copies_each_byte_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: int
) -> None:
    """copy_file_range refused from its ``after``-th call on (cross-device on older kernels):
    what it copied counts, the rest goes through Python, once."""
    real, calls = os.copy_file_range, [0]

    def refusing(*args: object, **kwargs: object) -> int:
        calls[0] += 1
        if calls[0] > after:
            raise OSError(18, "Invalid cross-device link")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "copy_file_range", refusing)
    data = random.Random(3).randbytes(40 * MiB)
    assert _copy(tmp_path, data, 100, 36 * MiB) == zlib.crc32(data[100 : 100 + 36 * MiB])
    assert calls[0] > after
