"""The first test that uses an op compiles it into the op cache (30-60 s on 2 idle cores, several minutes on
a loaded machine); give this folder's tests room for that beyond the suite's 300 s default."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/unit/ops/" in str(item.path).replace("\\", "/") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(900))
