from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the fixture models live in fixtures/, a sibling of tests/
    sys.path.insert(0, str(ROOT))

FIXTURES = ROOT / "fixtures"

if TYPE_CHECKING:
    from tests.train.slurm_cluster import SlurmCluster


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A real single-node SLURM, one for the session (the trainer's tests and convert's use it)."""
    from tests.train.slurm_cluster import SlurmCluster, missing_binaries

    missing = missing_binaries()
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    try:
        cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
    except (OSError, RuntimeError) as e:
        pytest.skip(f"a single-node SLURM could not start here: {e}")
    yield cluster
    cluster.stop()


@pytest.hookimpl(tryfirst=True)  # before -m selects: a process-group test is a slow one
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every ``dist`` test is also ``slow``; docstring examples that are all ``+SKIP`` (they need
    files the docs only name) are not collected, rather than listed as skipped in every summary."""
    import doctest

    from _pytest.doctest import DoctestItem

    kept, dropped = [], []
    for item in items:
        if item.get_closest_marker("dist") is not None:
            item.add_marker(pytest.mark.slow)
        examples = item.dtest.examples if isinstance(item, DoctestItem) and item.dtest is not None else None
        if examples is not None and all(ex.options.get(doctest.SKIP) for ex in examples):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


# -- the reliability suite: a size option and a tally of what was tried -------------------------

import json  # noqa: E402
from collections import Counter  # noqa: E402

TALLY: Counter[str] = Counter()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--stress", type=int, default=1, help="multiply the reliability suite's trial counts")
    parser.addoption("--reliability-report", default=None, help="write the reliability tally as JSON here")


@pytest.fixture
def stress(request: pytest.FixtureRequest) -> int:
    return max(1, int(request.config.getoption("--stress")))


@pytest.fixture
def tally() -> Counter[str]:
    """Counters the reliability tests add to (trials, faults, inputs, losses, hangs, payloads run)."""
    return TALLY


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--reliability-report")
    if path:
        Path(path).write_text(
            json.dumps({"exitstatus": int(exitstatus), "tally": dict(sorted(TALLY.items()))}, indent=2)
        )
