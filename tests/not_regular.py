"""A checkpoint folder whose file is not a regular file (a folder, a FIFO, a symlink loop, a dangling
symlink, ``/dev/zero``): how a test puts one in place, and what every entry point must then do:
refuse it with a one-line ckptkit error that names the file and what is there, never hang on it
and never raise a bare OSError.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import CkptkitError

# What replaces the file -> what the error says is there.
FOUND = {
    "folder": "is a folder, not a regular file",
    "fifo": "is a FIFO, not a regular file",
    "symlink loop": "is a symlink loop",
    "dangling symlink": "is a dangling symlink",
    "dev zero": "is a character device, not a regular file",
}


def replace(victim: Path, how: str) -> None:
    """Put ``how`` (a key of :data:`FOUND`) where the file ``victim`` was."""
    victim.unlink()
    if how == "folder":
        victim.mkdir()
    elif how == "fifo":
        os.mkfifo(victim)
    elif how == "symlink loop":
        victim.symlink_to(victim.name)
    elif how == "dangling symlink":
        victim.symlink_to(victim.parent / "no-such-file")
    else:
        victim.symlink_to("/dev/zero")


class Hung(Exception):
    """The block ran past its deadline: something blocked (a FIFO opened for reading waits for a writer)."""


@contextlib.contextmanager
def deadline(seconds: int = 60, memory: int = 4 << 30) -> Iterator[None]:
    """Raise :class:`Hung` in the block after ``seconds``: a test that would hang fails instead.
    Generous: it catches a reader that blocks forever, not a slow one. And a reader that reads
    ``/dev/zero`` to its end (a read the alarm cannot interrupt) gets a MemoryError once the
    process holds ``memory`` bytes more address space than on entry, instead of taking the machine's."""

    def hung(signum: int, frame: FrameType | None) -> None:
        raise Hung(f"still running after {seconds} s: blocked on a file that is not a regular file?")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    held = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = held + memory if hard == resource.RLIM_INFINITY else min(held + memory, hard)
    previous = signal.signal(signal.SIGALRM, hung)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)


def assert_refused_everywhere(checkpoint: Path, victim: Path, how: str, out: Path) -> None:
    """verify fails, and read, inspect and convert (the API and the CLI) raise, each naming
    ``victim`` and what :func:`replace` put there, in one line; ``out`` is never written."""
    found = FOUND[how]

    def named(text: str) -> bool:
        return found in text and victim.name in text

    with deadline():
        report = ckptkit.verify_checkpoint(checkpoint)
        assert not report.ok and any(named(c.detail) for c in report.checks if not c.ok), report.checks
        calls = {
            "read": lambda: ckptkit.read_checkpoint(checkpoint, map_location="cpu"),
            "inspect": lambda: ckptkit.inspect_checkpoint(checkpoint),
            "convert": lambda: ckptkit.convert_checkpoint(checkpoint, out),
        }
        for what, call in calls.items():
            with pytest.raises(CkptkitError) as e:
                call()
            assert named(str(e.value)) and "\n" not in str(e.value), (what, str(e.value))
        for args in (["verify", checkpoint], ["inspect", checkpoint], ["convert", checkpoint, out]):
            result = CliRunner().invoke(main, [str(a) for a in args])
            assert result.exit_code == 1, (args, result.output)
            if args[0] == "verify":  # a report of failed checks, on stdout
                assert named(" ".join(result.stdout.split())), result.stdout
                continue
            lines = result.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("ckptkit: error: ") and named(lines[0]), result.stderr
    assert not out.exists()
