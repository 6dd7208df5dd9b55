"""The one-rank gloo world the engine tests need (shared with tests/unit/runtime)."""
from tests.unit.runtime.conftest import world_of_one  # noqa: F401  (a fixture, found by pytest here)
