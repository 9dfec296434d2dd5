from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the fixture models live in fixtures/, a sibling of tests/
    sys.path.insert(0, str(ROOT))

FIXTURES = ROOT / "fixtures"


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


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
