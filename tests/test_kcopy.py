"""Kernel copies: on ext4, a range that lands at another offset within a page than in its source
goes through a pipe (``splice``), byte-exact and CRC-checked like any other copy, and any
refusal on the way falls back without copying a byte twice."""

from __future__ import annotations

import os
import random
import subprocess
import zlib
from pathlib import Path

import pytest

from ckptkit.errors import CheckpointFormatError
from ckptkit.io import fileio, kcopy

MiB = 1 << 20
needs_splice = pytest.mark.skipif(not hasattr(os, "splice"), reason="os.splice is Linux's")


@pytest.fixture
def spliced(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes each ``os.splice`` call moved, on any filesystem that splices (tmpfs, overlay: the
    choice of ext4 alone is tested on its own below)."""
    real, calls = os.splice, []

    def counting(*args: object, **kwargs: object) -> int:
        n = real(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(n)
        return n

    monkeypatch.setattr(kcopy, "_on_ext4", lambda *fds: True)
    monkeypatch.setattr(os, "splice", counting)
    return calls


def _copy(tmp_path: Path, data: bytes, src_at: int, length: int, *, pad: int = 1, mode: str = "wb") -> int:
    (tmp_path / "src").write_bytes(data)
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", mode) as dst:
        dst.write(b"h" * pad)
        value = fileio.copy_range(src, dst, src_at, length, crc=True)
        dst.write(b"tail")  # the file position is where the copy ended
    assert (tmp_path / "dst").read_bytes() == b"h" * pad + data[src_at : src_at + length] + b"tail"
    return value


@needs_splice
@pytest.mark.parametrize(
    ("src_at", "pad", "length", "piped"),
    [
        (4096 + 64, 64, 3 * MiB, False),  # the same offset within a page: copy_file_range
        (4096 + 64, 0, 3 * MiB, True),
        (4096 + 64, 128, MiB - 1, False),  # short: a pipe's set-up costs more than it saves
        (4096 + 64, 128, MiB, True),
        (17, 9000, (33 * MiB) + 5, True),  # odd offsets (a DCP chunk), past one 32 MiB checked step
    ],
)
@pytest.mark.parametrize("crc", [True, False])
def test_a_copy_to_another_page_offset_goes_through_a_pipe_byte_exact(
    tmp_path: Path, spliced: list[int], src_at: int, pad: int, length: int, piped: bool, crc: bool
) -> None:
    data = random.Random(length).randbytes(src_at + length + 4096)
    (tmp_path / "src").write_bytes(data)
    seen: list[int] = []
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", "wb") as dst:
        dst.write(b"h" * pad)
        value = fileio.copy_range(src, dst, src_at, length, seen.append, crc=crc)
        dst.write(b"tail")
    want = data[src_at : src_at + length]
    assert (tmp_path / "dst").read_bytes() == b"h" * pad + want + b"tail"
    assert value == (zlib.crc32(want) if crc else 0)
    assert sum(seen) == length
    assert (sum(spliced) == 2 * length) if piped else not spliced  # each byte into the pipe and out of it


@needs_splice
def test_short_splices_each_way_are_carried_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may move less than asked, into the pipe or out of it: the copy goes on from there."""
    real, calls = os.splice, []

    def short(fd_in: int, fd_out: int, count: int, **kwargs: object) -> int:
        calls.append(count)
        cap = 4097 if "offset_src" in kwargs else 1000
        return real(fd_in, fd_out, min(count, cap), **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kcopy, "_on_ext4", lambda *fds: True)
    monkeypatch.setattr(os, "splice", short)
    data = random.Random(1).randbytes(3 * MiB)
    assert _copy(tmp_path, data, 100, 2 * MiB + 3) == zlib.crc32(data[100 : 100 + 2 * MiB + 3])
    assert len(calls) > 2 * MiB // 1000


@needs_splice
def test_a_source_that_ends_early_is_an_error_through_the_pipe_too(tmp_path: Path, spliced: list[int]) -> None:
    (tmp_path / "src").write_bytes(bytes(3 * MiB))
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", "wb") as dst:
        dst.write(b"x")
        with pytest.raises(CheckpointFormatError, match=r"src: ended early at byte 3145728"):
            fileio.copy_range(src, dst, 4096, 4 * MiB, crc=True)
    assert spliced and (tmp_path / "dst").stat().st_size == 1 + 3 * MiB - 4096


@needs_splice
@pytest.mark.parametrize("side", ["into the pipe", "out of the pipe"])
@pytest.mark.parametrize("after", [0, 1, 5])
def test_a_refused_splice_falls_back_and_copies_each_byte_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, side: str, after: int
) -> None:
    """splice refused from its ``after``-th call on, each way: what reached the file counts, the
    rest (pipe drained) goes by copy_file_range or through Python, once."""
    real, state = os.splice, {"calls": 0, "refused": 0}

    def refusing(fd_in: int, fd_out: int, count: int, **kwargs: object) -> int:
        if ("offset_src" in kwargs) == (side == "into the pipe"):
            state["calls"] += 1
            if state["calls"] > after:
                state["refused"] += 1
                raise OSError(22, "Invalid argument")
        cap = 300_000 if "offset_src" in kwargs else 100_000  # a write refused after a short one
        return real(fd_in, fd_out, min(count, cap), **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kcopy, "_on_ext4", lambda *fds: True)
    monkeypatch.setattr(os, "splice", refusing)
    data = random.Random(3).randbytes(40 * MiB)
    assert _copy(tmp_path, data, 100, 36 * MiB) == zlib.crc32(data[100 : 100 + 36 * MiB])
    assert state["refused"]


@needs_splice
def test_an_append_only_destination_still_copies(tmp_path: Path, spliced: list[int]) -> None:
    """Neither splice nor copy_file_range writes to an O_APPEND file: the copy goes through Python."""
    (tmp_path / "dst").write_bytes(b"")
    data = random.Random(4).randbytes(4 * MiB)
    assert _copy(tmp_path, data, 100, 3 * MiB, mode="ab") == zlib.crc32(data[100 : 100 + 3 * MiB])


@needs_splice
def test_the_pipe_is_chosen_on_ext4_alone_by_the_filesystems_magic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The filesystem type is fstatfs's, as ``stat -f`` reports it, and only ext4 (0xEF53) takes
    the pipe: checked on whatever filesystem holds the test's folder (ext4 on this project's CI)."""
    (tmp_path / "f").write_bytes(b"x")
    stat = subprocess.run(["stat", "-f", "-c", "%t", str(tmp_path / "f")], capture_output=True, text=True, check=True)
    magic = int(stat.stdout, 16)
    with open(tmp_path / "f", "rb") as f:
        assert kcopy.fs_type(f.fileno()) == magic
    real, calls = os.splice, []
    monkeypatch.setattr(os, "splice", lambda *a, **k: calls.append(1) or real(*a, **k))
    data = random.Random(5).randbytes(3 * MiB)
    _copy(tmp_path, data, 100, 2 * MiB)
    assert bool(calls) == (magic == 0xEF53)
