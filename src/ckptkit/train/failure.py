"""A worker's error, told once: the first cause, in one line, with its rank.

When a worker fails, torchrun's agent stops the others with SIGTERM, so what the launcher sees
last is the wrong cause ("rank 1 was killed by SIGTERM"). Each worker therefore writes the
exception it raised to the file torchrun names in ``TORCHELASTIC_ERROR_FILE``, in the layout of
torch's own ``@record`` (torchrun's summary shows it too), plus the one line a user reads and
when it happened; ``ckptkit train`` reads them back and tells the earliest. Under ``ckptkit
train`` (``QUIET`` set) the workers print nothing of their own, so the user reads one line.

Example:
    >>> one_line(ValueError("sample 17 is corrupt\\n  (details)"))
    'ValueError: sample 17 is corrupt'
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from dataclasses import dataclass

from ckptkit.errors import ArgumentError, CkptkitError, cause

# Set by ``ckptkit train`` (not with ``--debug``): the launcher tells a worker's error, the worker stays silent.
QUIET = "CKPTKIT_TRAIN_QUIET"


@dataclass(frozen=True)
class Failure:
    """What a worker recorded as it failed.

    Attributes:
        line: the one line a user reads.
        time: when the worker raised it (seconds since the epoch).
        exit_code: 2 for a usage error, else 1.
        expected: a ckptkit error, whose message says the fix; else a traceback may help.
    """

    line: str
    time: float
    exit_code: int
    expected: bool


def one_line(e: BaseException) -> str:
    """A ckptkit error's message; anything else as ``Type: first line of its message``."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if isinstance(e, CkptkitError):
        return " ".join(lines)  # ckptkit's messages are one line already; keep every word if not
    return cause(e)


def exit_code(e: BaseException) -> int:
    return 2 if isinstance(e, ArgumentError) else 1


def record(e: BaseException) -> None:
    """Write ``e`` where torchrun's agent looks for this worker's error; nothing without torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now, line = time.time(), one_line(e)
    data = {
        "message": {
            "message": line,
            "extraInfo": {"py_callstack": "".join(traceback.format_exception(e)), "timestamp": str(int(now))},
        },
        "ckptkit": {"line": line, "time": now, "exit_code": exit_code(e), "expected": isinstance(e, CkptkitError)},
    }
    with contextlib.suppress(OSError):  # the error itself still ends the worker, and the exit code says so
        with open(path, "w") as f:
            json.dump(data, f)


def read(path: str) -> Failure | None:
    """What :func:`record` wrote at ``path``; None where a worker wrote nothing (killed, or not ckptkit's)."""
    try:
        with open(path) as f:
            found = json.load(f).get("ckptkit")
        return Failure(str(found["line"]), float(found["time"]), int(found["exit_code"]), bool(found["expected"]))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
