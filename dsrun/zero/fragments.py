"""One parameter's fp32 master, reduced gradient and optimizer state, wherever its ZeRO strategy keeps them.

A strategy keeps a parameter's training state in flat tensors: a param group's flat master (whole at stage
0, one contiguous partition per rank at stages 1-2) or a sub-group's master, in which each rank holds the
parameter's ``ceil(numel / N)``-element shard (stage 3); with optimizer offload those tensors are on the
host or in swap files. :func:`attach_fragments` gives every trained parameter a :class:`ParamFragment`
(``param._dsrun_fragment``) that knows where this rank's piece of the parameter sits there; DeepSpeed's
``safe_get_full_fp32_param`` and siblings (:mod:`dsrun.utils.tensor_fragment`) call it.

* Getting a *full* value is a collective over the data-parallel group: each rank writes its piece into a
  zero tensor of the full size and one SUM all-reduce assembles it (a value plus zeros is exact).
* Setting a full value (the same on every rank) writes this rank's piece into the master or the optimizer
  state, and the parameter's model copy with it, so the next forward sees the new value at every stage.
* *Local* values are this rank's piece as a flat tensor: the whole parameter at stage 0, the part inside
  this rank's partition at stages 1-2 (possibly empty), the shard with its zero padding at stage 3.
* The gradient is the one the next step applies: averaged over the data-parallel ranks, loss scale removed,
  before clipping. It is complete after the backward of a gradient-accumulation boundary micro-step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dsrun import comm
from dsrun.comm.comm import ProcessGroup
from dsrun.offload.param_swapper import shard_value
from dsrun.utils.tensor_fragment import FRAGMENT_ATTR

from dsrun.zero.base import FlatStrategy, ZeroStrategy
from dsrun.zero.partition_params import ParamStatus, release_param, write_shard

if TYPE_CHECKING:  # stage 3's module is loaded only when stage 3 is chosen
    from dsrun.zero.stage3 import Stage3Strategy, SubGroup

class ParamFragment:
    """Where this rank's piece of one trained parameter lives in its strategy's flat tensors."""

    def __init__(self, strategy: ZeroStrategy, param: torch.nn.Parameter, full_offset: int, length: int,
                 store_offset: int, store_length: int, group: ProcessGroup | None = None,
                 group_size: int | None = None):
        self.strategy = strategy
        self.param = param
        # the ranks the parameter is partitioned over: the data-parallel group, or an MoE expert's
        # expert-data-parallel group (whose ranks hold the same experts)
        self.group = strategy.ctx.group if group is None else group
        self.group_size = strategy.world_size if group_size is None else group_size
        self.full_offset = full_offset  # first element of this rank's piece in the flattened full parameter
        self.length = length  # real elements of the piece
        self.store_offset = store_offset  # where the piece starts in the strategy's flat tensors
        self.store_length = store_length  # elements there (stage 3: the shard, its zero padding included)

    # --- what each layout provides ------------------------------------------------------------------------
    @property
    def full_shape(self) -> torch.Size:
        return self.param.shape

    @property
    def partitioned(self) -> bool:
        return self.group_size > 1

    def _master(self) -> torch.Tensor:
        raise NotImplementedError

    def _grad(self) -> torch.Tensor | None:
        raise NotImplementedError

    def _state(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def _write_state(self, key: str, values: torch.Tensor) -> None:
        self._state(key)[self.store_offset:self.store_offset + values.numel()].copy_(values)

    def _write_master(self, values: torch.Tensor) -> None:
        raise NotImplementedError

    def _write_model(self, values: torch.Tensor, full: torch.Tensor | None) -> None:
        raise NotImplementedError

    # --- shared machinery -----------------------------------------------------------------------------
    def _piece(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.store_offset:self.store_offset + self.length]

    def _gather(self, piece: torch.Tensor) -> torch.Tensor:
        """The full flattened value from every rank's piece (a collective when the state is partitioned)."""
        device = self.strategy.ctx.device
        full = torch.zeros(self.full_shape.numel(), dtype=piece.dtype, device=device)
        full[self.full_offset:self.full_offset + self.length] = piece.to(device)
        if self.partitioned:
            comm.all_reduce(full, group=self.group)
        return full.view(self.full_shape)

    def _check_full(self, value: torch.Tensor) -> torch.Tensor:
        value = torch.as_tensor(value)
        if value.numel() != self.full_shape.numel():
            raise ValueError(f"expected a value of shape {tuple(self.full_shape)} ({self.full_shape.numel()} "
                             f"elements), got {tuple(value.shape)}")
        return value.detach().reshape(-1)

    def _check_local(self, value: torch.Tensor) -> torch.Tensor:
        value = torch.as_tensor(value).detach().reshape(-1)
        if value.numel() != self.store_length_local:
            raise ValueError(f"expected this rank's local piece of {self.store_length_local} elements, got "
                             f"{value.numel()} (see safe_get_local_fp32_param for its size)")
        return value

    @property
    def store_length_local(self) -> int:
        return self.length

    def _grad_scale(self) -> float:
        """Stored gradients are averaged but still multiplied by the loss scale (the step removes it): this
        factor makes them the plain averaged gradient."""
        return 1.0 / self.strategy.precision.loss_scale

    def _state_or_error(self, key: str) -> torch.Tensor:
        state = self._state(key)
        if state is None:
            raise KeyError(f"optimizer state {key!r} of this parameter does not exist (yet): optimizers create "
                           "their state at the first step; states per element here: "
                           f"{sorted(self.state_keys()) or 'none yet'}")
        return state

    def state_keys(self) -> list[str]:
        raise NotImplementedError

    # --- the public operations --------------------------------------------------------------------------
    def full_fp32(self) -> torch.Tensor:
        return self._gather(self._piece(self._master()).float())

    def local_fp32(self) -> torch.Tensor:
        return self._master()[self.store_offset:self.store_offset + self.store_length_local].detach().float().clone()

    def set_full_fp32(self, value: torch.Tensor) -> None:
        flat = self._check_full(value).float()
        with torch.no_grad():
            piece = flat[self.full_offset:self.full_offset + self.length]
            self._write_master(piece)
            self._write_model(piece, flat)

    def set_local_fp32(self, value: torch.Tensor) -> None:
        flat = self._check_local(value).float()
        with torch.no_grad():
            self._write_master(flat[:self.length] if self.length < flat.numel() else flat)
            self._write_model(flat[:self.length], None)

    def full_grad(self) -> torch.Tensor | None:
        grad = self._grad()
        if grad is None:
            return None
        return self._gather(self._piece(grad).float() * self._grad_scale())

    def local_grad(self) -> torch.Tensor | None:
        grad = self._grad()
        if grad is None:
            return None
        piece = grad[self.store_offset:self.store_offset + self.store_length_local]
        return piece.float() * self._grad_scale()

    def set_full_grad(self, value: torch.Tensor) -> None:
        flat = self._check_full(value).float()
        with torch.no_grad():
            self._write_grad(flat[self.full_offset:self.full_offset + self.length])

    def set_local_grad(self, value: torch.Tensor) -> None:
        with torch.no_grad():
            self._write_grad(self._check_local(value).float())

    def _write_grad(self, values: torch.Tensor) -> None:
        """Put this rank's piece of the gradient (plain averaged values) where the next step reads it, as the
        strategy stores it (times the loss scale)."""
        grad = self._grad()
        if grad is None:
            raise ValueError("no gradient to set yet: call safe_set_*_grad after backward and before step()")
        piece = grad[self.store_offset:self.store_offset + values.numel()]
        piece.copy_((values / self._grad_scale()).to(piece.device, piece.dtype))

    def full_optimizer_state(self, key: str) -> torch.Tensor:
        return self._gather(self._piece(self._state_or_error(key)).clone())

    def local_optimizer_state(self, key: str) -> torch.Tensor:
        state = self._state_or_error(key)
        return state[self.store_offset:self.store_offset + self.store_length_local].clone()

    def set_full_optimizer_state(self, value: torch.Tensor, key: str) -> None:
        state = self._state_or_error(key)
        flat = self._check_full(value)
        with torch.no_grad():
            self._write_state(key, flat[self.full_offset:self.full_offset + self.length].to(state.dtype))

    def set_local_optimizer_state(self, value: torch.Tensor, key: str) -> None:
        state = self._state_or_error(key)
        flat = self._check_local(value)
        with torch.no_grad():
            self._write_state(key, flat.to(state.dtype))

    def refresh_master_from_model(self) -> None:
        """Set this rank's master piece from the model's current value of the parameter (after the module's
        weights were loaded from elsewhere)."""
        raise NotImplementedError


