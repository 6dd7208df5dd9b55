"""DeepSpeed's ZenFlow selective optimizers, ``deepspeed.ops.adam.ZenFlowSelectiveAdamW`` (ZeRO stages 1-2) and
``ZenFlowSelectiveAdamW_stage3``: AdamW on the selected slices of each parameter only.

ZenFlow (docs/zenflow.md) updates the most important columns of each weight every step and the rest later on
the CPU. DeepSpeed's engine hands these optimizers each parameter's selection as attributes: ``selected_indices``
(which columns), ``selected_grad`` (their gradient), ``temp_selected_param`` (a snapshot of their values to
resume from, optional); with ``offload=True`` the moments live on the host (``exp_avg_cpu_data``,
``exp_avg_sq_cpu_data``) and come to the device per bucket of ``bucket_size`` elements. The stage-1/2 class
selects columns of ``param.data`` ([rows, cols]); the stage-3 class rows of the parameter's partition
``ds_tensor`` laid out transposed (``ds_shape`` = (cols, rows), the slice ``complete_column_offset`` /
``complete_numel``), swapping a partition offloaded to NVMe (``nvme_swapper``) in and out around its update.
dsrun's own ZenFlow is a store of the stage-1/2 host partition (``dsrun/offload/zenflow_store.py``) and does not
use these classes; they serve code written against DeepSpeed's.

The update is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction, ``amsgrad``) on the selected
elements, whose ``state["step"]`` counts the selective steps. One difference: DeepSpeed's stage-1/2 offloaded
step copies a 2-D snapshot into a temporary and so drops it; here it is applied, as its in-memory step does.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch


def _adamw(group: dict, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
           moments: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """torch's single-tensor AdamW on each (selected) tensor, in place."""
    beta1, beta2 = group["betas"]
    lr, eps, decay, amsgrad = group["lr"], group["eps"], group["weight_decay"], group["amsgrad"]
    for param, grad, state, (exp_avg, exp_avg_sq) in zip(params, grads, states, moments):
        grad = grad.to(param.dtype)
        state["step"] += 1
        step = float(state["step"])
        param.mul_(1 - lr * decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        second = exp_avg_sq
        if amsgrad:
            torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
            second = state["max_exp_avg_sq"]
        denom = (second.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


class _SelectiveAdamW(torch.optim.AdamW):
    """What both layouts share: the offload switch, the state, the bucketed offloaded step, the update."""

    def __init__(self, params: Iterable, *args, offload: bool = False, bucket_size: float = 5e8, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.offload = offload
        if offload:
            self.bucket_size = bucket_size
            self.step = self._step_with_offload
        else:
            self.step = self._step_without_offload

    # the layout: a subclass says where a parameter's selected elements are
    def _read(self, param: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _write(self, param: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError

    def _state(self, param: torch.Tensor, selected: torch.Tensor, group: dict) -> dict:
        state = self.state.setdefault(param, {})
        if not state:
            state["step"] = torch.zeros((), dtype=param.dtype, device=selected.device)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(selected)
            if not self.offload:
                state["exp_avg"] = torch.zeros_like(selected)
                state["exp_avg_sq"] = torch.zeros_like(selected)
        return state

    def _moments(self, param: torch.Tensor, state: dict, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.offload:  # brought to the device by copy_mv_from_cpu
            return param.exp_avg.view_as(selected), param.exp_avg_sq.view_as(selected)
        return state["exp_avg"], state["exp_avg_sq"]

    def _update(self, group: dict, params: list[torch.Tensor], apply_snapshot: bool) -> None:
        chosen = [p for p in params if hasattr(p, "selected_grad")]
        selected = [self._read(p) for p in chosen]
        if apply_snapshot:
            for p, sel in zip(chosen, selected):
                if getattr(p, "temp_selected_param", None) is not None:
                    sel.copy_(p.temp_selected_param)
        states = [self._state(p, sel, group) for p, sel in zip(chosen, selected)]
        moments = [self._moments(p, st, sel) for p, st, sel in zip(chosen, states, selected)]
        _adamw(group, selected, [p.selected_grad for p in chosen], states, moments)
        for p, sel in zip(chosen, selected):
            self._write(p, sel)

    def copy_mv_from_cpu(self, params: list[torch.Tensor]) -> None:
        for p in params:
            p.exp_avg = p.exp_avg_cpu_data.to(p.device, non_blocking=True)
            p.exp_avg_sq = p.exp_avg_sq_cpu_data.to(p.device, non_blocking=True)

    def copy_mv_to_cpu(self, params: list[torch.Tensor]) -> None:
        for p in params:
            p.exp_avg_cpu_data.copy_(p.exp_avg.data, non_blocking=True)
            p.exp_avg_sq_cpu_data.copy_(p.exp_avg_sq.data, non_blocking=True)
            p.exp_avg = p.exp_avg_sq = None

    def clear_selected_mv(self) -> None:
        """Zero the selective moments (ZenFlow does it when the selection is refreshed)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                if self.offload:
                    p.exp_avg_cpu_data.zero_()
                    p.exp_avg_sq_cpu_data.zero_()
                else:
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()

    @torch.no_grad()
    def _step_without_offload(self) -> None:
        for group in self.param_groups:
            self._update(group, group["params"], apply_snapshot=True)
            for p in group["params"]:
                if hasattr(p, "temp_selected_param"):
                    p.temp_selected_param = None
                    p.selected_grad = None

    @torch.no_grad()
    def _step_with_offload(self) -> None:
        """The selected parameters in buckets of about ``bucket_size`` elements: each bucket's snapshot applied,
        its moments brought from the host, updated and sent back (``group_step``) before the next."""
        for gi, group in enumerate(self.param_groups):
            bucket: list[torch.Tensor] = []
            numel = 0
            for p in [p for p in group["params"] if hasattr(p, "selected_grad")]:
                bucket.append(p)
                numel += p.numel()
                if numel >= self.bucket_size:
                    self._flush(gi, bucket)
                    bucket, numel = [], 0
            self._flush(gi, bucket)

    def _flush(self, group_index: int, bucket: list[torch.Tensor]) -> None:
        if not bucket:
            return
        for p in bucket:
            if getattr(p, "temp_selected_param", None) is not None and self._resident(p):
                self._write(p, p.temp_selected_param.to(p.device))
                p.temp_selected_param = None
        self._group_step_of(group_index, bucket)

    def _resident(self, param: torch.Tensor) -> bool:
        return True

    def _group_step_of(self, group_index: int, params: list[torch.Tensor]) -> None:
        group = self.param_groups[group_index]
        if self.offload:
            self.copy_mv_from_cpu(params)
        self._update(group, params, apply_snapshot=False)
        if self.offload:
            self.copy_mv_to_cpu(params)
        for p in params:
            p.selected_grad = None


class ZenFlowSelectiveAdamW(_SelectiveAdamW):
    """ZeRO stages 1-2: the selected columns ``param.data[:, selected_indices]`` (a 1-D parameter: all of it)."""

    def _read(self, param: torch.Tensor) -> torch.Tensor:
        return param.data[:, param.selected_indices] if param.dim() != 1 else param.data

    def _write(self, param: torch.Tensor, values: torch.Tensor) -> None:
        if param.dim() != 1:
            param.data[:, param.selected_indices] = values
        elif values is not param.data:
            param.data.copy_(values)

    def temp_copy_param(self, group_to_paramlist: dict[int, list[torch.Tensor]]) -> None:
        """Snapshot each selected parameter's selected values (to the host with ``offload``)."""
        for params in group_to_paramlist.values():
            for p in params:
                if hasattr(p, "selected_grad"):
                    snapshot = self._read(p).clone().detach()
                    p.temp_selected_param = snapshot.cpu() if self.offload else snapshot

    @torch.no_grad()
    def group_step(self, group_to_paramlist: dict[int, list[torch.Tensor]]) -> None:
        for group_index, params in group_to_paramlist.items():
            self._group_step_of(group_index, params)


class ZenFlowSelectiveAdamW_stage3(_SelectiveAdamW):
    """ZeRO-3: the selected rows of the partition ``ds_tensor`` seen as [cols, rows] (module docstring)."""

    @staticmethod
    def _rows_view(param: torch.Tensor) -> torch.Tensor | None:
        """The partition as [columns, rows] (None for a 1-D parameter: the whole partition is selected)."""
        rows = param.ds_shape[1] if len(param.ds_shape) != 1 else 1
        if rows == 1:
            return None
        flat = param.ds_tensor.data.narrow(0, param.complete_column_offset, param.complete_numel)
        return flat.view(param.complete_numel // rows, rows)

    def _read(self, param: torch.Tensor) -> torch.Tensor:
        view = self._rows_view(param)
        device = param.selected_grad.device if getattr(param, "selected_grad", None) is not None else None
        selected = param.ds_tensor.data if view is None else view[param.selected_indices.to(view.device), :]
        return selected.to(device) if device is not None else selected

    def _write(self, param: torch.Tensor, values: torch.Tensor) -> None:
        view = self._rows_view(param)
        if view is None:
            if values is not param.ds_tensor.data:
                param.ds_tensor.data.copy_(values)
        else:
            view[param.selected_indices.to(view.device), :] = values.to(view.device)

    def _resident(self, param: torch.Tensor) -> bool:
        """Whether the partition is where the update runs (not an NVMe placeholder, not on another device)."""
        data = param.ds_tensor.data
        return data.dim() != 0 and data.device == param.selected_grad.device

    def _swap_in(self, param: torch.Tensor) -> bool:
        if param.ds_tensor.data.dim() == 0 and getattr(param, "nvme_swapper", None) is not None:
            param.nvme_swapper.swap_in([param], async_op=False)
            return True
        return False

    def temp_copy_param(self, paramlist: list[torch.Tensor]) -> None:
        """Snapshot the selected rows; an NVMe partition is read in and released without a write-back."""
        for p in paramlist:
            if hasattr(p, "selected_grad"):
                swapped = self._swap_in(p)
                view = self._rows_view(p)
                source = p.ds_tensor.data if view is None else view[p.selected_indices.to(view.device), :]
                snapshot = source.clone().detach()
                p.temp_selected_param = snapshot.cpu() if self.offload else snapshot
                if swapped:
                    p.nvme_swapper.remove_partition_and_release_buffers([p])

    def _one_at_a_time(self, group: dict, params: list[torch.Tensor]) -> None:
        """Offloaded partitions: each swapped in (NVMe), updated with its snapshot, written back, released."""
        for p in [p for p in params if hasattr(p, "selected_grad")]:
            swapped = self._swap_in(p)
            if self.offload:
                self.copy_mv_from_cpu([p])
            self._update(group, [p], apply_snapshot=True)
            if self.offload:
                self.copy_mv_to_cpu([p])
            if swapped:
                p.nvme_swapper.swap_out_and_release([p])
            p.temp_selected_param = None
            p.selected_grad = None

    @torch.no_grad()
    def _step_without_offload(self) -> None:
        for group in self.param_groups:
            if any(hasattr(p, "selected_grad") and not self._resident(p) for p in group["params"]):
                self._one_at_a_time(group, group["params"])
                continue
            self._update(group, group["params"], apply_snapshot=True)
            for p in group["params"]:
                if hasattr(p, "temp_selected_param"):
                    p.temp_selected_param = None
                    p.selected_grad = None

    def _group_step_of(self, group_index: int, params: list[torch.Tensor]) -> None:
        if any(hasattr(p, "selected_grad") and not self._resident(p) for p in params):
            self._one_at_a_time(self.param_groups[group_index], params)
            return
        super()._group_step_of(group_index, params)

    @torch.no_grad()
    def group_step(self, paramlist: list[torch.Tensor]) -> None:
        """Each parameter's ``group_id`` names its param group."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in paramlist:
            by_group.setdefault(p.group_id, []).append(p)
        for group_index in sorted(by_group):
            self._group_step_of(group_index, by_group[group_index])
