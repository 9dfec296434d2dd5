"""The ``ckptkit`` command line: click parses, the library works, rich renders.

Data goes to stdout, diagnostics to stderr. Exit codes: 0 ok, 1 failure or difference,
2 usage. Expected errors print one line and no traceback (``--debug`` shows it). torch and rich
are imported inside the commands, so ``ckptkit --help`` stays fast. The commands use only the
public API (``ckptkit``, ``ckptkit.errors``): they are its first clients.
"""

from __future__ import annotations

from ._stop import stopped_while_loading  # first: it must be there whenever Ctrl-C lands

try:
    from . import commands  # noqa: F401  (importing it registers the commands; train's loads when used)
    from .base import main
except KeyboardInterrupt:
    stopped_while_loading()

__all__ = ["main"]
