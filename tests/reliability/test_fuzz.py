"""The fixed-seed mutation fuzzer (``fuzz.py``) over every reader and the CLI: 0 in every class.

The CI size is ``CKPTKIT_FUZZ_N`` mutants (default 6000, about two minutes on 2 cores), times
``--stress``; the same seed, so a larger campaign judges the CI's mutants and more. Slow: it runs
in ``python -m pytest -m "slow or dist"`` (``.ci/run``) and in ``report.py``.

    CKPTKIT_FUZZ_N=20000 python -m pytest -m slow tests/reliability/test_fuzz.py   # a larger campaign
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.reliability import fuzz

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

DEFAULT_N = 6000


def test_mutants_of_every_format_find_nothing(tmp_path: Path, stress: int, tally: Counter[str]) -> None:
    n = int(os.environ.get("CKPTKIT_FUZZ_N", DEFAULT_N)) * stress
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.reliability.fuzz", "run", "--n", str(n), "--seed", "0", "--dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if os.environ.get("CKPTKIT_FUZZ_SUMMARY"):  # report.py lists what the campaign found
        Path(os.environ["CKPTKIT_FUZZ_SUMMARY"]).write_text(json.dumps(result))
    counts = result["counts"]
    tally["fuzz mutants (fixed seed)"] += result["mutants"]
    for family, k in result["families"].items():
        tally[f"fuzz mutants: {family}"] += k
    for cls in fuzz.CLASSES:
        tally[f"fuzz mutants with {cls}"] += counts[cls]
    tally["hangs"] += counts["hangs"]
    tally["payloads executed"] += counts["payloads run"]
    tally["unexpected exceptions, tracebacks or debris"] += counts["exceptions"] + counts["debris"]
    tally["verify/reader disagreements"] += counts["disagreements"]
    tally["silent changes"] += counts["silent changes"]
    assert result["mutants"] == n
    assert all(counts[cls] == 0 for cls in fuzz.CLASSES), "\n".join(fuzz.summary_lines(result))


# Mutants that campaigns with other seeds found, each rebuilt and judged as the campaign judged it:
# (seed, index) -> what it found.
FOUND = {
    (1, 4817): "a negative dimension in a DeepSpeed buffer's size: torch.empty raised from read",
    (2, 4798): "a DCP chunk's record edited to 0 bytes: verify passed, torch's reader refused",
}


@pytest.mark.parametrize(("seed", "index"), sorted(FOUND))
def test_mutants_found_with_other_seeds_find_nothing(tmp_path: Path, seed: int, index: int) -> None:
    import warnings

    seeds = fuzz.make_seeds(tmp_path / "seeds")
    work = tmp_path / "m"
    work.mkdir()
    mutant = fuzz.build_mutant(seeds, seed, index, work)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fuzz.judge(mutant, fuzz.originals([mutant.seed])[mutant.seed.name], 60.0)
    assert result["findings"] == [], (FOUND[(seed, index)], result)
