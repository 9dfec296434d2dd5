"""Helper threads for work that overlaps the caller's: a step's CRC-32 while the kernel copies it.

A helper is kept, idle, once its job is collected, and the next job takes it: starting a thread
costs ~100 us on this project's test machine, handing a job to a waiting one ~13 us, and a DCP
folder's convert hands over a job per chunk (hundreds per GiB), each on the copy's critical path.

Each helper is a daemon thread, so one left idle never holds up interpreter exit (a
ThreadPoolExecutor joins its workers at exit: Ctrl-C landing while one started once left
``convert`` hung after its error). Each job takes a helper of its own, so threads that copy at
once never wait on each other's CRCs, and a forked child starts afresh (its parent's helpers do
not run there).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

_idle: list[_Helper] = []  # list.pop and .append are atomic: no lock needed
_Job = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], threading.Lock]


class _Helper:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="ckptkit-crc", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, args, box, done = self.jobs.get()
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e
            finally:
                box["end"] = True
                release = done.release
                # An idle helper must not keep its last job's arguments (a source's open
                # files, a buffer) alive: drop them before the caller may go on.
                del fn, args, box, done
                release()


def in_background(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """Start ``fn(*args)`` on a helper thread; returns the function that waits for its result
    (and raises its exception); waiting again gives the same outcome. A signal that stops the
    wait (Ctrl-C) is raised only once ``fn`` has ended, so ``fn`` may read a buffer the caller
    releases right after. (Python cannot promise that against a second signal landing between
    two of the wait's own steps; releasing a buffer the job still reads then raises BufferError,
    it does not free it.)

    Example:
        >>> wait = in_background(sum, [1, 2, 3])
        >>> wait()
        6
    """
    try:
        helper = _idle.pop()
    except IndexError:
        helper = _Helper()
    box: dict[str, Any] = {}
    done = threading.Lock()
    done.acquire()  # the helper releases it when the job ends
    helper.jobs.put((fn, args, box, done))

    def wait() -> Any:
        if "collected" not in box:
            try:
                done.acquire()
            finally:  # a signal while waiting: the job still finishes with the caller's buffer first
                _settle(box, done)
                box["collected"] = True  # handed back once, or two jobs could share it
                _idle.append(helper)
        if "error" in box:
            raise box["error"]
        return box["value"]

    return wait


def _settle(box: dict[str, Any], done: threading.Lock) -> None:
    """Wait until the job in ``box`` has ended, whatever signals land meanwhile."""
    while True:
        try:
            while "end" not in box:
                done.acquire(timeout=0.1)
            return
        except BaseException:  # the first signal is already on its way to the caller
            continue


if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads
    os.register_at_fork(after_in_child=_idle.clear)
