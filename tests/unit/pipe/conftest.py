from tests.unit.runtime.conftest import world_of_one  # noqa: F401  (a one-rank gloo world for this module)
