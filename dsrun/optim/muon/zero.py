"""Muon under ZeRO: the orthogonalised update is computed on whole matrices, never on flat shards.

ZeRO hands the optimizer flat fp32 partitions (stages 1-2: a contiguous range of a param group laid end to
end; stage 3: every parameter cut in equal shards), and Newton-Schulz needs the matrix. :class:`ZeroMuon` binds
a :class:`~.optimizer.MuonWithAuxAdam` to the strategy stepping it and attaches at ``before_update``
(docs/architecture.md, the step hooks), where the gradients are reduced and the overflow check passed:

1. each Muon matrix's whole gradient is gathered from the partitions (stage 0: it is already whole; stages
   1-2: one all-gather of each Muon param group's gradient partitions; stage 3: one all-gather of the
   parameter's shards), on every rank, and the loss scale removed;
2. matrix ``i`` (in the strategy's order) is computed by rank ``i mod world`` of its data-parallel group
   (DeepSpeed's round-robin assignment at stage 3), which keeps that matrix's whole momentum; it broadcasts
   the update ``muon_update(grad, momentum)``;
3. every rank writes its own part of the update into the gradient the step reads; the optimizer's step then
   applies ``p *= 1 - lr * wd; p -= lr * update`` on the flat masters.

Clipping (``gradient_clipping``) follows DeepSpeed, whose ZeRO stages replace a Muon matrix's gradient by its
update before the global norm is measured: the norm is that of the Adam parameters' gradients and the Muon
updates together, and one coefficient clips both. dsrun feeds Muon the unscaled gradient (DeepSpeed feeds
the fp16 loss-scaled one), so a dynamic loss scale changes nothing but overflow skips.

The momentum buffers differ per rank (each rank keeps its own matrices'): they are the strategy's per-rank
optimizer state, ``optimizer_rank_states_<r>.pt``, re-cut by matrix name when the world size changes.

ZeRO-3 with NVMe optimizer offload (ZeRO-Infinity): a sub-group's gradient is in its swap file at the step, so
step 1 reads each Muon sub-group's gradient into one of the store's buffers, and step 3 writes the updates back
to that file, which the swapped step then reads (:meth:`~dsrun.offload.nvme.SwappedOptimizerState.
gradient_in_memory`); the step applies them tile by tile (``MuonWithAuxAdam.update_tile``). The momentum of a
matrix whose sub-group is swapped lives in that store's files too (``muon_momentum.<name>``, read in for its
update and written back), unless ``zero_optimization.save_muon_momentum_buffer_in_memory`` keeps it in memory
(DeepSpeed's key; everywhere else the momentum is in memory whatever it says, as in DeepSpeed).
"""
from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch

from dsrun import comm
from dsrun.optim.rank_state import RangeRead, read_in_memory, read_whole
from dsrun.utils.errors import ConfigError, Problem

from .newton_schulz import muon_update

BEFORE_UPDATE = "before_update"  # dsrun.zero.step_hooks' point (a layer above: named, not imported)
MOMENTUM_FILE = "muon_momentum.{name}"  # a swapped matrix's momentum in its sub-group's swap store


class MuonStrategy(Protocol):
    """What the binding reads of a ZeRO strategy (``dsrun.zero.base.ZeroStrategy``)."""

    optimizer: torch.optim.Optimizer
    ctx: Any  # StrategyContext: module, precision, group, gradient_clipping
    hooks: Any  # StepHooks

    def step_gradients(self) -> list[torch.Tensor]: ...


@dataclass
class Matrix:
    """One Muon parameter as the binding sees it."""

    name: str
    shape: torch.Size
    numel: int
    group: dict[str, Any]  # its optimizer param group (momentum, ns_method)
    process_group: Any  # the data-parallel group its partitions live on (None: the world)
    expert: bool = False
    owner: int = 0  # the rank in process_group that computes it
    files: Any = None  # the swap store (dsrun.offload.swap_store.SwapStore) its momentum lives in; None: memory

    def owned(self) -> bool:
        return comm.get_rank(self.process_group) == self.owner

    @property
    def momentum_key(self) -> str:
        return MOMENTUM_FILE.format(name=self.name)


