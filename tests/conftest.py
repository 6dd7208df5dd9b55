import os

import pytest

# Keep every test single-threaded unless it splits the cores itself: the machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The default recipe logs an MLflow run; tests that do not test MLflow skip it (those that do set it to true
# or pick monitor=mlflow, which this does not affect).
os.environ.setdefault("DSRUN_MLFLOW", "false")


@pytest.fixture
def port():
    from tests.helpers import free_port

    return free_port()


def pytest_sessionstart(session):
    """Engines on CPU use the compiled CPU Adam, which compiles on first use (30-60 s, then cached). Build it
    once here, outside every test's time limit; without a compiler the op's torch fallback is used."""
    from op_builder import CompilerUnavailableError, get_builder

    try:
        get_builder("cpu_adam").load()
    except CompilerUnavailableError:
        pass