class FlatFragment(ParamFragment):
    """Stages 0-2: a range of a flat param group; the master holds the group (stage 0) or this rank's
    partition of it (stages 1-2)."""

    def __init__(self, strategy: FlatStrategy, gi: int, pi: int):
        group = strategy.groups[gi]
        param, off, n = group.params[pi], group.offsets[pi], group.numels[pi]
        # the flat group's own rank and group: an expert's group is its expert-data-parallel group
        lo, hi = group.partition_range(group.rank) if strategy.partitioned else (0, group.padded_numel)
        a, b = max(off, lo), min(off + n, hi)
        length = max(0, b - a)
        super().__init__(strategy, param, full_offset=a - off if length else 0, length=length,
                         store_offset=a - lo if length else 0, store_length=length, group=group.process_group,
                         group_size=group.world_size if strategy.partitioned else 1)
        self.gi = gi
        self.flat_start = a  # this piece in the group's flat model buffer

    def _master(self) -> torch.Tensor:
        return self.strategy.masters[self.gi].detach()

    def _grad(self) -> torch.Tensor | None:
        s = self.strategy
        if s.stage == 0:
            return s.flat_grads[self.gi]
        if s.stage == 1:
            return s.partition_grads[self.gi]
        return s.master_grads[self.gi]

    def _optimizer_state(self) -> dict[str, Any]:
        return self.strategy.optimizer.state.get(self.strategy.masters[self.gi], {})

    def _state(self, key: str) -> torch.Tensor | None:
        value = self._optimizer_state().get(key)
        return value if torch.is_tensor(value) and value.numel() == self._master().numel() else None

    def state_keys(self) -> list[str]:
        return [k for k in self._optimizer_state() if self._state(k) is not None]

    def _write_master(self, values: torch.Tensor) -> None:
        master = self._master()
        master[self.store_offset:self.store_offset + values.numel()].copy_(values.to(master.device))

    def _write_model(self, values: torch.Tensor, full: torch.Tensor | None) -> None:
        if full is not None:  # every rank holds the whole parameter at stages 0-2
            self.param.data.copy_(full.view_as(self.param.data).to(self.param.dtype))
        elif values.numel():  # this rank's piece; the other ranks' copies follow at the next step's gather
            flat_param = self.strategy.groups[self.gi].flat_param
            flat_param[self.flat_start:self.flat_start + values.numel()].copy_(values.to(flat_param.dtype))

    def refresh_master_from_model(self) -> None:
        flat = self.param.data.reshape(-1)
        with torch.no_grad():
            self._write_master(flat[self.full_offset:self.full_offset + self.length].float())


