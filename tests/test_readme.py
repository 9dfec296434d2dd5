"""The README's Python blocks run as written, twice (the second run resumes or redoes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

# -- the README's Python blocks run as written ---------------------------------------------


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


@pytest.mark.dist
@pytest.mark.parametrize("index", range(len(_readme_blocks())))
def test_the_readmes_python_blocks_run_as_written(tmp_path: Path, index: int) -> None:
    code = _readme_blocks()[index]
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = code.splitlines()[0]
    if first.startswith("# torchrun"):  # distributed code: under torchrun with 2 processes, as the block says
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "example.py"]
    else:
        assert first.startswith("# python"), "say how the block runs on its first line"
        cmd = [sys.executable, "example.py"]
    for attempt in ("first run", "second run: resumes or redoes"):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{attempt}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


# -- a stranger reads it top to bottom ------------------------------------------------------------


def test_the_readme_stays_short_and_its_links_lead_somewhere() -> None:
    """At most 220 lines (details live in docs/), and every relative link names a file in the repository."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    links = [t for t in re.findall(r"\]\(([^)#]+)\)", text) if "://" not in t]
    assert links and [t for t in links if not (ROOT / t).exists()] == []
