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

import contextlib
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
                done.release()


def in_background(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """Start ``fn(*args)`` on a helper thread; returns the function that waits for its result
    (and raises its exception). The wait never returns while ``fn`` may still run, so ``fn`` may
    read a buffer the caller releases right after.

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
        try:
            done.acquire()
        finally:  # a signal while waiting: the job still finishes with the caller's buffer first
            while "end" not in box:
                with contextlib.suppress(BaseException):
                    done.acquire(timeout=0.1)
            _idle.append(helper)
        if "error" in box:
            raise box["error"]
        return box["value"]

    return wait


if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads
    os.register_at_fork(after_in_child=_idle.clear)