class _Flat:
    """Stages 0-2: matrix ``k`` of Muon param group ``gi`` is ``[offset, offset + numel)`` of the flat group;
    at stages 1-2 this rank holds ``partition_range(rank)`` of it."""

    def __init__(self, strategy: Any, names: dict[int, str]):
        self.strategy = strategy
        self.partitioned = bool(getattr(strategy, "partitioned", False))
        self.entries: list[tuple[Matrix, int, int]] = []  # (matrix, group index, offset)
        for gi, flat in enumerate(strategy.groups):
            group = strategy.optimizer.param_groups[gi]
            if group.get("use_muon"):
                for p, off in zip(flat.params, flat.offsets):
                    self.entries.append((Matrix(names[id(p)], p.shape, p.numel(), group, flat.process_group,
                                                getattr(p, "is_expert_group", False)), gi, off))

    def matrices(self) -> Iterator[tuple[Matrix, torch.Tensor, Callable[[torch.Tensor], None]]]:
        grads = self.strategy.step_gradients()
        whole: dict[int, torch.Tensor] = {}
        for matrix, gi, off in self.entries:
            flat, local = self.strategy.groups[gi], grads[gi]
            if gi not in whole:
                whole[gi] = local
                if self.partitioned and flat.world_size > 1:
                    whole[gi] = torch.empty(flat.padded_numel, dtype=local.dtype, device=local.device)
                    comm.all_gather_into_tensor(whole[gi], local, group=flat.process_group)
            start = flat.partition_range(flat.rank)[0] if self.partitioned else 0
            yield matrix, whole[gi][off:off + matrix.numel].view(matrix.shape), self._writer(local, start, off,
                                                                                              matrix.numel)

    @staticmethod
    def _writer(local: torch.Tensor, start: int, off: int, numel: int) -> Callable[[torch.Tensor], None]:
        lo, hi = max(off, start), min(off + numel, start + local.numel())

        def write(update: torch.Tensor) -> None:
            if lo < hi:
                local[lo - start:hi - start].copy_(update.reshape(-1)[lo - off:hi - off])
        return write


class _Shards:
    """Stage 3: each Muon parameter's gradient shard is ``[offset, offset + ds_partition_numel)`` of its
    sub-group's gradient, rank r's piece of the parameter's flat ``[r * P, (r + 1) * P)``. The sub-group's store
    hands the gradient over (an NVMe store reads it from its file and writes back what the binding left), one
    sub-group at a time; a swapped sub-group's matrices keep their momentum in its files unless
    ``momentum_in_memory``."""

    def __init__(self, strategy: Any, names: dict[int, str], momentum_in_memory: bool):
        self.device = strategy.ctx.device  # where the matrices are computed (an NVMe store's gradient is on the host)
        self.entries: list[tuple[Matrix, Any, Any, int]] = []  # (matrix, sub-group, param, offset)
        for sg in strategy.sub_groups:
            group = strategy.optimizer.param_groups[sg.group_index]
            if not group.get("use_muon"):
                continue
            if sg.store.steps_during_backward:
                raise ConfigError(Problem("zero_optimization.offload_optimizer.super_offload", "steps sub-groups "
                                          "during backward, before Muon's whole-matrix updates exist (they need "
                                          "every rank's gradient of each matrix)", "leave super_offload false"))
            files = None if momentum_in_memory else sg.store.swap_files
            for p, off in zip(sg.params, sg.offsets):
                self.entries.append((Matrix(names[id(p)], p.ds_shape, p.ds_numel, group, p.ds_process_group,
                                            getattr(p, "is_expert_group", False), files=files), sg, p, off))

    def matrices(self) -> Iterator[tuple[Matrix, torch.Tensor, Callable[[torch.Tensor], None]]]:
        for _, entries in itertools.groupby(self.entries, key=lambda entry: id(entry[1])):
            entries = list(entries)
            sg = entries[0][1]
            with sg.store.gradient_in_memory(sg.index, sg) as grad:
                for matrix, _, p, off in entries:
                    part = p.ds_partition_numel
                    local = grad[off:off + part]
                    world = comm.get_world_size(matrix.process_group)
                    whole = on_device = local.to(self.device)
                    if world > 1:
                        whole = torch.empty(part * world, dtype=local.dtype, device=self.device)
                        comm.all_gather_into_tensor(whole, on_device, group=matrix.process_group)
                    start = comm.get_rank(matrix.process_group) * part
                    yield matrix, whole[:matrix.numel].view(matrix.shape), _Flat._writer(local, start, 0,
                                                                                          matrix.numel)


