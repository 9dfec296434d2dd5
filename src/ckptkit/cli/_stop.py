"""What Ctrl-C while the command line, or a command's module, loads prints: one line, exit 130.

A module of its own, importing nothing of ckptkit: ``ckptkit.cli`` imports it before anything
else, and the command group uses it when it loads a command's module on demand.
"""

from __future__ import annotations

import sys
from typing import NoReturn


def stopped_while_loading() -> NoReturn:
    """Say that SIGINT stopped the command before it did anything, and exit 130 (no traceback)."""
    sys.stderr.write("ckptkit: error: stopped by SIGINT; nothing was written\n")
    sys.exit(130)