class ShardFragment(ParamFragment):
    """Stage 3: this rank's shard of one parameter, at ``offset`` in a sub-group's master (on the device,
    on the host, or in a swap file with NVMe offload)."""

    def __init__(self, strategy: "Stage3Strategy", index: int, sg: "SubGroup", offset: int,
                 param: torch.nn.Parameter):
        part = param.ds_partition_numel
        group = getattr(param, "ds_process_group", None)  # an MoE expert: its expert-data-parallel group
        rank = comm.get_rank(group) if group is not None else strategy.rank
        size = comm.get_world_size(group) if group is not None else strategy.world_size
        start = rank * part
        length = max(0, min(part, param.ds_numel - start))
        super().__init__(strategy, param, full_offset=start if length else 0, length=length, store_offset=offset,
                         store_length=part, group=group, group_size=size)
        self.index, self.sg = index, sg

    @property
    def full_shape(self) -> torch.Size:
        return torch.Size(self.param.ds_shape)

    @property
    def store_length_local(self) -> int:
        return self.store_length

    def _master(self) -> torch.Tensor:
        return self.sg.store.master_of(self.index, self.sg)

    def _grad(self) -> torch.Tensor | None:
        return self.sg.store.grad_of(self.index, self.sg)

    def _state_dict(self) -> dict[str, Any]:
        return self.sg.store.state_of(self.index, self.sg)

    def _state(self, key: str) -> torch.Tensor | None:
        value = self._state_dict().get(key)
        return value.reshape(-1) if torch.is_tensor(value) and value.numel() == self.sg.numel else None

    def state_keys(self) -> list[str]:
        return [k for k in self._state_dict() if self._state(k) is not None]

    def _write_state(self, key: str, values: torch.Tensor) -> None:
        self.sg.store.write_state(self.index, self.sg, key, self.store_offset, values)

    def _write_grad(self, values: torch.Tensor) -> None:
        self.sg.store.write_grad(self.index, self.sg, self.store_offset, values / self._grad_scale())

    def _shard(self, values: torch.Tensor) -> torch.Tensor:
        shard = torch.zeros(self.store_length, dtype=torch.float32)
        shard[:min(values.numel(), self.store_length)] = values[:self.store_length].cpu()
        return shard

    def _master_device(self) -> torch.device:
        device = self.sg.master.device  # swapped (a meta placeholder): written through host memory
        return torch.device("cpu") if device.type == "meta" else device

    def _write_master(self, values: torch.Tensor) -> None:
        self.param.ds_fp32_shard.copy_(self._shard(values).to(self._master_device()))

    def _write_model(self, values: torch.Tensor, full: torch.Tensor | None) -> None:
        p = self.param
        write_shard(p, self._shard(values).to(device=p.ds_tensor.device, dtype=p.ds_tensor.dtype))
        if p.ds_status is ParamStatus.AVAILABLE:  # a gathered copy is in use: keep it current
            if full is not None:
                p.data.copy_(full.view(self.full_shape).to(p.data.dtype))
            else:  # only this rank's piece is known here: drop the copy, the next use gathers again
                release_param(p)

    def refresh_master_from_model(self) -> None:
        with torch.no_grad():
            self.param.ds_fp32_shard.copy_(shard_value(self.param).detach().float().to(self._master_device()))


def attach_fragments(strategy: ZeroStrategy) -> None:
    """Give every parameter ``strategy`` trains its :class:`ParamFragment` (``param._dsrun_fragment``)."""
    if strategy.stage == 3:
        for index, sg in enumerate(strategy.sub_groups):
            for p, off in zip(sg.params, sg.offsets):
                setattr(p, FRAGMENT_ATTR, ShardFragment(strategy, index, sg, off, p))
    elif isinstance(strategy, FlatStrategy):
        for gi, group in enumerate(strategy.groups):
            for pi, p in enumerate(group.params):
                setattr(p, FRAGMENT_ATTR, FlatFragment(strategy, gi, pi))


def fragment_of(param: torch.Tensor) -> ParamFragment | None:
    return getattr(param, FRAGMENT_ATTR, None)


def refresh_masters_from_model(module: torch.nn.Module) -> None:
    """Set every trained parameter's fp32 master from the model's current weights (e.g. after
    ``load_module_state_dict``), so the next step starts from them."""
    seen: set[int] = set()
    for p in module.parameters():
        fragment = fragment_of(p)
        if fragment is not None and id(p) not in seen:
            seen.add(id(p))
            fragment.refresh_master_from_model()
