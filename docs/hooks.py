"""mkdocs hooks: the CLI page's option lists come from each command's own ``--help`` at build
time, and the API page must cover every name in ``ckptkit.__all__``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
HELP = re.compile(r"<!-- click-help: ([a-z -]*) -->")
API = re.compile(r"^::: ckptkit\.(\w+)\s*$", re.M)


def _help(command: str) -> str:
    """``ckptkit COMMAND --help`` of this source tree, as a user's terminal of 100 columns shows it."""
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "ckptkit.cli", *command.split(), "--help"]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"`ckptkit {command} --help` exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    text = proc.stdout.replace("python -m ckptkit.cli", "ckptkit").replace("__main__.py", "ckptkit").rstrip()
    return f"```text\n$ ckptkit {command} --help\n{text}\n```"


def _public_names() -> list[str]:
    sys.path.insert(0, str(SRC))
    try:
        import ckptkit  # torch-free: the package imports its names on first use
    finally:
        sys.path.remove(str(SRC))
    return [name for name in ckptkit.__all__ if name != "__version__"]


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    markdown = HELP.sub(lambda m: _help(m.group(1).strip()), markdown)
    if page.file.src_uri == "api.md":
        missing = sorted(set(_public_names()) - set(API.findall(markdown)))
        if missing:
            raise RuntimeError(f"docs/api.md documents no entry for ckptkit.{', ckptkit.'.join(missing)}: add one")
    return markdown
