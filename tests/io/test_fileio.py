"""Opening a checkpoint's files: only a regular file (or a symlink to one) is opened; anything else
is refused, saying what is there, without blocking on it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

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
