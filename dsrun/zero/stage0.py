"""ZeRO stage 0: plain data parallelism with bucketed gradient all-reduce.

Every rank holds the full model, gradients and optimizer state. Gradients accumulate locally over the
micro-steps of one optimizer step (in a flat buffer the parameters' ``.grad`` point into, whatever the user
does to ``.grad`` in between: :class:`~.layout.FlatGradients`); on the boundary
micro-step each bucket of ``reduce_bucket_size`` elements is all-reduced as soon as backward has produced
all of its gradients (``overlap_comm``: asynchronously, while backward continues), else all buckets are
all-reduced after backward.

With ``sparse_gradients`` every embedding's weight (``torch.nn.Embedding``/``EmbeddingBag``) is reduced as
DeepSpeed's sparse all-reduce does, at this stage only (where DeepSpeed reads the key): each rank sends the rows
of its gradient that hold values (their indices and the rows, gathered from every rank) instead of the whole
table, and adds up what it received; the sum is the dense all-reduce's (:func:`reduce_rows`).
"""
from __future__ import annotations

from typing import Any

import torch

from dsrun import comm

from dsrun.zero.base import FlatStrategy
from dsrun.zero.memory import MemoryBreakdown, optimizer_state_bytes, tensor_bytes
from dsrun.zero.buckets import Bucket
from dsrun.zero.layout import FlatGradients


