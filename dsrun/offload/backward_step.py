"""``offload_optimizer.super_offload`` on NVMe: each swapped sub-group stepped during backward.

Without it the NVMe step runs after backward, sub-group after sub-group: read master, gradient and states,
update, write back, with the disk idle for most of backward. With it, on the boundary micro-step, a sub-group
is stepped the moment its gradient is final (the reduce of the last module touching it: every parameter's
reduced shard has arrived), inside backward, as DeepSpeed's SuperOffload steps its CPU sub-groups:

* the gradient is the open fp32 buffer itself: it is never written to ``grad.i`` nor read back (4 bytes per
  parameter less through the files with a 16-bit model);
* the master and states of the sub-group expected to close next (the order the last boundary closed them in)
  are read ahead (one sub-group at a time), and each stepped sub-group's writes drain behind, while backward
  computes; all from the same ``buffer_count`` pool, two of whose buffers are left to the gradients;
* the updated 16-bit shards go to the parameter files straight from the step's staging buffer (no copy
  through the parameter pool, whose buffers hold backward's read-ahead).

The update is the same call on the same values as the step's (:meth:`.nvme.SwappedOptimizerState.step`):
bit-identical. It is exact only when the step would not scale the gradient: no gradient clipping, no loss
scaling (the config refuses ``super_offload`` with either), no ``before_update`` hook changing the coefficient
(checked at ``step()``), and the param groups' hyperparameters unchanged between backward and ``step()``
(checked; a change is an error, not a silent difference). A sub-group that finds no buffers free closes as
without it (its gradient written) and is stepped by ``step()``; so is one no backward reached.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

# publish(index, values) writes a stepped sub-group's values into the model's shards without copying them
# through the parameter pool, and returns the parameter offloads whose writes still read ``values``
Publish = Callable[[int, torch.Tensor], "set[Any]"]


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings as they are now (a tensor ``lr`` copied: a scheduler may change it in place)."""
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in group.items() if k != "params"}


