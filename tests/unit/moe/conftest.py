import os

import pytest


@pytest.fixture(scope="module")
def world_of_one():
    """torch.distributed initialized in this process as a one-rank gloo world; torn down (and the
    environment restored) after the module, so other tests never see it."""
    import torch.distributed as dist

    from tests.helpers import free_port

    saved = dict(os.environ)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
