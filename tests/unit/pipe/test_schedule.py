"""Schedules as instruction streams: DeepSpeed's TrainSchedule instruction for instruction (api-inventory
§2.5), and the invariants every schedule keeps (each micro-batch forwarded and backwarded once per stage,
every send paired with a receive in the same step)."""
from __future__ import annotations

import pytest

from dsrun.pipe.schedule import (BackwardInputPass, BackwardPass, BackwardWeightPass,
                                         DataParallelSchedule, ForwardPass, InferenceSchedule, LoadMicroBatch,
                                         OptimizerStep, PipeInstruction, RecvActivation, RecvGrad, ReduceGrads,
                                         ReduceTiedGrads, SendActivation, SendGrad, TrainSchedule)
from dsrun.pipe.timed import GPipeSchedule, InterleavedSchedule, ZeroBubbleSchedule

SHORT = {"LoadMicroBatch": "Load", "ForwardPass": "Fwd", "BackwardPass": "Bwd", "SendActivation": "SendAct",
         "RecvActivation": "RecvAct"}


def render(schedule) -> str:
    def one(cmd: PipeInstruction) -> str:
        name = SHORT.get(cmd.name, cmd.name)
        return f"{name}({cmd.buffer_id})" if hasattr(cmd, "buffer_id") else name
    return " ".join("[" + ",".join(one(c) for c in step) + "]" for step in schedule.steps())


def test_train_schedule_is_deepspeeds_instruction_for_instruction() -> None:
    assert render(TrainSchedule(4, 2, 0)) == (
        "[Load(0),Fwd(0)] [SendAct(0)] [Load(1),Fwd(1)] [RecvGrad(0),SendAct(1),Bwd(0)] [Load(0),Fwd(0)] "
        "[RecvGrad(1),SendAct(0),Bwd(1)] [Load(1),Fwd(1)] [RecvGrad(0),SendAct(1),Bwd(0)] [] "
        "[RecvGrad(1),Bwd(1),ReduceTiedGrads,ReduceGrads,OptimizerStep]")
    assert render(TrainSchedule(4, 2, 1)) == (
        "[] [RecvAct(0),Load(0),Fwd(0)] [Bwd(0)] [SendGrad(0),RecvAct(1),Load(1),Fwd(1)] [Bwd(1)] "
        "[SendGrad(1),RecvAct(0),Load(0),Fwd(0)] [Bwd(0)] [SendGrad(0),RecvAct(1),Load(1),Fwd(1)] [Bwd(1)] "
        "[SendGrad(1),ReduceTiedGrads,ReduceGrads,OptimizerStep]")


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (3, 2), (4, 8), (1, 3)])
def test_train_schedule_steps_and_buffers(stages: int, micro_batches: int) -> None:
    for stage in range(stages):
        schedule = TrainSchedule(micro_batches, stages, stage)
        assert len(list(schedule.steps())) == 2 * (micro_batches + stages - 1)
        assert schedule.num_pipe_buffers() == max(2, min(stages - stage, micro_batches))
        assert schedule.is_first_stage == (stage == 0) and schedule.is_last_stage == (stage == stages - 1)
        assert (schedule.stage, schedule.num_stages, schedule.num_micro_batches) == (stage, stages, micro_batches)