def _changed(used: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The settings that differ between two :func:`_hyperparameters`."""
    def same(a: object, b: object) -> bool:
        if torch.is_tensor(a) or torch.is_tensor(b):
            return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
        return a == b

    return sorted(k for k in set(used) | set(now) if not same(used.get(k), now.get(k)))


class BackwardSteps:
    """The sub-groups of one :class:`~.nvme.SwappedOptimizerState` (``state``, which owns this object: typed
    ``Any`` so the two modules do not import each other) stepped during backward."""

    GRADIENT_BUFFERS = 2  # left to backward: a gradient kept open across it (a tied embedding's) and the filling one

    def __init__(self, state: Any, param_group: Callable[[int], dict[str, Any]], publish: Publish):
        self.state, self.param_group, self.publish = state, param_group, publish
        self.width = 1 + len(state.state_keys)  # master + states
        self.enabled = state.settings.buffer_count >= self.GRADIENT_BUFFERS + self.width
        self.active = False  # this backward is the boundary's: its final gradients step
        self.order: list[int] = []  # the order the last boundary's gradients closed in
        self._closing: list[int] = []
        self.stepped: dict[int, dict[str, Any]] = {}  # sub-group -> the hyperparameters it stepped with
        self._ahead: dict[int, list[torch.Tensor]] = {}  # sub-group -> its (master, states) buffers being read
        self._writing: list[list[torch.Tensor]] = []  # buffer sets whose writes are in flight
        self._borrowers: set[Any] = set()  # parameter offloads writing from a staging (or master) buffer
        self._staging_busy = [False, False]
        self._next_staging = 0
        self.read_ahead_hits = 0  # sub-groups whose state had been read ahead when their gradient became final
        # the last boundary backward's seconds inside these steps: updating, blocked on reads, on writes
        self.times = {"compute": 0.0, "waiting_reads": 0.0, "waiting_writes": 0.0}

    # ------------------------------------------------------------------ backward
    def begin(self, boundary: bool) -> None:
        if self.stepped:
            raise RuntimeError("offload_optimizer.super_offload: a second boundary backward before step(); the "
                               "first one's sub-groups were already stepped during backward (call engine.step() "
                               "after each boundary backward, or leave super_offload off)")
        self.active = boundary and self.enabled
        self._closing = []
        if self.active:
            self.times = dict.fromkeys(self.times, 0.0)
            self._read_ahead(keep=self.GRADIENT_BUFFERS)

    def closed(self, index: int) -> None:
        """Sub-group ``index``'s gradient is final on the boundary (stepped or not)."""
        self._closing.append(index)

    def try_step(self, index: int, grad_buffer: torch.Tensor) -> bool:
        """Step sub-group ``index`` now with its final gradient in ``grad_buffer`` (fp32, given back to the pool
        here); False when it must go the usual way (not the boundary, no buffers free)."""
        if not self.active:
            return False
        state = self.state
        buffers = self._ahead.pop(index, None)
        self.read_ahead_hits += buffers is not None
        if buffers is None:
            buffers = self._take(self.width, keep=0)
            if buffers is None:
                return False
            self._read(index, buffers)
        t = time.perf_counter()
        state.store.wait_reads()
        self.times["waiting_reads"] += time.perf_counter() - t
        self._read_ahead(keep=0)  # the next one's reads run under this update and the backward after it
        unit = state._unit_by_index[index]
        n = unit.numel
        master, states = buffers[0][:n], {name: state.as_state(b, n) for name, b in zip(state.state_keys, buffers[1:])}
        low = self._staging_buffer(n)
        group = self.param_group(unit.group_index)
        state.steps[index] += 1
        t = time.perf_counter()
        state.optimizer.update_tile(group, master, grad_buffer[:n], states, state.steps[index], low_precision=low)
        self._borrowers |= self.publish(index, low if low is not None else master)
        self.times["compute"] += time.perf_counter() - t
        self.stepped[index] = _hyperparameters(group)
        state.pool.give(grad_buffer)
        key = state._key("grad", index)
        if key in state.store:  # earlier micro-steps' sum, now added in: not the step's to read
            state.store.delete(key, keep_blocks=True)
        state.store.async_write(state._key("master", index), master)
        for name, values in states.items():
            state.store.async_write(state._key(name, index), values)
        self._writing.append(buffers)
        return True

    def give_up_read_ahead(self) -> bool:
        """Backward needs a buffer for a gradient: return the read-ahead's; False when there is none."""
        if not self._ahead:
            return False
        self.state.store.wait_reads()
        for buffers in self._ahead.values():
            for b in buffers:
                self.state.pool.give(b)
        self._ahead = {}
        return True

    # ------------------------------------------------------------------ step()
    def finish(self, coef: float) -> set[int]:
        """At ``step()``: every write landed, buffers back in the pool; returns the sub-groups already stepped
        (and forgets them). Refuses a step whose coefficient or hyperparameters differ from what they used."""
        self.give_up_read_ahead()
        self._drain()
        self.active = False
        if self._closing:
            self.order = self._closing
        stepped, self.stepped = self.stepped, {}
        if stepped and coef != 1.0:
            raise RuntimeError(f"offload_optimizer.super_offload: {len(stepped)} sub-group(s) were stepped during "
                               f"backward, but step() scales the gradients by {coef} (a step hook changed the "
                               "coefficient); leave super_offload off with such hooks")
        for index, used in stepped.items():
            changed = _changed(used, _hyperparameters(self.param_group(self.state._unit_by_index[index].group_index)))
            if changed:
                raise RuntimeError(f"offload_optimizer.super_offload: the param group's {', '.join(changed)} changed "
                                   "between backward and step(); sub-groups already stepped with the old values "
                                   "during backward (change them before backward, or leave super_offload off)")
        return set(stepped)

    def holds_gradient_of(self, index: int) -> bool:
        """Was ``index`` stepped during this backward (its gradient consumed, never written)?"""
        return index in self.stepped

    # ------------------------------------------------------------------ buffers and reads
    def _take(self, count: int, keep: int) -> list[torch.Tensor] | None:
        """``count`` pool buffers, leaving ``keep`` obtainable for backward's gradients; writes that hold
        buffers are waited for first. None when the pool cannot spare them."""
        pool = self.state.pool
        if pool.available() < count + keep:
            self._drain()
            self.state.recycle()
        if pool.available() < count + keep:
            return None
        return [pool.take() for _ in range(count)]

    def _drain(self) -> None:
        t = time.perf_counter()
        self._settle_borrowed()  # an fp32 model's shards are written from the master buffers
        if self._writing:
            self.state.store.wait_writes()
            for buffers in self._writing:
                for b in buffers:
                    self.state.pool.give(b)
            self._writing = []
        self.times["waiting_writes"] += time.perf_counter() - t

    def _settle_borrowed(self) -> None:
        for owner in self._borrowers:
            owner.settle_borrowed()
        self._borrowers = set()
        self._staging_busy = [False, False]

    def _read(self, index: int, buffers: list[torch.Tensor]) -> None:
        state = self.state
        n = state._unit_by_index[index].numel
        state.store.async_read(state._key("master", index), buffers[0][:n], lane=0)
        for lane, (name, buffer) in enumerate(zip(state.state_keys, buffers[1:]), start=2):
            target, key = state.as_state(buffer, n), state._key(name, index)
            if key in state.store:
                state.store.async_read(key, target, lane=lane)
            else:
                target.zero_()  # fast_init: the states start as zeros at the first step

    def _read_ahead(self, keep: int) -> None:
        """Start reading the next sub-group the last boundary closed (not stepped, not being read) when the
        pool can spare a set of buffers."""
        if self._ahead:
            return
        for index in self.order:
            if index not in self.stepped and index not in self._closing:
                buffers = self._take(self.width, keep)
                if buffers is not None:
                    self._read(index, buffers)
                    self._ahead[index] = buffers
                return

    def _staging_buffer(self, numel: int) -> torch.Tensor | None:
        """One of two 16-bit buffers the update writes its rounded copy into (None: an fp32 model), taken in
        turn; parameter writes still reading the one given out two updates ago are waited for first."""
        dtype = self.state.model_dtype
        if dtype == torch.float32:
            return None
        staging = self.state._staging  # the step's own staging buffers (it has at least two slots with us)
        while len(staging) < 2:
            staging.append(self.state.store.aligned_buffer(self.state.pool.numel, dtype))
        if self._borrowers and self._staging_busy[self._next_staging]:
            self._settle_borrowed()
        buffer = staging[self._next_staging][:numel]
        self._staging_busy[self._next_staging] = True
        self._next_staging = 1 - self._next_staging
        return buffer
