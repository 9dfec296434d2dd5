"""io.atomic and io.atomicdir: interrupted writes leave nothing, stale-temp cleanup
stays on its own host, and a check runs on the finished temp before it is published."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptkit.errors import CheckpointFormatError, CheckpointNotFoundError, CheckpointWriteError, CkptkitError
from ckptkit.io import atomic, remote
from ckptkit.io.atomic import TMP_SUFFIX, atomic_write, remove_stale_temps
from ckptkit.io.atomicdir import atomic_folder
from tests.conftest import ROOT


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(TMP_SUFFIX))


def interrupt_after(real: Callable[..., object], made: list[object]) -> Callable[..., object]:
    """``real``, which for a temp name returns and then raises KeyboardInterrupt, as the CLI's
    signal handler would on a SIGINT that arrives just after the syscall returns."""

    def wrapper(path: object, *args: object, **kwargs: object) -> object:
        result = real(path, *args, **kwargs)
        if os.fspath(path).endswith(TMP_SUFFIX):  # type: ignore[call-overload]
            made.append(result)
            raise KeyboardInterrupt
        return result

    return wrapper


# -- 1. a signal just after the temp is created -------------------------------------------------


@pytest.mark.parametrize("existing", [False, True])
def test_a_signal_just_after_the_temp_file_is_created_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    dest = tmp_path / "out.pt"
    if existing:
        dest.write_bytes(b"old bytes")
    fds: list[object] = []
    monkeypatch.setattr(os, "open", interrupt_after(os.open, fds))
    try:
        with pytest.raises(KeyboardInterrupt):
            with atomic_write(dest) as f:
                f.write(b"new bytes")
    finally:
        monkeypatch.undo()
        for fd in fds:  # the interrupt came before the fd was stored, so only the test can close it
            os.close(fd)  # type: ignore[arg-type]
    assert len(fds) == 1  # the wrapper did create the temp file
    assert temps(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out.pt"] if existing else [])
    assert not existing or dest.read_bytes() == b"old bytes"


@pytest.mark.parametrize("existing", [False, True])
def test_a_signal_just_after_the_temp_folder_is_made_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    dest = tmp_path / "out"
    if existing:
        dest.mkdir()
        (dest / "model.safetensors").write_bytes(b"old bytes")
    made: list[object] = []
    monkeypatch.setattr(os, "mkdir", interrupt_after(os.mkdir, made))
    try:
        with pytest.raises(KeyboardInterrupt):
            with atomic_folder(dest) as tmp:
                (tmp / "model.safetensors").write_bytes(b"new bytes")
    finally:
        monkeypatch.undo()
    assert len(made) == 1
    assert temps(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if existing else [])
    assert not existing or [p.read_bytes() for p in dest.iterdir()] == [b"old bytes"]


def test_a_signal_before_the_temp_file_exists_is_raised_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.open

    def interrupted(path: object, *args: object, **kwargs: object) -> object:
        if os.fspath(path).endswith(TMP_SUFFIX):  # type: ignore[call-overload]
            raise KeyboardInterrupt  # cleanup then finds no file: that must not become another error
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(tmp_path / "out.pt") as f:
            f.write(b"never")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("folder", [False, True])
def test_a_temp_name_already_taken_is_not_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: bool
) -> None:
    """O_EXCL / mkdir refusing the name means another writer holds it: cleanup must not touch it."""
    dest = tmp_path / "out"
    taken = tmp_path / f".out.someone-1-abcd1234{TMP_SUFFIX}"
    if folder:
        taken.mkdir()
        (taken / "shard").write_bytes(b"theirs")
    else:
        taken.write_bytes(b"theirs")
    monkeypatch.setattr(atomic, "temp_path", lambda _dest: taken)
    monkeypatch.setattr("ckptkit.io.atomicdir.temp_path", lambda _dest: taken)
    with pytest.raises(CheckpointWriteError, match="cannot write .*out"):
        with atomic_folder(dest) if folder else atomic_write(dest):
            pytest.fail("the body must not run when the temp cannot be created")
    assert (taken / "shard" if folder else taken).read_bytes() == b"theirs"
    assert not dest.exists()


# -- 2. stale-temp cleanup stays on its own host ------------------------------------------------


def as_host(host: str, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose platform.node() says ``host``."""
    prelude = f"import platform\nplatform.node = lambda: {host!r}\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, check=False
    )


