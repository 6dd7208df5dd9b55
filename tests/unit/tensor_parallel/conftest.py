"""The tensor-parallel unit tests share ``world_of_one`` (a one-rank gloo world for the module) with tests/unit/runtime."""
from tests.unit.runtime import conftest as _runtime

world_of_one = _runtime.world_of_one