class ZeroMuon:
    """A :class:`MuonWithAuxAdam` bound to the ZeRO strategy that steps it (see the module docstring)."""

    def __init__(self, strategy: MuonStrategy, momentum_in_memory: bool = False):
        self.strategy = strategy
        names = {id(p): n for n, p in strategy.ctx.module.named_parameters()}
        self.layout = (_Shards(strategy, names, momentum_in_memory) if hasattr(strategy, "sub_groups")
                       else _Flat(strategy, names))
        counts: dict[int, int] = {}
        for matrix in self.matrix_list():
            key = id(matrix.process_group)
            matrix.owner = counts.get(key, 0) % comm.get_world_size(matrix.process_group)
            counts[key] = counts.get(key, 0) + 1
        # name -> whole-matrix fp32 momentum of the matrices this rank owns, those in memory (Matrix.files None)
        self.momentum: dict[str, torch.Tensor] = {}
        self.last_update_sq_norm = 0.0  # the Muon updates' squared norm at the last step (the feature's metric)
        strategy.optimizer.binding = self
        self.handle = strategy.hooks.add(BEFORE_UPDATE, self.before_update)

    def matrix_list(self) -> list[Matrix]:
        return [entry[0] for entry in self.layout.entries]

    def before_update(self, state: Any) -> None:
        loss_scale = float(self.strategy.ctx.precision.loss_scale)
        grad_sq = update_sq = 0.0
        for matrix, whole, write in self.layout.matrices():
            grad = whole.float() / loss_scale  # a new tensor: muon_update overwrites its input
            grad_sq += float(grad.double().square().sum())
            if matrix.owned():
                with self._momentum(matrix, grad) as momentum:
                    update = muon_update(grad, momentum, beta=matrix.group["momentum"],
                                         ns_method=matrix.group["ns_method"], is_expert_group=matrix.expert).float()
            else:
                update = torch.empty_like(grad)
            if comm.get_world_size(matrix.process_group) > 1:
                comm.broadcast(update, src=comm.get_global_rank(matrix.process_group, matrix.owner),
                               group=matrix.process_group)
            update_sq += float(update.double().square().sum())
            write(update * loss_scale)  # the step multiplies every gradient by state.coef, 1 / loss scale first
        if self.strategy.ctx.pipelined:  # the stages hold different matrices: their squares add up
            squares = torch.tensor([grad_sq, update_sq], dtype=torch.float64, device=self.strategy.ctx.device)
            comm.all_reduce(squares, group=self.strategy.ctx.groups.pipe)
            grad_sq, update_sq = float(squares[0]), float(squares[1])
        self.last_update_sq_norm = update_sq
        if state.grad_norm is not None:  # clipping: the norm over Adam's gradients and Muon's updates
            clipping = float(self.strategy.ctx.gradient_clipping)
            norm = math.sqrt(max(0.0, state.grad_norm ** 2 - grad_sq) + update_sq)
            state.coef = min(1.0, clipping / (norm + 1e-6)) / loss_scale
            state.grad_norm = norm

    @contextmanager
    def _momentum(self, matrix: Matrix, like: torch.Tensor) -> Iterator[torch.Tensor]:
        """``matrix``'s momentum (zeros at first) to update in place: the tensor in memory, or one read from its
        swap file and written back after the update."""
        if matrix.files is None:
            yield self.momentum.setdefault(matrix.name, torch.zeros_like(like))
            return
        key = matrix.momentum_key
        host = matrix.files.read(key) if key in matrix.files else torch.zeros(like.numel(), dtype=torch.float32)
        momentum = host.view(like.shape).to(like.device)
        yield momentum
        matrix.files.write(key, momentum.reshape(-1).cpu())

    def momentum_bytes(self) -> int:
        """Bytes of momentum this rank holds in memory (the swapped matrices' are in their swap files)."""
        return sum(t.numel() * t.element_size() for t in self.momentum.values())

    # --- per-rank optimizer state ---------------------------------------------------------------------------
    def rank_state_dict(self) -> dict[str, Any]:
        momentum = {name: t.detach().cpu().clone() for name, t in self.momentum.items()}
        for m in self.matrix_list():  # swapped: mapped from the file, paged in as the checkpoint writes it
            if m.files is not None and m.owned() and m.momentum_key in m.files:
                momentum[m.name] = m.files.mapped(m.momentum_key).view(m.shape)
        return {"muon_momentum": momentum}

    def load_rank_state_dicts(self, states: list[dict[str, Any]], read: RangeRead = read_in_memory) -> None:
        """This rank's own saved state, or every saved rank's (a different world size): the momentum of the
        matrices this rank now owns, by name (only those read, through ``read``)."""
        saved: dict[str, torch.Tensor] = {}
        for state in states:
            saved.update(state.get("muon_momentum", {}))
        device = self.strategy.ctx.device
        self.momentum = {}
        for m in self.matrix_list():
            if not m.owned():
                continue
            if m.files is None:
                if m.name in saved:
                    self.momentum[m.name] = read_whole(read, saved[m.name]).to(device=device, dtype=torch.float32)
            elif m.name in saved:
                m.files.write(m.momentum_key, read_whole(read, saved[m.name]).float().reshape(-1).contiguous())
            elif m.momentum_key in m.files:
                m.files.delete(m.momentum_key)

    def close(self) -> None:
        self.handle.remove()
        self.strategy.optimizer.binding = None