def _counts(schedule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for step in schedule.steps():
        for cmd in step:
            counts[cmd.name] = counts.get(cmd.name, 0) + 1
    return counts


SCHEDULES = [(TrainSchedule, {}), (GPipeSchedule, {}), (ZeroBubbleSchedule, {}),
             (InterleavedSchedule, {"virtual_stages": 2}), (InterleavedSchedule, {"virtual_stages": 3})]


@pytest.mark.parametrize("cls,kwargs", SCHEDULES)
@pytest.mark.parametrize("stages,micro_batches", [(2, 2), (2, 5), (4, 4), (4, 7)])
def test_every_micro_batch_runs_once_and_every_send_meets_its_receive(cls, kwargs, stages, micro_batches) -> None:
    virtual = kwargs.get("virtual_stages", 1)
    per_stage = [list(cls(micro_batches, stages, s, **kwargs).steps()) for s in range(stages)]
    for s, steps in enumerate(per_stage):
        counts = _counts(cls(micro_batches, stages, s, **kwargs))
        assert counts["ForwardPass"] == micro_batches * virtual
        backward = counts.get("BackwardPass", 0) + counts.get("BackwardInputPass", 0)
        assert backward == micro_batches * virtual
        assert counts.get("BackwardWeightPass", 0) in (0, micro_batches * virtual)
        assert [c.name for c in steps[-1][-3:]] == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
        assert counts.get("LoadMicroBatch", 0) == (micro_batches if s in (0, stages - 1) else 0)
    # step t of stage s sends exactly what stage s +- 1 receives at step t (wrapping for virtual stages)
    length = max(len(steps) for steps in per_stage)
    for t in range(length):
        for s in range(stages):
            step = per_stage[s][t] if t < len(per_stage[s]) else []
            nxt, prv = per_stage[(s + 1) % stages], per_stage[(s - 1) % stages]
            sends_act = sum(isinstance(c, SendActivation) for c in step)
            sends_grad = sum(isinstance(c, SendGrad) for c in step)
            recv_act = sum(isinstance(c, RecvActivation) for c in (nxt[t] if t < len(nxt) else []))
            recv_grad = sum(isinstance(c, RecvGrad) for c in (prv[t] if t < len(prv) else []))
            assert sends_act == recv_act and sends_grad == recv_grad, (cls.__name__, t, s)


def test_zero_bubble_splits_every_backward() -> None:
    counts = _counts(ZeroBubbleSchedule(6, 3, 1))
    assert counts["BackwardInputPass"] == counts["BackwardWeightPass"] == 6 and "BackwardPass" not in counts


def test_interleaved_tags_chunks_and_needs_enough_micro_batches() -> None:
    chunks = {cmd.chunk_id for step in InterleavedSchedule(4, 2, 1, virtual_stages=3).steps() for cmd in step
              if isinstance(cmd, ForwardPass)}
    assert chunks == {0, 1, 2}
    with pytest.raises(ValueError, match="at least as many micro-batches"):
        InterleavedSchedule(1, 2, 0, virtual_stages=2)


def test_inference_schedule_forwards_each_micro_batch_once_with_two_buffers() -> None:
    for stage in range(3):
        schedule = InferenceSchedule(5, 3, stage)
        counts = _counts(schedule)
        assert schedule.num_pipe_buffers() == 2 and counts["ForwardPass"] == 5
        assert not {"BackwardPass", "OptimizerStep"} & set(counts)
        assert counts.get("SendActivation", 0) == (5 if stage < 2 else 0)
        assert counts.get("RecvActivation", 0) == (5 if stage > 0 else 0)


def test_data_parallel_schedule_is_the_documented_example() -> None:
    steps = list(DataParallelSchedule(3, 1, 0).steps())
    assert steps[0] == [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0), BackwardPass(buffer_id=0)]
    assert steps[-1][-2:] == [ReduceGrads(), OptimizerStep()]
    assert DataParallelSchedule(3, 1, 0).num_pipe_buffers() == 1


def test_instructions_keep_their_keyword_arguments() -> None:
    cmd = BackwardWeightPass(buffer_id=3, chunk_id=1)
    assert (cmd.buffer_id, cmd.chunk_id, cmd.name) == (3, 1, "BackwardWeightPass")
    assert repr(cmd) == "BackwardWeightPass(buffer_id=3, chunk_id=1)"
    assert BackwardInputPass(buffer_id=1) != BackwardWeightPass(buffer_id=1)
    assert ReduceTiedGrads() == ReduceTiedGrads()
    with pytest.raises(ValueError):
        TrainSchedule(0, 2, 0)
