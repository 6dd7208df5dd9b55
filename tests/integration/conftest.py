"""Integration-test hooks: the estimator's predicted-vs-measured table goes into the terminal summary, so
CI's log shows it whether the test passed or failed (and without ``-s``)."""
from __future__ import annotations

import pytest

ESTIMATE_TABLES = pytest.StashKey[list]()


@pytest.fixture
def estimate_table_log(request) -> list:
    """Lines appended here are printed in pytest's terminal summary."""
    return request.config.stash.setdefault(ESTIMATE_TABLES, [])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(ESTIMATE_TABLES, None)
    if lines:
        terminalreporter.section("dsrun estimate-memory: predicted vs measured peak per rank")
        for line in lines:
            terminalreporter.write_line(line)
