"""Integration-test fixtures. The estimator's predicted-vs-measured table goes into the terminal summary, so
CI's log shows it whether the test passed or failed (and without ``-s``): the lines travel as the test's
``user_properties``, which pytest-xdist carries from the worker that ran the test to the controller, where
``tests/conftest.py`` prints them."""
from __future__ import annotations

import pytest

from tests.conftest import ESTIMATE_TABLE_PROPERTY


@pytest.fixture
def estimate_table_log(request) -> list:
    """Lines appended here are printed in pytest's terminal summary."""
    lines: list = []
    request.node.user_properties.append((ESTIMATE_TABLE_PROPERTY, lines))
    return lines
