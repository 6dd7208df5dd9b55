"""fp16 overflow handling across ranks, and a hung rank turning into a bounded failure."""
from __future__ import annotations

import pytest

from tests.harness.models import build_model, global_batch, slice_batch
from tests.harness.runs import ds_config
from tests.helpers import run_ranks
from tests.integration.test_engine_parity import LAUNCHES  # noqa: F401 (the runs fixture shares its launches)


def hang_ranks(rank: int, world: int) -> None:
    """The last rank never reaches its first optimizer step; the others wait in a collective."""
    import time
    from datetime import timedelta

    import dsrun

    dsrun.init_distributed(timeout=timedelta(seconds=5), verbose=False)
    engine, _, _, _ = dsrun.initialize(model=build_model("mlp"), config=ds_config(1, 2, 1, bucket=300))
    loss = engine(slice_batch(global_batch("mlp", 0, 2 * world), 2 * rank, 2 * rank + 2))
    if rank == world - 1:
        time.sleep(120)  # stuck: never joins the reduce-scatter
    engine.backward(loss)
    engine.step()


@pytest.mark.slow
def test_inf_gradient_on_one_rank_skips_the_step_everywhere(runs) -> None:
    # runs inside the 2-rank launch of test_engine_parity (one process start-up for both files)
    per_rank = [results["fp16_overflow/2"] for results in runs[2]]
    for records in per_rank:
        scales = [r["scale"] for r in records]
        # 2**10 to start; the overflow at step 2 halves it (hysteresis 1); 3 clean steps (window 3) double it
        assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
        assert [r["skipped"] for r in records] == [0, 0, 1, 1, 1, 1, 1]
        assert records[2]["changed"] is False  # the skipped step left the weights alone on every rank
        assert records[3]["changed"] is True
        # the scheduler does not advance on the skipped step, global_steps does
        assert [r["sched_iter"] for r in records] == [0, 1, 1, 2, 3, 4, 5]
        assert [r["global_steps"] for r in records] == list(range(1, 8))
    assert per_rank[0] == per_rank[1]


@pytest.mark.slow
def test_hung_rank_fails_within_bounded_time() -> None:
    """The bound is the collective's own timeout, not the test's: the waiting rank gives up after the 5 s that
    init_distributed(timeout=...) set and reports it, long before the stuck rank wakes (120 s) or run_ranks stops
    waiting (90 s, which would say "did not finish" instead). No wall clock is read: under load it proves nothing."""
    with pytest.raises(AssertionError) as info:
        run_ranks(hang_ranks, 2, timeout=90)
    assert "rank 0 failed" in str(info.value) and "did not finish" not in str(info.value)
    assert "timed out waiting 5000ms" in str(info.value).lower()
    assert "over ranks [0, 1] timed out" in str(info.value) and "never reached it" in str(info.value)  # one line
