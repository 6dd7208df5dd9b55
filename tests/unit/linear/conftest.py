"""The one-rank gloo world of tests/unit/runtime, for the sharding checks here."""
from tests.unit.runtime.conftest import world_of_one  # noqa: F401
