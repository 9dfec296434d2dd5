"""Preemption: a signal on any rank becomes a stop that every rank agrees on."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from . import collectives as _dist


class StopSignal:
    """Catch SIGTERM, SIGINT and SIGHUP (a closed terminal), or the ``signals`` given, and let all
    ranks stop together at a step boundary.

    A scheduler's SIGTERM (or Ctrl-C) may reach one rank only. :meth:`should_stop`, called by
    every rank at the same step, returns True on all of them if any rank got a signal, so all
    can save and exit cleanly instead of some blocking in a collective; :attr:`stopped_by` then
    tells every rank which signals arrived (a SLURM job's SIGUSR1 asks for a requeue, a SIGTERM
    does not). A second SIGINT restores the default handler's effect and interrupts at once.

    Example:
        >>> stop = StopSignal((signal.SIGTERM, signal.SIGINT, signal.SIGUSR1))  # doctest: +SKIP
        >>> for step in ...:  # doctest: +SKIP
        ...     train_step()
        ...     if stop.should_stop():
        ...         save_training_state(...); break
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)) -> None:
        self.received: int | None = None
        #: The signals any rank received, sorted; the same on every rank once should_stop() was True.
        self.stopped_by: tuple[int, ...] = ()
        self._got: set[int] = set()  # every signal, not only the last: a SIGTERM after SIGUSR1 must not hide it
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        self._got.add(signum)

    def should_stop(self) -> bool:
        """True on every rank if any rank received a signal. Must be called on all ranks."""
        stop = _dist.any_true(self.received is not None, what="StopSignal.should_stop")
        if stop and not self.stopped_by:  # once per stop, so each step costs one small all-reduce
            gathered = _dist.all_gather_object(sorted(self._got), what="StopSignal.should_stop")
            self.stopped_by = tuple(sorted({s for got in gathered for s in got}))
        return stop

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> StopSignal:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()
