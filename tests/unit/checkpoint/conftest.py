import os

import pytest


@pytest.fixture(scope="module")
def single_rank():
    """A one-rank gloo process group in this process (the engine's collectives are then no-ops)."""
    from dsrun import comm
    from tests.helpers import free_port

    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    comm.init_distributed(dist_backend="gloo", verbose=False)
    yield
    comm.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def make_engine(stage: int = 1, precision: str = "fp32", dropout: float = 0.0, frozen: bool = False, extra=None,
                zero=None):
    import dsrun
    from tests.harness.models import checkpoint_gpt
    from tests.harness.runs import checkpoint_config

    model = checkpoint_gpt(dropout, frozen)
    engine, *_ = dsrun.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config=checkpoint_config(stage, precision, 4, extra, zero))
    return engine


def train(engine, steps: int, start: int = 0) -> list[float]:
    from tests.harness.checkpoints import StepStream

    stream = StepStream(4, 0, 1)
    stream.step = start
    losses = []
    for _ in range(steps):
        batch = stream.next()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
