"""The one-rank gloo world of tests/unit/runtime, for the engine tests here."""
from tests.unit.runtime.conftest import world_of_one  # noqa: F401
