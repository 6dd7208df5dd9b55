"""Pipeline schedules as data: each stage runs a stream of instructions, DeepSpeed's names and semantics.

A schedule yields one *step* (a list of :class:`PipeInstruction`) at a time. Steps are atomic: the sends and
receives of a step are matched by sends and receives in the same step of the neighbouring stages, so a
barrier may sit between any two steps without a deadlock. The engine (:mod:`dsrun.pipe.engine`) runs
the instructions; :mod:`dsrun.pipe.simulate` times them with unit costs.

* :class:`TrainSchedule` -- DeepSpeed's synchronous 1F1B, ``2 * (micro_batches + stages - 1)`` steps.
* :class:`InferenceSchedule` -- forward only, two buffers.
* :class:`DataParallelSchedule` -- plain gradient accumulation (one stage).
* GPipe, interleaved 1F1B and the zero-bubble schedule are in :mod:`dsrun.pipe.timed`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator


class PipeInstruction:
    """Base of every instruction; its keyword arguments become attributes (``ForwardPass(buffer_id=0)``)."""

    def __init__(self, **kwargs: object):  # any values, kept as attributes
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients; after ReduceGrads and ReduceTiedGrads. A data-parallel
    synchronisation point."""


class ReduceGrads(PipeInstruction):
    """Reduce the gradients among the data-parallel ranks of this stage."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of tied weights among the stages sharing them (every stage of one pipeline may
    take part: schedule it where all of them are)."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on pipeline buffer ``buffer_id``."""

    def __init__(self, buffer_id: int, **kwargs: object):
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """``buffers['inputs'][buffer_id] = next(data_iter)`` (first stage: the inputs; last stage: the labels)."""


class ForwardPass(BufferOpInstruction):
    """``buffers['outputs'][buffer_id] = forward(buffers['inputs'][buffer_id])``."""


class BackwardPass(BufferOpInstruction):
    """Backward from ``buffers['outputs'][buffer_id]`` with the received gradients (the loss on the last
    stage); accumulates the parameters' gradients."""


class BackwardInputPass(BufferOpInstruction):
    """The input half of a split backward (zero-bubble): only the gradients of this stage's inputs, which the
    previous stage waits for. The graph is kept for :class:`BackwardWeightPass`."""


class BackwardWeightPass(BufferOpInstruction):
    """The weight half of a split backward: the parameters' gradients of that micro-batch, run when the
    stage would otherwise wait."""


class SendActivation(BufferOpInstruction):
    """Send ``buffers['outputs'][buffer_id]`` to the next stage (paired with its RecvActivation)."""


class RecvActivation(BufferOpInstruction):
    """``buffers['inputs'][buffer_id] = recv()`` from the previous stage (paired with its SendActivation)."""


class SendGrad(BufferOpInstruction):
    """Send the gradients of the received activations to the previous stage. Only received tensors that
    require grad produce gradients; the others travel as None."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of ``buffers['outputs'][buffer_id]`` from the next stage (None where the output
    needed none)."""


COMPUTE = (ForwardPass, BackwardPass, BackwardInputPass, BackwardWeightPass)
COMMUNICATION = (SendActivation, RecvActivation, SendGrad, RecvGrad)


class PipeSchedule(ABC):
    """Directs one stage: :meth:`steps` yields lists of instructions for ``micro_batches`` micro-batches of
    a pipeline of ``stages`` stages, as stage ``stage_id`` runs them."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(f"a schedule needs micro_batches >= 1 and 0 <= stage_id < stages; got "
                             f"{micro_batches}, {stages}, {stage_id}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield the instructions of each step."""

    def num_pipe_buffers(self) -> int:
        """Buffers the engine keeps for this stage (micro-batches in flight)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _buffer_idx(self, micro_batch_id: int) -> int:
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()


class InferenceSchedule(PipeSchedule):
    """Forward only: micro-batch ``j`` runs on stage ``s`` at step ``j + s`` and its output travels to the
    next stage at the following step, alternating between two buffers."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step in range(self.micro_batches + self.stages - 1):
            current = step - self.stage_id
            previous = current - 1
            cmds: list[PipeInstruction] = []
            if self._valid_micro_batch(previous) and self._valid_stage(self.next_stage):
                cmds.append(SendActivation(self._buffer_idx(previous)))
            if self._valid_micro_batch(current) and self._valid_stage(self.prev_stage):
                cmds.append(RecvActivation(self._buffer_idx(current)))
            if self._valid_micro_batch(current):
                if self.is_first_stage or self.is_last_stage:
                    cmds.append(LoadMicroBatch(self._buffer_idx(current)))
                cmds.append(ForwardPass(self._buffer_idx(current)))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 2


class TrainSchedule(PipeSchedule):
    """Synchronous 1F1B (DeepSpeed's): stage ``s`` runs the forward of micro-batch ``j`` at step ``2j + s``
    and its backward at step ``2j + 2 * stages - 1 - s``, so forwards and backwards alternate once the
    pipeline is full. Each step first exchanges what the previous step produced with the neighbours."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total = 2 * (self.micro_batches + self.stages - 1)
        prev_mb, prev_forward = -1, False
        for step in range(total):
            mb, forward = self._step_to_micro_batch(step)
            cmds: list[PipeInstruction] = []
            if forward:
                if self._valid_micro_batch(prev_mb) and not prev_forward and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(self._buffer_idx(prev_mb)))
                if self._valid_micro_batch(mb) and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(self._buffer_idx(mb)))
            else:
                if self._valid_micro_batch(mb) and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(self._buffer_idx(mb)))
                if self._valid_micro_batch(prev_mb) and prev_forward and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(self._buffer_idx(prev_mb)))
            if self._valid_micro_batch(mb):
                if forward:
                    if self.is_first_stage or self.is_last_stage:
                        cmds.append(LoadMicroBatch(self._buffer_idx(mb)))
                    cmds.append(ForwardPass(self._buffer_idx(mb)))
                else:
                    cmds.append(BackwardPass(self._buffer_idx(mb)))
            if step == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev_mb, prev_forward = mb, forward
            yield cmds

    def _step_to_micro_batch(self, step: int) -> tuple[int, bool]:
        """(micro-batch, is forward) of ``step`` on this stage: forwards fall on steps of the stage's parity."""
        if step % 2 == self.stage_id % 2:
            return (step - self.stage_id) // 2, True
        return (step - 2 * self.stages + 1 + self.stage_id) // 2, False

    def num_pipe_buffers(self) -> int:
        """Forwards in flight: the distance to the last stage (at least 2, at most the micro-batches)."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class DataParallelSchedule(PipeSchedule):
    """Gradient accumulation without a pipeline: load, forward, backward per micro-batch; reduce and step
    after the last."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0),
                                           BackwardPass(buffer_id=0)]
            if step == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1
