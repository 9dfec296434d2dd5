"""The helper threads a copy hands its CRC-32 (and a DCP convert its next chunks) to: kept and
reused between jobs, one per job at a time, fresh in a forked child, and never left running
with the caller's buffer when a signal stops the wait."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest

from ckptkit.io.helper import in_background


def _helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ckptkit-crc"]


def test_a_job_returns_its_value_or_raises_its_error() -> None:
    assert in_background(sum, [1, 2, 3])() == 6
    with pytest.raises(ZeroDivisionError):
        in_background(divmod, 1, 0)()


def test_helpers_are_reused_not_started_per_job() -> None:
    for _ in range(3):  # at most two jobs at once below: two helpers, whatever ran before
        a, b = in_background(sum, [1]), in_background(sum, [2])
        assert (a(), b()) == (1, 2)
    before = len(_helpers())
    for i in range(200):
        a, b = in_background(sum, [i]), in_background(sum, [i, 1])
        assert (a(), b()) == (i, i + 1)
    assert len(_helpers()) == before


def test_threads_that_copy_at_once_get_their_own_results() -> None:
    results: dict[int, list[int]] = {}

    def worker(k: int) -> None:
        results[k] = [in_background(lambda x: x * k, i)() for i in range(300)]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [i * k for i in range(300)] for k in range(4)}


class _Stop(Exception):
    pass


def test_a_signal_while_waiting_lets_the_job_finish_first() -> None:
    """The job may read a buffer the caller releases as soon as the wait ends (a mapping)."""
    finished = threading.Event()

    def job() -> int:
        time.sleep(1.5)
        finished.set()
        return 0

    def stop(*_: object) -> None:
        raise _Stop

    old = signal.signal(signal.SIGUSR1, stop)
    try:
        wait = in_background(job)
        threading.Timer(0.1, signal.raise_signal, (signal.SIGUSR1,)).start()
        with pytest.raises(_Stop):
            wait()
        assert finished.is_set()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert in_background(sum, [4])() == 4  # the helper went back to work


def test_a_forked_child_starts_its_own_helpers() -> None:
    """A child has none of its parent's threads: handing it a parent's idle helper would hang."""
    code = (
        "import os, sys\n"
        "from ckptkit.io.helper import in_background\n"
        "assert in_background(sum, [1, 2])() == 3\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if in_background(sum, [3, 4])() == 7 else 3)\n"
        "sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_an_idle_helper_keeps_nothing_of_its_last_job() -> None:
    """A DCP convert hands its source (open files) to a helper; an idle helper held it until its
    next job."""

    class Arg:
        pass

    arg = Arg()
    ref = weakref.ref(arg)
    assert in_background(lambda a: type(a).__name__, arg)() == "Arg"
    del arg
    gc.collect()
    assert ref() is None


def test_waiting_twice_gives_the_same_outcome_and_hands_the_helper_back_once() -> None:
    ok, bad = in_background(sum, [5]), in_background(divmod, 1, 0)
    assert (ok(), ok()) == (5, 5)  # the second wait blocked for ever before
    for _ in range(2):
        with pytest.raises(ZeroDivisionError):
            bad()
    results = [in_background(lambda x: (time.sleep(0.01), x)[1], i) for i in range(3)]
    assert [r() for r in results] == [0, 1, 2]  # each on its own helper, none handed out twice