class DataParallelStrategy(FlatStrategy):
    stage = 0
    supports_local_gradients = True

    def _build_buffers(self) -> None:
        self.grads = FlatGradients(self.groups)
        self.flat_grads = self.grads.flats
        self.row_sparse = self._row_sparse_params()

    def _row_sparse_params(self) -> set[tuple[int, int]]:
        """``sparse_gradients``: (group, index) of every embedding weight, reduced as the rows holding values."""
        if not self.ctx.config.sparse_gradients:
            return set()
        weights = {id(m.weight) for m in self.ctx.module.modules()
                   if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}
        return {(gi, pi) for gi, group in enumerate(self.groups) for pi, p in enumerate(group.params)
                if id(p) in weights}

    def _row_sparse_pieces(self, bucket: Bucket) -> list[tuple[int, int, int]]:
        """(start, end, row width) of the row-sparse parameters' pieces in ``bucket`` (relative to its start);
        a piece that does not start and end on a row boundary is reduced element by element."""
        group, pieces = self.groups[bucket.group_index], []
        for pi in bucket.param_indices:
            if (bucket.group_index, pi) in self.row_sparse:
                offset, numel = group.offsets[pi], group.numels[pi]
                lo, hi = max(bucket.start, offset), min(bucket.end, offset + numel)
                width = group.params[pi].shape[-1]
                if (lo - offset) % width or (hi - lo) % width:
                    width = 1
                pieces.append((lo - bucket.start, hi - bucket.start, width))
        return pieces

    def _on_accumulated(self, gi: int, pi: int) -> None:
        self.grads.adopt(gi, pi)

    def local_gradients(self) -> list[torch.Tensor]:
        return self.flat_grads

    def _build_masters(self) -> list[torch.nn.Parameter]:
        if not self.precision.needs_master_weights:
            # fp32: the optimizer steps the model's own flat buffer; nothing to copy back
            self.master_grads = self.flat_grads
            masters = [torch.nn.Parameter(g.flat_param, requires_grad=True) for g in self.groups]
        else:
            self.master_grads = [torch.zeros(g.padded_numel, dtype=torch.float32, device=self.ctx.device)
                                 for g in self.groups]
            masters = [torch.nn.Parameter(g.flat_param.detach().float().clone()) for g in self.groups]
        for master, g in zip(masters, self.groups):  # where each model tensor lies (per-tensor rules: LAMB)
            master.ds_tensor_segments = list(zip(g.offsets, g.numels))
        return masters

    def _reduce(self, bucket: Bucket, async_op: bool) -> None:
        if bucket.pending > 0:  # parameters this backward did not reach: their .grad may have been replaced
            for pi in bucket.param_indices:
                self.grads.adopt(bucket.group_index, pi)
        grad = self.flat_grads[bucket.group_index][bucket.start:bucket.end]
        self._divide_before_reduce(grad)
        group = self.groups[bucket.group_index]
        if group.world_size == 1:
            return
        for lo, hi, width in self._row_sparse_pieces(bucket):  # sparse_gradients: the rows holding values
            reduce_rows(grad[lo:hi].view(-1, width), group.process_group)
        runs = self._comm_dtype_runs(bucket)
        if runs is not None:  # torch_autocast: the safe modules' gradients go in the autocast dtype
            for lo, hi, dtype in runs:
                piece = grad[lo:hi].to(dtype) if dtype != grad.dtype else grad[lo:hi]
                bucket.handles.append(comm.all_reduce(piece, group=group.process_group, async_op=async_op))
                bucket.staged_runs.append((lo, piece))
        elif (comm_dtype := self._comm_dtype_of(group)) != grad.dtype:
            bucket.staging = grad.to(comm_dtype)
            bucket.handles.append(comm.all_reduce(bucket.staging, group=group.process_group, async_op=async_op))
        else:
            bucket.handles.append(comm.all_reduce(grad, group=group.process_group, async_op=async_op))

    def _complete(self, bucket: Bucket) -> None:
        for handle in bucket.handles:
            if handle is not None:
                handle.wait()
        bucket.handles = []
        if bucket.staging is not None:
            self.flat_grads[bucket.group_index][bucket.start:bucket.end].copy_(bucket.staging)
            bucket.staging = None
        grad = self.flat_grads[bucket.group_index][bucket.start:bucket.end]
        for lo, piece in bucket.staged_runs:
            if piece.dtype != grad.dtype:
                grad[lo:lo + piece.numel()].copy_(piece)
        bucket.staged_runs = []
        self.averaging.after(grad)

    def _comm_dtype_runs(self, bucket: Bucket) -> list[tuple[int, int, torch.dtype]] | None:
        """(start, end, dtype) pieces of ``bucket`` (relative to its start) when some of its parameters carry
        their own ``comm_dtype`` (torch_autocast's safe modules) or are reduced as sparse rows (left out here),
        else None. Padding is left out (zeros)."""
        group = self.groups[bucket.group_index]
        params = [group.params[pi] for pi in bucket.param_indices]
        sparse = {pi for pi in bucket.param_indices if (bucket.group_index, pi) in self.row_sparse}
        if not sparse and not any(hasattr(p, "comm_dtype") for p in params):
            return None
        runs: list[tuple[int, int, torch.dtype]] = []
        for pi, param in zip(bucket.param_indices, params):
            if pi in sparse:
                continue
            lo = max(bucket.start, group.offsets[pi]) - bucket.start
            hi = min(bucket.end, group.offsets[pi] + group.numels[pi]) - bucket.start
            dtype = getattr(param, "comm_dtype", self._comm_dtype_of(group))  # kept fp32 groups: fp32
            if runs and runs[-1][1] == lo and runs[-1][2] == dtype:
                runs[-1] = (runs[-1][0], hi, dtype)
            else:
                runs.append((lo, hi, dtype))
        return runs

    def _master_grads(self) -> list[torch.Tensor]:
        if self.master_grads is self.flat_grads:
            return self.flat_grads
        for master_grad, flat_grad in zip(self.master_grads, self.flat_grads):
            master_grad.copy_(flat_grad)
        return self.master_grads

    def _publish(self) -> None:
        if self.precision.needs_master_weights:
            with torch.no_grad():
                for group, master in zip(self.groups, self.masters):
                    group.flat_param.copy_(master)

    def zero_grad(self) -> None:
        self.grads.zero()

    def memory_breakdown(self) -> MemoryBreakdown:
        grads = sum(tensor_bytes(g) for g in self.flat_grads)
        if self.master_grads is not self.flat_grads:
            grads += sum(tensor_bytes(g) for g in self.master_grads)
        return MemoryBreakdown(parameters=self._param_bytes(), gradients=grads, master_weights=self._master_bytes(),
                               optimizer_states=optimizer_state_bytes(self.optimizer),
                               padding=self._padding_bytes())


def reduce_rows(rows: torch.Tensor, group: Any) -> None:
    """Sum the 2-D ``rows`` over ``group`` in place, moving only the rows that hold values (DeepSpeed's sparse
    all-reduce): every rank gathers every rank's row indices and those rows, then adds them up in rank order."""
    index = rows.ne(0).any(dim=1).nonzero().flatten()
    count = torch.tensor([index.numel()], dtype=torch.long, device=rows.device)
    counts = [torch.zeros_like(count) for _ in range(comm.get_world_size(group))]
    comm.all_gather(counts, count, group=group)
    most = max(int(c.item()) for c in counts)
    sent_index = torch.zeros(most, dtype=torch.long, device=rows.device)
    sent_rows = rows.new_zeros(most, rows.shape[1])
    sent_index[:index.numel()] = index
    sent_rows[:index.numel()] = rows.index_select(0, index)
    indices = [torch.empty_like(sent_index) for _ in counts]
    values = [torch.empty_like(sent_rows) for _ in counts]
    comm.all_gather(indices, sent_index, group=group)
    comm.all_gather(values, sent_rows, group=group)
    rows.zero_()
    for n, got_index, got_rows in zip(counts, indices, values):
        rows.index_add_(0, got_index[:int(n.item())], got_rows[:int(n.item())])
