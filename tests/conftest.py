import os

import pytest

# Keep every test single-threaded unless it splits the cores itself: the machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def port():
    from tests.helpers import free_port

    return free_port()
