# The one-rank gloo world the engine tests use (defined once, in tests/unit/runtime/conftest.py).
from tests.unit.runtime.conftest import world_of_one  # noqa: F401
