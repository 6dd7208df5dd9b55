"""Schedules given as each stage's order of compute operations, turned into instruction steps by timing.

A :class:`TimedSchedule` says in which order every stage runs its forwards and backwards. Those orders are
timed with unit costs (forward 1, full backward 2, each half of a split backward 1, communication free):
an operation starts when its stage is free and its inputs exist. Step ``t`` of a stage then holds the sends
of what it finished at time ``t``, the receives of what its neighbours finished at time ``t``, and the
operation it starts at ``t``; so every send and its receive share a step, and the steps keep DeepSpeed's
promise (a barrier between any two steps cannot deadlock). Received tensors wait in their buffer until used.

* :class:`GPipeSchedule`: every forward, then every backward.
* :class:`InterleavedSchedule`: 1F1B over ``virtual_stages`` chunks per rank (rank ``d`` holds virtual stages
  ``d, d + p, ...``); micro-batches advance in groups of ``p`` (the first group also takes the ``m mod p``
  left over), which keeps the bubble at ``(p - 1) / (v m)`` for any ``m >= p``.
* :class:`ZeroBubbleSchedule`: ZB-H1 (Qi et al., 2023). The backward is split into the input gradients,
  which the previous stage waits for, and the weight gradients, which wait for nothing: stage ``s`` keeps
  ``s`` weight passes back and runs them in the drain, cutting the bubble to ``(p - 1) / (3 m)`` with the
  same peak of micro-batches in flight as 1F1B.

Instructions carry ``buffer_id`` (the micro-batch), ``chunk_id`` (this rank's chunk) and ``micro_batch_id``.
"""
from __future__ import annotations

from abc import abstractmethod
from functools import lru_cache
from typing import Iterator

from dsrun.pipe.schedule import (BackwardInputPass, BackwardPass, BackwardWeightPass, ForwardPass, LoadMicroBatch,
                       OptimizerStep, PipeInstruction, PipeSchedule, RecvActivation, RecvGrad, ReduceGrads,
                       ReduceTiedGrads, SendActivation, SendGrad)

Op = tuple[str, int, int]  # (kind: F | B | BI | BW, virtual stage, micro-batch)
OP_COST = {"F": 1, "B": 2, "BI": 1, "BW": 1}
OP_INSTRUCTION = {"F": ForwardPass, "B": BackwardPass, "BI": BackwardInputPass, "BW": BackwardWeightPass}


def _dependencies(op: Op, last: int) -> list[Op]:
    kind, k, j = op
    if kind == "F":
        return [("F", k - 1, j)] if k > 0 else []
    if kind == "BW":
        return [("BI", k, j)]
    deps: list[Op] = [("F", k, j)]
    if k < last:
        deps.append((kind, k + 1, j))
    return deps


