"""The schedule executor: runs one stage's instruction stream (:mod:`.schedule`, :mod:`.timed`) for the
:class:`~dsrun.pipe.engine.PipelineEngine`.

Instructions come in steps; a step's communications (send and receive activations or gradients) go out as one
exchange (:mod:`.p2p`), the others run in order: load a micro-batch (first and last stages read the data
iterator), forward this rank's chunk, backward (whole, or split into the input and weight passes of the
zero-bubble schedule), sum the gradients of weights tied across stages. The executor keeps what each micro-batch
holds between its instructions (:class:`PipeBuffer`, keyed by chunk and buffer id) and reads the engine's parts
(module, precision, ZeRO strategy, timers, data iterator) through :class:`PipelineStage`; the two boundary
instructions (reduce the gradients, step the optimizer) are the engine's own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch

from dsrun.engine.engine import BACKWARD_TIMER, FORWARD_TIMER
from dsrun.pipe import p2p
from dsrun.pipe.feature import BatchTiming
from dsrun.pipe.schedule import (COMMUNICATION, COMPUTE, BackwardInputPass, BackwardPass, BackwardWeightPass,
                                 ForwardPass, LoadMicroBatch, OptimizerStep, PipeInstruction, PipeSchedule,
                                 RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad)

if TYPE_CHECKING:
    from dsrun.engine.direct_backward import DirectBackward
    from dsrun.precision.strategy import PrecisionStrategy
    from dsrun.profiling.timers import WallClockTimers
    from dsrun.zero.base import ZeroStrategy

    from .topology import PipelineParallelGrid


class PipelineError(Exception):
    """A pipeline engine used the wrong way (``forward``/``backward``/``step`` instead of ``train_batch``),
    or stages that disagree (a micro-batch's labels meeting another micro-batch's activations)."""


@dataclass
class PipeBuffer:
    """What one stage holds for one micro-batch between its instructions."""

    micro_batch_id: int = -1
    inputs: Any = None
    labels: Any = None
    label_micro_batch_id: int = -1
    outputs: Any = None
    loss: torch.Tensor | None = None
    output_grads: Any = None
    input_grads: Any = None
    weight_pass: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None = None


def _items(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _like(structure: Any, values: list[Any]) -> Any:
    return tuple(values) if isinstance(structure, (tuple, list)) else values[0]


class PipelineStage(Protocol):
    """What the executor reads of the :class:`~dsrun.pipe.engine.PipelineEngine` (a Protocol: the engine imports
    this module)."""

    module: Any  # the PipelineModule (loss_fn, micro_offset, tied parameters)
    precision: PrecisionStrategy
    strategy: ZeroStrategy | None
    direct_backward: DirectBackward
    timers: WallClockTimers
    device: torch.device
    grid: PipelineParallelGrid
    stage_id: int
    num_stages: int
    virtual_stages: int
    micro_batches: int
    global_steps: int
    data_iterator: Iterator[Any] | None
    batch_fn: Callable[[Any], Any] | None

    def is_last_stage(self) -> bool: ...

    def _reduce_boundary_gradients(self) -> None: ...

    def _step_at_boundary(self) -> None: ...


class ScheduleExecutor:
    """Runs schedules on one stage of ``engine``; ``split``: the messages cut over the model-parallel ranks
    (:func:`dsrun.pipe.p2p.exchange`)."""

    def __init__(self, engine: PipelineStage, split: dict[int, p2p.Split]):
        self.engine = engine
        self.split = split
        self.buffers: dict[tuple[int, int], PipeBuffer] = {}
        self.loaded = 0
        self.losses: list[torch.Tensor] = []
        self.outputs: list[Any] = []
        self.compute_loss = True
        self.handlers: dict[type, Callable[[Any], None]] = {
            LoadMicroBatch: self._exec_load_micro_batch, ForwardPass: self._exec_forward_pass,
            BackwardPass: self._exec_backward_pass, BackwardInputPass: self._exec_backward_input_pass,
            BackwardWeightPass: self._exec_backward_weight_pass, ReduceTiedGrads: self._exec_reduce_tied_grads,
            ReduceGrads: lambda cmd: engine._reduce_boundary_gradients(),
            OptimizerStep: lambda cmd: engine._step_at_boundary()}

    def run(self, schedule: PipeSchedule, timing: BatchTiming, compute_loss: bool = True) -> None:
        """Run every instruction of ``schedule`` (a step's communications together, as one exchange), timing the
        compute ones in ``timing``; the last stage's losses (``compute_loss``) and evaluation outputs are kept in
        :attr:`losses` and :attr:`outputs`."""
        self.buffers, self.loaded = {}, 0
        self.losses, self.outputs, self.compute_loss = [], [], compute_loss
        for step in schedule.steps():
            i = 0
            while i < len(step):
                if isinstance(step[i], COMMUNICATION):
                    j = i
                    while j < len(step) and isinstance(step[j], COMMUNICATION):
                        j += 1
                    self._exchange(step[i:j])
                    i = j
                    continue
                began = time.perf_counter()
                self.handlers[type(step[i])](step[i])
                if isinstance(step[i], COMPUTE):
                    timing.computed(began)
                i += 1
        self.buffers = {}

    def _buffer(self, cmd: PipeInstruction, fresh: bool = False) -> PipeBuffer:
        key = (getattr(cmd, "chunk_id", 0), cmd.buffer_id)
        if fresh or key not in self.buffers:
            self.buffers[key] = PipeBuffer()
        return self.buffers[key]

    def _first_chunk(self, cmd: PipeInstruction) -> bool:
        return self.engine.stage_id == 0 and getattr(cmd, "chunk_id", 0) == 0

    def _last_chunk(self, cmd: PipeInstruction) -> bool:
        return self.engine.is_last_stage() and getattr(cmd, "chunk_id", 0) == self.engine.virtual_stages - 1

    def _peer(self, offset: int) -> int:
        """The global rank of the stage ``offset`` away in this pipeline (wrapping, for virtual stages)."""
        return self.engine.grid.stage_to_global((self.engine.stage_id + offset) % self.engine.num_stages)

    def _to_device(self, value: Any) -> Any:
        if torch.is_tensor(value):
            return value.to(self.engine.device)
        if isinstance(value, (tuple, list)):
            return type(value)(self._to_device(v) for v in value)
        return value

    # --- instructions -------------------------------------------------------------------------------------------
    def _exec_load_micro_batch(self, cmd: LoadMicroBatch) -> None:
        if self.engine.data_iterator is None:
            raise PipelineError("no training data: pass data_iter to train_batch() or training_data to "
                                "dsrun.initialize()")
        batch = next(self.engine.data_iterator)
        if self.engine.batch_fn is not None:
            batch = self.engine.batch_fn(batch)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise PipelineError("a pipeline's data iterator yields (inputs, labels) pairs; got "
                                f"{type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
        inputs, labels = batch
        micro_batch_id, self.loaded = self.loaded, self.loaded + 1
        if self._first_chunk(cmd):
            buf = self._buffer(cmd, fresh=True)
            (args, _) = self.engine.precision.prepare_inputs((self._to_device(inputs),), {})
            buf.inputs, buf.micro_batch_id = args[0], micro_batch_id
        else:
            buf = self._buffer(cmd)
        if self._last_chunk(cmd):
            buf.labels, buf.label_micro_batch_id = self._to_device(labels), micro_batch_id

    def _exec_forward_pass(self, cmd: ForwardPass) -> None:
        buf, engine = self._buffer(cmd), self.engine
        engine.timers.start(FORWARD_TIMER)
        engine.module.micro_offset = engine.global_steps * engine.micro_batches + buf.micro_batch_id
        outputs = engine.module(buf.inputs, chunk_id=getattr(cmd, "chunk_id", 0))
        engine.timers.stop(FORWARD_TIMER)
        if not self._last_chunk(cmd):
            buf.outputs = outputs
            return
        if self.compute_loss:
            if buf.label_micro_batch_id != buf.micro_batch_id:
                raise PipelineError(f"stage {engine.stage_id}: the labels of micro-batch "
                                    f"{buf.label_micro_batch_id} met the activations of micro-batch "
                                    f"{buf.micro_batch_id}")
            loss_fn = engine.module.loss_fn
            buf.loss = loss_fn(outputs, buf.labels) if loss_fn is not None else outputs
            self.losses.append(buf.loss.detach())
        if not engine.module.training:
            self.outputs.append(outputs)

    def _backward_targets(self, buf: PipeBuffer, cmd: PipeInstruction) -> tuple[list[torch.Tensor], list[Any] | None]:
        """What backward starts from: the scaled loss on the last stage, else the outputs that got gradients."""
        if self._last_chunk(cmd):
            loss = buf.loss.float()
            if self.engine.micro_batches > 1:
                loss = loss / self.engine.micro_batches
            return [self.engine.precision.scale_loss(loss)], None
        pairs = [(o, g) for o, g in zip(_items(buf.outputs), _items(buf.output_grads))
                 if g is not None and torch.is_tensor(o) and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _collect_input_grads(self, buf: PipeBuffer, cmd: PipeInstruction, grads: list[Any] | None = None) -> None:
        if self._first_chunk(cmd):
            return
        items = _items(buf.inputs)
        if grads is None:
            grads = [t.grad if torch.is_tensor(t) and t.requires_grad else None for t in items]
        buf.input_grads = _like(buf.inputs, grads)

    def _exec_backward_pass(self, cmd: BackwardPass) -> None:
        buf = self._buffer(cmd)
        self.engine.timers.start(BACKWARD_TIMER)
        targets, grads = self._backward_targets(buf, cmd)
        if self.engine.strategy is not None:
            self.engine.strategy.before_backward(False)
        if targets:
            with self.engine.direct_backward.engine_backward():
                torch.autograd.backward(targets, grads)
        if self.engine.strategy is not None:
            self.engine.strategy.after_backward(False)
        self._collect_input_grads(buf, cmd)
        buf.outputs = buf.output_grads = buf.loss = None
        self.engine.timers.stop(BACKWARD_TIMER)

    def _exec_backward_input_pass(self, cmd: BackwardInputPass) -> None:
        buf = self._buffer(cmd)
        targets, grads = self._backward_targets(buf, cmd)
        items = _items(buf.inputs)
        wanted = [i for i, t in enumerate(items) if torch.is_tensor(t) and t.requires_grad]
        input_grads: list[Any] = [None] * len(items)
        if targets and wanted and not self._first_chunk(cmd):
            got = torch.autograd.grad(targets, [items[i] for i in wanted], grads, retain_graph=True, allow_unused=True)
            for i, g in zip(wanted, got):
                input_grads[i] = g
        self._collect_input_grads(buf, cmd, input_grads)
        buf.weight_pass = (targets, grads)
        buf.outputs = buf.output_grads = buf.loss = None

    def _exec_backward_weight_pass(self, cmd: BackwardWeightPass) -> None:
        buf = self._buffer(cmd)
        targets, grads = buf.weight_pass
        if self.engine.strategy is not None:
            self.engine.strategy.before_backward(False)
        if targets:
            params = [p for p in self.engine.module.parameters() if p.requires_grad]
            with self.engine.direct_backward.engine_backward():
                torch.autograd.backward(targets, grads, inputs=params)
        if self.engine.strategy is not None:
            self.engine.strategy.after_backward(False)
        buf.weight_pass = None

    def _exchange(self, cmds: list[PipeInstruction]) -> None:
        outgoing, incoming = [], []
        for cmd in cmds:
            buf = self._buffer(cmd)
            if isinstance(cmd, SendActivation):
                outgoing.append(p2p.Outgoing(p2p.ACTIVATION, self._peer(+1), buf.outputs, buf.micro_batch_id))
            elif isinstance(cmd, SendGrad):
                outgoing.append(p2p.Outgoing(p2p.GRAD, self._peer(-1), buf.input_grads, buf.micro_batch_id))
            elif isinstance(cmd, RecvActivation):
                incoming.append((cmd, p2p.Incoming(p2p.ACTIVATION, self._peer(-1))))
            elif isinstance(cmd, RecvGrad):
                incoming.append((cmd, p2p.Incoming(p2p.GRAD, self._peer(+1))))
        p2p.exchange(outgoing, [msg for _, msg in incoming], self.engine.device, self.split)
        for cmd in cmds:
            if isinstance(cmd, SendGrad):
                buf = self._buffer(cmd)
                buf.inputs = buf.input_grads = None
            elif isinstance(cmd, SendActivation) and not self.engine.module.training:
                self._buffer(cmd).outputs = None
        for cmd, msg in incoming:
            if isinstance(cmd, RecvActivation):
                buf = self._buffer(cmd, fresh=True)  # a receive precedes its micro-batch's load in every schedule
                buf.inputs, buf.micro_batch_id = msg.value, msg.micro_batch_id
            else:
                buf = self._buffer(cmd)
                if msg.micro_batch_id != buf.micro_batch_id:
                    raise PipelineError(f"stage {self.engine.stage_id}: gradients of micro-batch "
                                        f"{msg.micro_batch_id} arrived for micro-batch {buf.micro_batch_id}")
                buf.output_grads = msg.value

    def _exec_reduce_tied_grads(self, cmd: ReduceTiedGrads) -> None:
        self.engine.module.allreduce_tied_weight_gradients()
        for copy in self.engine.module.tied_parameters(owned=False):  # its owner steps it
            copy.grad = None