def killed_mid_write(host: str, dest: Path) -> str:
    """Write ``dest`` as ``host`` and be killed -9 mid-write; return the temp file left behind."""
    before = set(temps(dest.parent))
    proc = as_host(
        host,
        f"""
        import os, signal
        from ckptkit.io.atomic import atomic_write
        with atomic_write({str(dest)!r}) as f:
            f.write(b"partial from {host}")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (left,) = set(temps(dest.parent)) - before
    return left


def test_cleanup_leaves_a_dead_pid_temp_of_another_host_with_the_same_name_start(tmp_path: Path) -> None:
    """llama-train-worker-0 and -1 share a folder; a pid from worker-1 means nothing on worker-0."""
    dest = tmp_path / "ckpt.pt"
    theirs = killed_mid_write("llama-train-worker-1", dest)
    ours = killed_mid_write("llama-train-worker-0", dest)
    assert theirs != ours
    proc = as_host(
        "llama-train-worker-0",
        f"""
        from ckptkit.io.atomic import atomic_write
        with atomic_write({str(dest)!r}) as f:
            f.write(b"complete")
        """,
    )
    assert proc.returncode == 0, proc.stderr
    assert temps(tmp_path) == [theirs]  # worker-0's own dead temp went; worker-1's stayed
    assert (tmp_path / theirs).read_bytes() == b"partial from llama-train-worker-1"
    assert dest.read_bytes() == b"complete"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("llama-train-worker-0", "llama-train-worker-1"),
        ("gpu-node-0123456789-a", "gpu-node-0123456789-b"),  # alike in the first 16
        ("node1.cluster.example.org", "node1.cluster.example.com"),  # dotted: hashed
        ("node_1", "node1"),  # characters a filename-safe rewrite would drop
        ("x" * 64, "x" * 63 + "y"),  # too long to keep: hashed
        ("worker-1", "worker-1-5"),  # one's tag starts the other's
        ("", "host"),
    ],
)
def test_different_hosts_get_different_filename_safe_tags(a: str, b: str) -> None:
    ta, tb = atomic.host_tag(a), atomic.host_tag(b)
    assert ta != tb
    for tag in (ta, tb):
        assert 0 < len(tag) <= 40 and all(c.isascii() and (c.isalnum() or c in "-_") for c in tag)
    assert atomic.host_tag(a) == ta  # stable: a later run on the same host finds its own debris


@pytest.mark.parametrize("other", ["worker-1-5", "worker-10", "worker-1-a"])
def test_cleanup_ignores_a_host_whose_tag_starts_with_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other: str
) -> None:
    dest = tmp_path / "ckpt.pt"
    dead = 999_999_999  # above any pid_max, so no process has it
    theirs = tmp_path / f".ckpt.pt.{atomic.host_tag(other)}-{dead}-abcd1234{TMP_SUFFIX}"
    ours = tmp_path / f".ckpt.pt.{atomic.host_tag('worker-1')}-{dead}-abcd1234{TMP_SUFFIX}"
    theirs.write_bytes(b"theirs")
    ours.write_bytes(b"ours")
    monkeypatch.setattr(atomic, "_HOST", atomic.host_tag("worker-1"))
    assert remove_stale_temps(dest) == [ours]
    assert temps(tmp_path) == [theirs.name]


def test_a_destination_with_a_255_byte_name_can_be_written(tmp_path: Path) -> None:
    dest = tmp_path / ("é" * 126 + "x" * 3)  # 255 bytes, the most one name may have
    with atomic_write(dest) as f:  # its temp name must fit too, not fail with ENAMETOOLONG
        f.write(b"complete")
    assert dest.read_bytes() == b"complete"
    assert temps(tmp_path) == []


def test_temp_names_of_a_255_byte_destination_fit_and_are_cleaned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(atomic, "_HOST", atomic.host_tag("h" * 64))  # the longest tag
    dest = tmp_path / ("é" * 126 + "x" * 3)  # 255 bytes, the most one name may have
    assert len(os.fsencode(dest.name)) == 255
    tmp = atomic.temp_path(dest)
    assert len(os.fsencode(tmp.name)) <= 255
    assert atomic.temp_path(tmp_path / (dest.name[:-1] + "y")).name.split(".")[1] != tmp.name.split(".")[1]
    stale = tmp.with_name(tmp.name.replace(f"-{os.getpid()}-", "-999999999-"))
    stale.write_bytes(b"dead writer")
    with atomic_write(dest) as f:
        f.write(b"complete")
    assert dest.read_bytes() == b"complete"
    assert temps(tmp_path) == []


# -- 3. check: verify the temp before it is published -------------------------------------------


@pytest.mark.parametrize(
    "error", [CheckpointFormatError("bad crc"), CheckpointNotFoundError("an OSError too"), ValueError("x")]
)
@pytest.mark.parametrize("existing", [False, True])
def test_a_failing_check_keeps_the_old_file_and_propagates_unchanged(
    tmp_path: Path, error: Exception, existing: bool
) -> None:
    dest = tmp_path / "out.pt"
    if existing:
        dest.write_bytes(b"old bytes")
    seen: list[bytes] = []

    def check(tmp: Path) -> None:
        seen.append(tmp.read_bytes())
        raise error

    with pytest.raises(type(error)) as caught:
        with atomic_write(dest, check=check) as f:
            f.write(b"new bytes")
    assert caught.value is error  # not wrapped in CheckpointWriteError, even the OSError one
    assert seen == [b"new bytes"]  # it saw the flushed data
    assert temps(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out.pt"] if existing else [])
    assert not existing or dest.read_bytes() == b"old bytes"


def test_a_passing_check_sees_the_synced_temp_before_it_is_published(tmp_path: Path) -> None:
    dest = tmp_path / "out.pt"
    dest.write_bytes(b"old bytes")
    seen: list[tuple[str, bytes, bytes]] = []

    def check(tmp: Path) -> None:
        seen.append((tmp.name, tmp.read_bytes(), dest.read_bytes()))

    with atomic_write(dest, check=check) as f:
        f.write(b"new bytes")
    ((name, data, published),) = seen
    assert name.endswith(TMP_SUFFIX) and data == b"new bytes" and published == b"old bytes"
    assert dest.read_bytes() == b"new bytes"
    assert temps(tmp_path) == []


def test_a_check_is_not_run_when_the_block_fails(tmp_path: Path) -> None:
    calls: list[Path] = []
    with pytest.raises(RuntimeError):
        with atomic_write(tmp_path / "out.pt", check=calls.append) as f:
            f.write(b"half")
            raise RuntimeError("serialisation failed")
    assert calls == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("existing", [False, True])
def test_a_failing_folder_check_keeps_the_old_folder_and_propagates_unchanged(tmp_path: Path, existing: bool) -> None:
    dest = tmp_path / "out"
    if existing:
        dest.mkdir()
        (dest / "model.safetensors").write_bytes(b"old bytes")
    error = CheckpointNotFoundError(f"{dest}: no index written; write model.safetensors.index.json")
    seen: list[list[str]] = []

    def check(tmp: Path) -> None:
        seen.append(sorted(p.name for p in tmp.iterdir()))
        raise error

    with pytest.raises(CkptkitError) as caught:
        with atomic_folder(dest, check=check) as tmp:
            (tmp / "model-00001-of-00001.safetensors").write_bytes(b"new bytes")
    assert caught.value is error
    assert seen == [["model-00001-of-00001.safetensors"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if existing else [])
    assert not existing or [p.read_bytes() for p in dest.iterdir()] == [b"old bytes"]


@pytest.mark.parametrize("existing", [False, True])
def test_a_passing_folder_check_publishes(tmp_path: Path, existing: bool) -> None:
    dest = tmp_path / "out"
    if existing:
        dest.mkdir()
        (dest / "model.safetensors").write_bytes(b"old bytes")
    calls: list[Path] = []
    with atomic_folder(dest, check=calls.append) as tmp:
        (tmp / "model.safetensors").write_bytes(b"new bytes")
    assert calls == [tmp]
    assert [p.read_bytes() for p in dest.iterdir()] == [b"new bytes"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_read_only_folder_is_a_write_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """os.open refused (EROFS): nothing was created, so nothing is unlinked, and the caller gets
    CheckpointWriteError saying why, not the OSError of an unlink of a file that never was."""
    import errno

    def refused(path: object, *args: object, **kwargs: object) -> int:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    def unlink(path: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(os, "open", refused)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(CheckpointWriteError, match="read-only filesystem"):
        with atomic_write(tmp_path / "x.pt") as f:
            f.write(b"never")


# -- 5. staging folders (io.remote) are cleaned as temp files are ------------------------------------


# Was: a writer killed mid-upload left its staging folder, with no host or pid in its name, for good.
def test_staging_folders_of_killed_writers_on_this_host_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = """
        import os, signal
        from ckptkit.io import remote
        with remote.staging("s3://bucket/run/ckpt.pt") as local:
            local.write_bytes(b"staged, never uploaded")
            os.kill(os.getpid(), signal.SIGKILL)
    """
    monkeypatch.setenv("CKPTKIT_STAGING", str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for host in ("other-node", platform.node()):
        proc = subprocess.run(
            [sys.executable, "-c", f"import platform\nplatform.node = lambda: {host!r}\n" + textwrap.dedent(code)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    theirs, ours = (f".ckptkit-stage.{atomic.host_tag(h)}-" for h in ("other-node", platform.node()))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and {n.startswith(theirs) for n in left} == {True, False}  # tagged by host and pid
    with remote.staging("s3://bucket/run/next.pt") as local:
        assert local.parent.name.startswith(f"{ours}{os.getpid()}-")
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(theirs)  # ours went; a pid of another host means nothing here
