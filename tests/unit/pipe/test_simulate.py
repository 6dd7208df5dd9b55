"""The unit-cost simulator on the schedules' own instruction streams: the bubble (idle over busy time of
every stage) is exactly (p - 1)/m for 1F1B and GPipe, (p - 1)/(v m) for interleaved 1F1B and (p - 1)/(3 m)
for the zero-bubble schedule, for p in {2, 4, 8} and every m from p to 8p."""
from __future__ import annotations

from fractions import Fraction

import pytest

from dsrun.pipe.schedule import ForwardPass, RecvActivation, SendActivation, TrainSchedule
from dsrun.pipe.simulate import simulate, simulate_streams
from dsrun.pipe.timed import GPipeSchedule, InterleavedSchedule, ZeroBubbleSchedule

CASES = [(p, m) for p in (2, 4, 8) for m in range(p, 8 * p + 1)]


def _every_stage(result, expected: Fraction) -> None:
    assert [result.idle_fraction(s) for s in range(len(result.busy))] == [expected] * len(result.busy)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_one_f_one_b_and_gpipe(p: int) -> None:
    for stages, m in [c for c in CASES if c[0] == p]:
        for cls in (TrainSchedule, GPipeSchedule):
            _every_stage(simulate(cls, stages, m), Fraction(stages - 1, m))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zero_bubble(p: int) -> None:
    for stages, m in [c for c in CASES if c[0] == p]:
        _every_stage(simulate(ZeroBubbleSchedule, stages, m), Fraction(stages - 1, 3 * m))


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved(p: int, v: int) -> None:
    for stages, m in [c for c in CASES if c[0] == p]:
        _every_stage(simulate(InterleavedSchedule, stages, m, virtual_stages=v), Fraction(stages - 1, v * m))


def test_makespan_of_one_f_one_b() -> None:
    result = simulate(TrainSchedule, 4, 8)
    assert result.makespan == 3 * (8 + 4 - 1) and result.busy == (24,) * 4


def test_a_receive_without_a_send_is_a_deadlock() -> None:
    streams = [[ForwardPass(buffer_id=0)], [RecvActivation(buffer_id=0), ForwardPass(buffer_id=0)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate_streams(streams)
    streams[0].append(SendActivation(buffer_id=0))
    assert simulate_streams(streams).makespan == 2
