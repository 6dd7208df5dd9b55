"""Gradient buckets filled by autograd hooks and launched strictly in order.

A bucket is a range of a flat group. Buckets are laid out from the end of the model to its start, the order
in which backward produces gradients. Each parameter's post-accumulate hook counts down the buckets it
overlaps; a bucket whose count reaches zero is handed to ``launch`` — but only after every earlier bucket,
so all ranks issue their collectives in the same order even when a parameter is unused on some rank (such
buckets are launched by :meth:`BucketQueue.flush` at the end of backward). Also the buffers buckets reuse
(:class:`FlatBufferPool`) and what ZeRO-3's buckets hand DeepCompile (:class:`CompilerIntake`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from dsrun.zero.layout import FlatGroup


@dataclass
class Bucket:
    group_index: int
    start: int
    end: int
    param_indices: list[int]
    pending: int = 0
    handles: list[Any] = field(default_factory=list)
    staging: torch.Tensor | None = None  # stage 2: this bucket's gradients, copied out of param.grad
    received: torch.Tensor | None = None  # stage 2: this rank's reduced piece, until it is accumulated
    staged_runs: list[Any] = field(default_factory=list)  # stage 0, torch_autocast: (offset, piece) reduced apart

    @property
    def numel(self) -> int:
        return self.end - self.start


def plan_buckets(groups: list[FlatGroup], bucket_numel: int) -> list[Bucket]:
    """Cut every group's padded range into buckets of at most ``bucket_numel`` elements, last group first and
    each group from its end to its start (backward order)."""
    bucket_numel = max(1, int(bucket_numel))
    buckets: list[Bucket] = []
    for gi in reversed(range(len(groups))):
        group = groups[gi]
        end = group.padded_numel
        while end > 0:
            start = max(0, end - bucket_numel)
            overlapping = [i for i, (off, n) in enumerate(zip(group.offsets, group.numels))
                           if n > 0 and off < end and off + n > start]
            buckets.append(Bucket(gi, start, end, overlapping))
            end = start
    return buckets


class BucketQueue:
    """Tracks which buckets are complete during one backward pass and launches them in order."""

    def __init__(self, groups: list[FlatGroup], buckets: list[Bucket], launch: Callable[[Bucket], None],
                 on_param_ready: Callable[[int, int, list[Bucket]], None] | None = None,
                 on_accumulated: Callable[[int, int], None] | None = None):
        self.groups = groups
        self.buckets = buckets
        self.launch = launch
        self.on_param_ready = on_param_ready
        # called on every accumulation into a parameter's .grad, armed or not (stages 0-1 keep .grad a view)
        self.on_accumulated = on_accumulated
        self.active = False
        self.next_to_launch = 0
        self.param_buckets: dict[tuple[int, int], list[int]] = {}
        for bi, bucket in enumerate(buckets):
            for pi in bucket.param_indices:
                self.param_buckets.setdefault((bucket.group_index, pi), []).append(bi)
        # (group, index) of every parameter a backward gave a gradient since the last take_unreceived()
        self.received: set[tuple[int, int]] = set()
        self._hooks: list[Any] = []
        for gi, group in enumerate(groups):
            for pi, p in enumerate(group.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(gi, pi)))

    def _make_hook(self, gi: int, pi: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self.received.add((gi, pi))
            if self.on_accumulated is not None:
                self.on_accumulated(gi, pi)
            # DeepSpeed's ``ds_grad_is_ready`` False: more accumulations into .grad follow in this backward (tiled
            # compute's slices, dsrun/sequence/tiled_compute.py); the bucket counts the parameter at the last one
            if self.active and getattr(param, "ds_grad_is_ready", True):
                self._param_ready(gi, pi)
        return hook

    def start(self) -> None:
        """Arm the hooks for one backward pass."""
        for bucket in self.buckets:
            bucket.pending = len(bucket.param_indices)
            bucket.handles = []
        self.next_to_launch = 0
        self.active = True

    def _param_ready(self, gi: int, pi: int) -> None:
        indices = self.param_buckets.get((gi, pi), [])
        if self.on_param_ready is not None:
            self.on_param_ready(gi, pi, [self.buckets[i] for i in indices])
        for bi in indices:
            self.buckets[bi].pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].pending <= 0:
            self.launch(self.buckets[self.next_to_launch])
            self.next_to_launch += 1

    def take_unreceived(self) -> list[tuple[int, int]]:
        """(group, index) of the parameters no backward gave a gradient since the last call; starts anew."""
        missing = [(gi, pi) for gi, group in enumerate(self.groups) for pi in range(len(group.params))
                   if (gi, pi) not in self.received]
        self.received = set()
        return missing

    def flush(self) -> None:
        """Launch what is left (buckets holding unused parameters) and disarm the hooks."""
        while self.next_to_launch < len(self.buckets):
            self.launch(self.buckets[self.next_to_launch])
            self.next_to_launch += 1
        self.active = False

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class CompilerIntake(NamedTuple):
    """What :meth:`Stage3Strategy.hand_over_to_compiler` gives DeepCompile's handle."""

    queue: Callable[[torch.nn.Parameter, torch.Tensor], None]  # a full gradient into its group's bucket
    launch_pending: Callable[[], None]  # reduce-scatter the buckets still filling
    wait_reduces: Callable[[int], None]  # finish the oldest reductions until at most that many are in flight
    reduces_in_flight: Callable[[], int]


class FlatBufferPool:
    """Flat buffers of finished reduce buckets, reused by the next ones (freshly allocated memory costs a page
    fault per 4 KiB on first touch): ``take`` hands out the smallest kept one that fits (a view of its first
    ``numel`` elements) or a new one, ``give`` keeps a buffer (its base), at most ``keep`` of them (the smallest
    goes first). ``buffers`` are the ones kept now."""

    def __init__(self, dtype: torch.dtype, device: torch.device, keep: int):
        self.dtype, self.device, self.keep = dtype, device, keep
        self.buffers: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``numel`` elements of ``dtype`` (None: the pool's; fp32 for keep_in_fp32_modules' gradients)."""
        dtype = dtype or self.dtype
        fits = [i for i, b in enumerate(self.buffers) if b.numel() >= numel and b.dtype == dtype]
        if fits:
            return self.buffers.pop(min(fits, key=lambda i: self.buffers[i].numel()))[:numel]
        return torch.empty(numel, dtype=dtype, device=self.device)

    def give(self, buffer: torch.Tensor) -> None:
        base = buffer if buffer._base is None else buffer._base
        if all(b is not base for b in self.buffers):
            self.buffers.append(base)
        if len(self.buffers) > self.keep:
            self.buffers.sort(key=torch.Tensor.numel)
            del self.buffers[0]  # the smallest

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
