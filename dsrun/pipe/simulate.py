"""A unit-cost simulator of pipeline schedules: how long the instruction streams take, and each stage's bubble.

Every stage runs its schedule's instructions in order. A forward costs 1, a full backward 2 (input and
weight gradients), each half of a split backward 1; everything else costs 0. A send completes at once (the
engine posts sends without waiting); a receive waits until its matching send has happened: the n-th
``SendActivation`` from stage ``a`` to ``b`` pairs with the n-th ``RecvActivation`` at ``b`` from ``a`` (and
so for gradients), activations going to ``(s + 1) % stages`` and gradients to ``(s - 1) % stages`` (the
wrap-around only occurs with virtual stages). A stream that waits forever is a deadlock and raises.

The bubble of a stage is its idle time over its busy time, ``(makespan - busy) / busy``: ``(p - 1) / m`` for
1F1B and GPipe, ``(p - 1) / (v m)`` for interleaved 1F1B with ``v`` virtual stages, ``(p - 1) / (3 m)`` for
the zero-bubble schedule (tests/unit/pipe/test_simulate.py checks them exactly, as fractions).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

from dsrun.pipe.schedule import (BackwardInputPass, BackwardPass, BackwardWeightPass, ForwardPass, PipeInstruction,
                       RecvActivation, RecvGrad, SendActivation, SendGrad)

UNIT_COSTS: dict[type, int] = {ForwardPass: 1, BackwardPass: 2, BackwardInputPass: 1, BackwardWeightPass: 1}


@dataclass(frozen=True)
class Simulation:
    """The outcome of one simulated batch: the makespan and each stage's busy time (exact fractions)."""

    makespan: Fraction
    busy: tuple[Fraction, ...]

    def idle_fraction(self, stage: int) -> Fraction:
        return (self.makespan - self.busy[stage]) / self.busy[stage]

    @property
    def bubble(self) -> Fraction:
        """The largest idle fraction of any stage."""
        return max(self.idle_fraction(s) for s in range(len(self.busy)))


def _channel(cmd: PipeInstruction, stage: int, stages: int) -> tuple[str, int, int] | None:
    """(kind, source stage, destination stage) of a communication instruction, else None."""
    if isinstance(cmd, SendActivation):
        return "activation", stage, (stage + 1) % stages
    if isinstance(cmd, RecvActivation):
        return "activation", (stage - 1) % stages, stage
    if isinstance(cmd, SendGrad):
        return "grad", stage, (stage - 1) % stages
    if isinstance(cmd, RecvGrad):
        return "grad", (stage + 1) % stages, stage
    return None


def simulate_streams(streams: Sequence[Sequence[PipeInstruction]],
                     costs: dict[type, int | Fraction] | None = None) -> Simulation:
    """Run one instruction stream per stage with unit (or the given integer or fractional) costs."""
    costs = UNIT_COSTS if costs is None else costs
    stages = len(streams)
    clock: list[int | Fraction] = [0] * stages
    busy: list[int | Fraction] = [0] * stages
    position = [0] * stages
    sent: dict[tuple[str, int, int], list[int | Fraction]] = {}
    received: dict[tuple[str, int, int], int] = {}
    while any(position[s] < len(streams[s]) for s in range(stages)):
        progress = False
        for s in range(stages):
            while position[s] < len(streams[s]):
                cmd = streams[s][position[s]]
                channel = _channel(cmd, s, stages)
                if isinstance(cmd, (SendActivation, SendGrad)):
                    sent.setdefault(channel, []).append(clock[s])
                elif channel is not None:
                    n = received.get(channel, 0)
                    times = sent.get(channel, [])
                    if n >= len(times):
                        break  # blocked until the sender gets there
                    clock[s] = max(clock[s], times[n])
                    received[channel] = n + 1
                else:
                    cost = costs.get(type(cmd), 0)
                    clock[s] += cost
                    busy[s] += cost
                position[s] += 1
                progress = True
        if not progress:
            stuck = {s: streams[s][position[s]] for s in range(stages) if position[s] < len(streams[s])}
            raise RuntimeError(f"the schedule deadlocks: stages wait at {stuck}")
    return Simulation(makespan=Fraction(max(clock)), busy=tuple(Fraction(b) for b in busy))


def simulate(schedule: Callable[..., Any], stages: int, micro_batches: int,
             costs: dict[type, int | Fraction] | None = None, **kwargs: Any) -> Simulation:
    """Simulate ``schedule(micro_batches, stages, stage_id, **kwargs)`` (a schedule class) on every stage."""
    streams = [[cmd for step in schedule(micro_batches, stages, s, **kwargs).steps() for cmd in step]
               for s in range(stages)]
    return simulate_streams(streams, costs)
