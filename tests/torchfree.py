"""Run ckptkit in a fresh interpreter: whether it imported torch, and under a memory limit."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

_SCRIPT = """
import json, sys
from ckptkit.cli import main
code = 0
try:
    for args in json.loads(sys.argv[1]):
        try:
            main(args, standalone_mode=False)
        except SystemExit as e:
            code = e.code or 0
        if code:
            break
finally:
    print("torch imported:", "torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def run_torch_free(*commands: Sequence[str | Path]) -> tuple[subprocess.CompletedProcess[str], bool]:
    """Run each command (``["convert", SRC, DST]``) in one new interpreter, stopping at the first
    that fails; return the process (its exit code the failing command's) and whether torch was
    imported on the way."""
    import json

    argv = json.dumps([[str(a) for a in c] for c in commands])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, argv], capture_output=True, text=True, timeout=180)
    assert "torch imported:" in proc.stderr, proc.stderr
    return proc, "torch imported: True" in proc.stderr


def limited_memory() -> None:
    """``preexec_fn`` for a child that may not take more than 6 GiB of address space: a reader
    that allocates what a hostile file claims then fails there, not on the machine."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