def time_orders(orders: list[list[Op]], virtual_stages: int) -> dict[Op, tuple[int, int]]:
    """(start, end) of every operation when each stage runs its ``orders`` list in order, unit costs."""
    last = len(orders) * virtual_stages - 1
    timing: dict[Op, tuple[int, int]] = {}
    free = [0] * len(orders)
    position = [0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progress = False
        for d, order in enumerate(orders):
            while position[d] < len(order):
                op = order[position[d]]
                deps = _dependencies(op, last)
                if any(dep not in timing for dep in deps):
                    break
                start = max([free[d]] + [timing[dep][1] for dep in deps])
                timing[op] = (start, start + OP_COST[op[0]])
                free[d] = start + OP_COST[op[0]]
                position[d] += 1
                remaining -= 1
                progress = True
        if not progress:
            raise RuntimeError("the operation orders deadlock")
    return timing


class TimedSchedule(PipeSchedule):
    """A schedule defined by :meth:`compute_orders`; see the module docstring."""

    virtual_stages = 1
    trains = True  # the last step reduces the gradients and steps the optimizer

    @classmethod
    @abstractmethod
    def compute_orders(cls, micro_batches: int, stages: int, virtual_stages: int) -> list[list[Op]]:
        """Every stage's compute operations, in the order it runs them."""

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def _chunk(self, k: int) -> int:
        return k // self.stages

    def steps(self) -> Iterator[list[PipeInstruction]]:
        if getattr(self, "_steps", None) is None:  # the same every batch: built once per schedule object
            self._steps = self._build_steps()
        return iter([list(step) for step in self._steps])

    def _build_steps(self) -> list[list[PipeInstruction]]:
        p, d, last = self.stages, self.stage_id, self.stages * self.virtual_stages - 1
        timing = _timing(type(self), self.micro_batches, self.stages, self.virtual_stages)
        makespan = max(end for _, end in timing.values())
        steps: list[list[PipeInstruction]] = [[] for _ in range(makespan + 1)]

        def args(k: int, j: int) -> dict[str, int]:
            return {"buffer_id": j, "chunk_id": self._chunk(k), "micro_batch_id": j}

        near = {(d - 1) % p, d, (d + 1) % p}
        mine = [(op, span) for op, span in timing.items() if op[1] % p in near]
        for (kind, k, j), (start, end) in mine:
            if kind == "F" and k < last:
                if k % p == d:
                    steps[end].append(SendActivation(**args(k, j)))
                if (k + 1) % p == d:
                    steps[end].append(RecvActivation(**args(k + 1, j)))
            if kind in ("B", "BI") and k > 0:
                if k % p == d:
                    steps[end].append(SendGrad(**args(k, j)))
                if (k - 1) % p == d:
                    steps[end].append(RecvGrad(**args(k - 1, j)))
        for (kind, k, j), (start, end) in mine:
            if k % p != d:
                continue
            if kind == "F" and (k == 0 or k == last):
                steps[start].append(LoadMicroBatch(**args(k, j)))
            steps[start].append(OP_INSTRUCTION[kind](**args(k, j)))
        for step in steps:  # in each step: sends, receives, loads, then the compute
            order = (SendActivation, SendGrad, RecvActivation, RecvGrad, LoadMicroBatch)
            step.sort(key=lambda cmd: order.index(type(cmd)) if type(cmd) in order else len(order))
        while len(steps) > 1 and not steps[-1]:
            steps.pop()
        if self.trains:
            steps[-1] += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        return steps


@lru_cache(maxsize=32)
def _timing(cls: type[TimedSchedule], micro_batches: int, stages: int,
            virtual_stages: int) -> dict[Op, tuple[int, int]]:
    """The timing is the same for every stage of one pipeline: computed once."""
    return time_orders(cls.compute_orders(micro_batches, stages, virtual_stages), virtual_stages)


class GPipeSchedule(TimedSchedule):
    """GPipe: all forwards, then all backwards (every micro-batch's activations live until its backward)."""

    @classmethod
    def compute_orders(cls, micro_batches: int, stages: int, virtual_stages: int) -> list[list[Op]]:
        m = micro_batches
        return [[("F", s, j) for j in range(m)] + [("B", s, j) for j in range(m)] for s in range(stages)]


class InterleavedSchedule(TimedSchedule):
    """Interleaved 1F1B (Megatron-LM's) over ``virtual_stages`` chunks per rank; needs ``micro_batches >=
    stages``."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 2):
        super().__init__(micro_batches, stages, stage_id)
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages must be at least 1, got {virtual_stages}")
        if micro_batches < stages:
            raise ValueError(f"the interleaved schedule needs at least as many micro-batches as stages "
                             f"({micro_batches} < {stages})")
        self.virtual_stages = virtual_stages

    @staticmethod
    def _groups(p: int, m: int) -> list[list[int]]:
        sizes = [p] * (m // p)
        sizes[0] += m % p
        groups, start = [], 0
        for size in sizes:
            groups.append(list(range(start, start + size)))
            start += size
        return groups

    @classmethod
    def compute_orders(cls, micro_batches: int, stages: int, virtual_stages: int) -> list[list[Op]]:
        p, v = stages, virtual_stages
        groups = cls._groups(p, micro_batches)
        orders = []
        for d in range(p):
            forward = [(c * p + d, j) for group in groups for c in range(v) for j in group]
            backward = [(c * p + d, j) for group in groups for c in reversed(range(v)) for j in group]
            warmup = min(len(forward), (p - d - 1) * 2 + (v - 1) * len(groups[0]))
            order: list[Op] = [("F", k, j) for k, j in forward[:warmup]]
            f = warmup
            for k, j in backward:
                if f < len(forward):
                    order.append(("F",) + forward[f])
                    f += 1
                order.append(("B", k, j))
            orders.append(order)
        return orders


class ZeroBubbleSchedule(TimedSchedule):
    """ZB-H1: 1F1B with the backward split; stage ``s`` defers ``s`` weight passes to the drain."""

    @classmethod
    def compute_orders(cls, micro_batches: int, stages: int, virtual_stages: int) -> list[list[Op]]:
        p, m = stages, micro_batches
        orders = []
        for s in range(p):
            warmup = min(p - s - 1, m)
            order: list[Op] = [("F", s, j) for j in range(warmup)]
            f, pending = warmup, []
            for b in range(m):
                if f < m:
                    order.append(("F", s, f))
                    f += 1
                order.append(("BI", s, b))
                pending.append(b)
                if len(pending) > s:
                    order.append(("BW", s, pending.pop(0)))
            order += [("BW", s, j) for j in pending]
            orders.append(order)
        return orders
