"""Opening a checkpoint's files: only a regular file (or a symlink to one) is opened; anything else
is refused, saying what is there, without blocking on it."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import CheckpointFormatError, CheckpointNotFoundError
from ckptkit.io.fileio import open_regular, require_regular
from tests import not_regular


def test_a_regular_file_and_a_symlink_to_one_elsewhere_open_blocking(tmp_path: Path) -> None:
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "a1b2").write_bytes(b"weights")
    (tmp_path / "snapshot").mkdir()
    link = tmp_path / "snapshot" / "model.safetensors"
    link.symlink_to(tmp_path / "blobs" / "a1b2")  # as the Hugging Face cache lays a snapshot out
    for path in (tmp_path / "blobs" / "a1b2", link):
        require_regular(path, folder=path.parent)
        with open_regular(path, folder=path.parent) as f:
            assert f.read() == b"weights" and f.name == os.fspath(path) and os.get_blocking(f.fileno())


@pytest.mark.parametrize("how", list(not_regular.FOUND))
@pytest.mark.parametrize("check", [open_regular, require_regular], ids=["open", "require"])
def test_anything_else_is_refused_saying_what_it_is(tmp_path: Path, how: str, check: Callable[..., object]) -> None:
    victim = tmp_path / "ckpt" / "__0_0.distcp"
    victim.parent.mkdir()
    victim.write_bytes(b"")
    not_regular.replace(victim, how)
    with not_regular.deadline():
        with pytest.raises(CheckpointFormatError) as e:
            check(victim, folder=victim.parent)
        message = str(e.value)
        assert message.startswith(f"{victim}: {not_regular.FOUND[how]}") and "\n" not in message
        assert message.endswith(f"restore the file the writer saved there from a complete copy of {victim.parent}")
        with pytest.raises(CheckpointFormatError, match="give a checkpoint file"):
            check(victim)


def test_nothing_there_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such file") as e:
        open_regular(tmp_path / "gone.pt", folder=tmp_path)
    assert isinstance(e.value, FileNotFoundError) and e.value.filename == str(tmp_path / "gone.pt")


# Found in review: local_file of a folder walked the table of paths read elsewhere while another
# thread's read added and removed its own ("dictionary changed size during iteration").
def test_local_file_of_a_folder_is_safe_beside_another_threads_reads(tmp_path: Path) -> None:
    import sys
    import threading

    from ckptkit.io import fileio

    stop, errors = threading.Event(), []
    opener, fill = (lambda: None), (lambda: None)

    def registering() -> None:  # as ranged_read of a prefix does, object by object
        i = 0
        while not stop.is_set():
            with fileio.read_elsewhere(tmp_path / "other" / f"o{i % 5000}", opener, fill):  # type: ignore[arg-type]
                pass
            i += 1

    held = [fileio.read_elsewhere(tmp_path / "held" / f"h{i}", opener, fill) for i in range(2000)]  # type: ignore[arg-type]
    for h in held:
        h.__enter__()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=registering)
    t.start()
    try:
        for _ in range(2000):
            try:
                fileio.local_file(tmp_path / "mine")
            except RuntimeError as e:
                errors.append(str(e))
                break
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
        for h in held:
            h.__exit__(None, None, None)
    assert not errors, errors


# Found in review: local_file took a path's route before filling it, so a fill that failed (a
# worker, which never fills its parent's path) left later opens reading the local placeholder.
def test_a_fill_that_fails_leaves_the_path_read_elsewhere(tmp_path: Path) -> None:
    import io

    from ckptkit.errors import StorageError
    from ckptkit.io import fileio

    path = tmp_path / "shard.safetensors"
    path.write_bytes(bytes(8))  # the placeholder: zeros

    def refused() -> None:
        raise StorageError(f"{path}: not filled here")

    with fileio.read_elsewhere(path, lambda: io.BytesIO(b"the object"), refused):  # type: ignore[arg-type,return-value]
        with pytest.raises(StorageError):
            fileio.local_file(path)
        with open_regular(path) as f:
            assert f.read() == b"the object"


@given(
    data=st.binary(max_size=300),
    cuts=st.lists(st.integers(0, 64), max_size=12),
    offset=st.integers(0, 320),
    iov=st.sampled_from([1, 3, 1024]),
    local=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_pread_into_fills_buffers_in_turn_as_a_slice_of_the_file(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, cuts: list[int], offset: int, iov: int, local: bool
) -> None:
    """Any split of the buffers, preadv's batch cut anywhere, the file's end anywhere among them:
    the buffers hold the file's bytes from ``offset`` in turn, as many as it has."""
    from ckptkit.io import fileio

    path = tmp_path_factory.mktemp("pread") / "f"
    path.write_bytes(data)
    out = bytearray(sum(cuts))
    whole = memoryview(out)
    views, at = [], 0
    for n in cuts:
        views.append(whole[at : at + n])
        at += n
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fileio, "_IOV_MAX", iov)
        with open(path, "rb") if local else io.BytesIO(data) as f:  # a BytesIO: no descriptor, as a store's object
            got = fileio.pread_into(f, views, offset)  # type: ignore[arg-type]
    want = data[offset : offset + len(out)]
    assert got == len(want) and bytes(out[:got]) == want and not any(out[got:])


def test_write_checked_starts_the_writeback_of_exactly_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.io import fileio

    started: list[tuple[int, int]] = []
    monkeypatch.setattr(fileio, "start_writeback", lambda fd, at, n: started.append((at, n)))
    monkeypatch.setattr(fileio, "_CHECKED_STEP", 300 << 10)
    big = os.urandom(700 << 10)
    with open(tmp_path / "f", "wb") as f:
        f.write(b"head")  # still in the writer's buffer: counted by tell()
        fileio.write_checked(f, b"small", writeback=True)  # left to the closing fsync
        fileio.write_checked(f, big)  # not asked for
        fileio.write_checked(f, big, writeback=True)
    at = 9 + len(big)
    assert started == [(at, 300 << 10), (at + (300 << 10), 300 << 10), (at + (600 << 10), 100 << 10)]
    assert (tmp_path / "f").read_bytes() == b"headsmall" + big + big


class _Counted(io.BytesIO):
    """An object without a descriptor, as a store's is, counting its reads."""

    reads = 0

    def read(self, n: int | None = -1) -> bytes:
        self.reads += 1
        return super().read(n)


def test_pread_into_reads_an_object_without_a_descriptor_in_one_run() -> None:
    # Found in review: a band's rows were read from an S3 object one ranged read each.
    from ckptkit.io import fileio

    f = _Counted(bytes(range(200)))
    out = bytearray(120)
    views = [memoryview(out)[i : i + 10] for i in range(0, 120, 10)]
    assert fileio.pread_into(f, views, 5) == 120  # type: ignore[arg-type]
    assert out == bytes(range(5, 125)) and f.reads == 1
