"""ZenFlow's placement of the offloaded update (stages 1-2, ``offload_optimizer.device: cpu``): the important
gradient columns are updated at once, the rest accumulate and are applied by the CPU optimizer every
``update_interval`` steps, in the background with ``overlap_step``.

:class:`ZenFlowStore` wraps the :class:`~dsrun.offload.flat_store.HostFlatStore` the strategy built (masters,
optimizer states and fp32 gradient buffers stay where they were) and replaces its ``update``:

1. **Selection** (at the first step after ``full_warm_up_rounds``, then every ``select_interval`` steps, at the
   next window start): each 2-D parameter's column importance is the sum of ``|gradient|`` over its rows
   (this rank's fragment, all-reduced over the data-parallel group so every rank picks the same columns); its
   ``int(topk_ratio * columns)`` most important columns are *selected*. 1-D parameters (biases, norms) are
   always selected, as in DeepSpeed.
2. **Every step**, the selected elements are updated by the training thread with the same compiled CPU Adam
   (``update_tile``) on compact copies: their fp32 weights and moments (the moments and step count continue
   from the CPU optimizer's at selection and go back to it at the next selection), and written into the model.
3. The step's whole gradient (times the step's coefficient) is **accumulated** in an fp32 host buffer. When
   the window is full (``update_interval`` steps; with ``"auto"``: when the unselected columns' accumulated
   mass has caught up, below) the CPU optimizer steps the masters once on the window's mean gradient with the
   selected elements' gradients zeroed, and the selected elements keep the values of step 2. With
   ``overlap_step`` that update runs on a worker thread pinned to the optimizer's cores
   (:mod:`~dsrun.offload.cores`) while the next step's forward and backward run, and is published at that
   step's update.

**Staleness.** A gradient computed at step t reaches the unselected columns by the end of step
``t + update_interval - 1`` (``t + update_interval`` with ``overlap_step``): :attr:`max_staleness` is the
largest (published step - oldest gradient's step) seen. Selected columns see every gradient at once. With
``update_interval: "auto"`` a window never exceeds :data:`AUTO_MAX_INTERVAL` steps.

The pending window (accumulated gradients, the selection and its moments, an update computed but not yet
published) is checkpoint state (:meth:`state_entries`), so a resumed run continues bit-exactly.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from dsrun import comm
from dsrun.offload.cores import PinnedWorker, process_cores, split_cores
from dsrun.offload.flat_store import HostFlatStore
from dsrun.offload.pipeline import PipelineTimes, StepPipeline, tiled_cpu_step

AUTO_MAX_INTERVAL = 16  # an "auto" window is closed after this many steps whatever the trigger says


@dataclass(frozen=True)
class Fragment:
    """One parameter of a flat group as this rank's partition holds it: partition-local elements [a, b) are
    the parameter's elements from ``param_start`` on (a == b: none here); ``cols`` columns per row (0: a
    1-D parameter, always selected). Every parameter of the group has one, on every rank, in group order."""

    a: int
    b: int
    param_start: int
    cols: int


@dataclass(frozen=True)
class ZenFlowSettings:
    topk_ratio: float
    select_interval: int  # steps between selections; 0: select once
    update_interval: int  # steps per window; 0: "auto"
    auto_ratio: float
    full_warm_up_rounds: int
    overlap_step: bool
    training_core_share: float  # pt_reserved_cores_perc, or 1 - cpuadam_cores_perc


@dataclass
class _Selection:
    idx: torch.Tensor  # int64 partition-local element indices, sorted
    weights: torch.Tensor  # fp32 values of those elements (the masters' are stale while an update runs)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int


class ZenFlowStore:
    """ZenFlow's update over an offloaded flat partition (see the module docstring); everything else is the
    wrapped :class:`HostFlatStore`'s."""

    def __init__(self, inner: HostFlatStore, layouts: list[list[Fragment]], process_groups: list[Any],
                 settings: ZenFlowSettings):
        if inner.cpu_optimizer is None or not hasattr(inner.cpu_optimizer, "adamw_mode"):
            raise ValueError("ZenFlow steps with DeepSpeedCPUAdam (optimizer Adam or AdamW)")
        self.inner, self.layouts, self.process_groups, self.settings = inner, layouts, process_groups, settings
        self.cpu_optimizer = inner.cpu_optimizer
        self.acc = [torch.zeros(p.numel(), dtype=torch.float32) for p in inner.partitions]
        self._spare: list[torch.Tensor] | None = None  # the other window's buffers (overlap_step)
        self.selection: list[_Selection | None] = [None] * len(self.acc)
        self.steps = 0  # ZenFlow steps taken (optimizer steps that reached the update)
        self.pending = 0  # steps accumulated in the open window
        self.window_start = 0  # the step of the open window's oldest gradient
        self.last_selection: int | None = None
        self.everything_selected = False
        self.max_staleness = 0
        self.cpu_updates = 0
        self._job: Future | None = None
        self._job_oldest = 0
        self._unpublished: int | None = None  # oldest gradient step of an update in the masters, not the model
        self._auto_crit: torch.Tensor | None = None
        self._auto_rest: torch.Tensor | None = None
        self._saved_partitions: list[torch.Tensor] | None = None  # the model's partitions a checkpoint held
        self._pipeline = StepPipeline(overlap=False)  # the job's tiles, all on the thread that runs it
        self.worker = (PinnedWorker(split_cores(process_cores(), settings.training_core_share))
                       if settings.overlap_step else None)
        self.times = PipelineTimes()

    def __getattr__(self, name: str) -> Any:  # the wrapped store's buffers and methods
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # --- the step -----------------------------------------------------------------------------------------
    def update(self, optimizer: torch.optim.Optimizer, masters: list[torch.nn.Parameter],
               grads: list[torch.Tensor], coef: float) -> None:
        start = time.perf_counter()
        t = self.steps
        if t < self.settings.full_warm_up_rounds:  # full updates first, as plain offload
            self.inner.update(optimizer, masters, grads, coef)
            self.steps += 1
            return
        grads = [g if g.device.type == "cpu" else g.to("cpu") for g in grads]  # on CUDA: the host reads them
        self._finish_job(masters)  # overlap_step: the last window's update, computed during this forward/backward
        if self._unpublished is not None:
            self._publish_masters(masters)
        if self.pending == 0 and self._selection_due(t):
            self._select(grads, masters)
        for gi, group in enumerate(optimizer.param_groups):
            self._selective_update(group, gi, grads[gi], coef, masters[gi])
        if not self.everything_selected:
            if self.pending == 0:
                self.window_start = t
            for acc, g in zip(self.acc, grads):
                acc.add_(g, alpha=coef)
            self.pending += 1
            if self._window_full(grads, coef):
                self._submit(optimizer, masters)
        self.steps += 1
        self.times = PipelineTimes(total=time.perf_counter() - start, units=len(grads))

    def _selection_due(self, t: int) -> bool:
        if self.last_selection is None:
            return True
        interval = self.settings.select_interval
        return interval > 0 and t - self.last_selection >= interval

    def _select(self, grads: list[torch.Tensor], masters: list[torch.nn.Parameter]) -> None:
        everything = True
        for gi, (layout, g) in enumerate(zip(self.layouts, grads)):
            old = self.selection[gi]
            state = self.cpu_optimizer.state_for(masters[gi])
            if old is not None:  # the columns leaving selection continue from their own moments
                state["exp_avg"].index_copy_(0, old.idx, old.exp_avg)
                state["exp_avg_sq"].index_copy_(0, old.idx, old.exp_avg_sq)
            idx = self._selected_elements(layout, g, self.process_groups[gi])
            everything = everything and idx.numel() == sum(f.b - f.a for f in layout)  # padding is never selected
            master = masters[gi].detach()
            self.selection[gi] = _Selection(idx, master.index_select(0, idx), state["exp_avg"].index_select(0, idx),
                                            state["exp_avg_sq"].index_select(0, idx), int(state["step"]))
        self.everything_selected = everything
        self.last_selection = self.steps

    def _selected_elements(self, layout: list[Fragment], g: torch.Tensor, group: Any) -> torch.Tensor:
        """Partition-local indices of the selected elements (the same columns on every rank)."""
        matrices = [f for f in layout if f.cols]
        scores = torch.zeros(sum(f.cols for f in matrices), dtype=torch.float32)
        offsets, at = [], 0
        for f in matrices:
            offsets.append(at)
            if f.b > f.a:
                cols = torch.arange(f.param_start, f.param_start + f.b - f.a) % f.cols
                scores[at:at + f.cols].index_add_(0, cols, g[f.a:f.b].float().abs())
            at += f.cols
        if comm.get_world_size(group) > 1:
            comm.all_reduce(scores, group=group)
        picked = []
        for f in layout:
            if f.b <= f.a:
                continue
            if not f.cols:
                picked.append(torch.arange(f.a, f.b))
                continue
            at = offsets[matrices.index(f)]
            mask = torch.zeros(f.cols, dtype=torch.bool)
            k = int(self.settings.topk_ratio * f.cols)
            if k:
                mask[torch.topk(scores[at:at + f.cols], k).indices] = True
            cols = torch.arange(f.param_start, f.param_start + f.b - f.a) % f.cols
            picked.append(f.a + torch.nonzero(mask[cols]).flatten())
        return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.int64)

    def _selective_update(self, group: dict, gi: int, g: torch.Tensor, coef: float,
                          master: torch.nn.Parameter) -> None:
        sel = self.selection[gi]
        if sel is None or sel.idx.numel() == 0:
            return
        grad = g.index_select(0, sel.idx).float()
        if coef != 1.0:
            grad.mul_(coef)
        sel.step += 1
        self.cpu_optimizer.update_tile(group, sel.weights, grad, {"exp_avg": sel.exp_avg,
                                                                  "exp_avg_sq": sel.exp_avg_sq}, sel.step)
        part = self.inner.partitions[gi]
        part.index_copy_(0, sel.idx.to(part.device), sel.weights.to(part.device, part.dtype))
        if self._job is None:  # a running update owns the masters; they get these values when it is published
            master.detach().index_copy_(0, sel.idx, sel.weights)

    def _window_full(self, grads: list[torch.Tensor], coef: float) -> bool:
        interval = self.settings.update_interval
        if interval:
            return self.pending >= interval
        return self._auto_trigger(grads, coef) or self.pending >= AUTO_MAX_INTERVAL

    def _auto_trigger(self, grads: list[torch.Tensor], coef: float) -> bool:
        """``update_interval: "auto"``: close the window once, for ``auto_ratio`` of the 2-D parameters, the
        unselected columns' |gradient| accumulated since the last update (per column share, 1 - topk_ratio)
        has caught up with one step's |gradient| of the selected columns (per column share, topk_ratio)."""
        crit, rest = [], []
        for gi, (layout, g) in enumerate(zip(self.layouts, grads)):
            sel = self.selection[gi]
            chosen = torch.zeros(g.numel(), dtype=torch.bool)
            if sel is not None:
                chosen[sel.idx] = True
            mass = g.float().abs().mul_(abs(coef))
            for f in layout:
                if f.cols:
                    part, keep = mass[f.a:f.b], chosen[f.a:f.b]
                    crit.append(part[keep].sum())
                    rest.append(part[~keep].sum())
        if not crit:
            return True
        sums = torch.stack([torch.stack(crit), torch.stack(rest)])
        if comm.get_world_size(self.process_groups[0]) > 1:
            comm.all_reduce(sums, group=self.process_groups[0])
        if self.pending == 1 or self._auto_crit is None:
            self._auto_crit, self._auto_rest = torch.zeros_like(sums[0]), torch.zeros_like(sums[1])
        self._auto_crit += sums[0]
        self._auto_rest += sums[1]
        k = self.settings.topk_ratio
        per_step_crit = self._auto_crit / self.pending / max(k, 1e-12)
        caught_up = (self._auto_rest / max(1.0 - k, 1e-12) >= per_step_crit).sum().item()
        return caught_up >= int(self.settings.auto_ratio * sums.shape[1])

    def _submit(self, optimizer: torch.optim.Optimizer, masters: list[torch.nn.Parameter]) -> None:
        window = self.acc
        for gi, acc in enumerate(window):
            acc.mul_(1.0 / self.pending)
            sel = self.selection[gi]
            if sel is not None:
                acc.index_fill_(0, sel.idx, 0.0)
        self.acc = self._spare if self._spare is not None else [torch.zeros_like(a) for a in window]
        self._spare = None
        oldest, self.pending = self.window_start, 0
        jobs = [(optimizer.param_groups[gi], master) for gi, master in enumerate(masters)]
        tile = self.inner.tile

        def run() -> list[torch.Tensor]:
            tiled_cpu_step(self._pipeline, self.cpu_optimizer, jobs, tile, lambda u, gi, a, b: window[gi][a:b])
            for acc in window:
                acc.zero_()
            return window

        self.cpu_updates += 1
        if self.worker is None:
            self._spare = run()
            self._settle(masters, oldest)
            self._publish_masters(masters)
        else:
            self._job, self._job_oldest = self.worker.submit(run), oldest

    def wait(self) -> None:
        """Wait for an update running in the background (it is still published at the next step's update)."""
        self._finish_job([m for _, m in self._last_jobs()])

    def _finish_job(self, masters: list[torch.nn.Parameter]) -> None:
        if self._job is None:
            return
        self._spare = self._job.result()
        self._job = None
        self._settle(masters, self._job_oldest)

    def _settle(self, masters: list[torch.nn.Parameter], oldest: int) -> None:
        """An update reached the masters: the selected elements keep their own values there."""
        for master, sel in zip(masters, self.selection):
            if sel is not None:
                master.detach().index_copy_(0, sel.idx, sel.weights)
        self._unpublished = oldest

    def _publish_masters(self, masters: list[torch.nn.Parameter]) -> None:
        with torch.no_grad():
            for part, master in zip(self.inner.partitions, masters):
                part.copy_(master.detach())
        self.max_staleness = max(self.max_staleness, self.steps - self._unpublished)
        self._unpublished = None

    # --- checkpoints ----------------------------------------------------------------------------------------
    def state_entries(self) -> dict[str, Any]:
        """The pending window, the selection and an update not yet in the model (finished first)."""
        self.wait()
        state = {"steps": self.steps, "pending": self.pending, "window_start": self.window_start,
                 "last_selection": self.last_selection, "everything_selected": self.everything_selected,
                 "max_staleness": self.max_staleness, "cpu_updates": self.cpu_updates,
                 "accumulated": [a.clone() for a in self.acc], "unpublished": self._unpublished,
                 "selection": [None if s is None else {"idx": s.idx.clone(), "weights": s.weights.clone(),
                                                       "exp_avg": s.exp_avg.clone(),
                                                       "exp_avg_sq": s.exp_avg_sq.clone(), "step": s.step}
                               for s in self.selection],
                 "auto": None if self._auto_crit is None else [self._auto_crit.clone(), self._auto_rest.clone()]}
        if self._unpublished is not None:  # the model still holds the weights before that update
            state["model_partitions"] = [p.clone() for p in self.inner.partitions]
        return {"zenflow": state}

    def _last_jobs(self) -> list[tuple[dict, torch.nn.Parameter]]:
        return [(g, g["params"][0]) for g in self.cpu_optimizer.param_groups]

    def load_state_entries(self, sd: dict[str, Any]) -> None:
        state = sd.get("zenflow")
        self.wait()
        if state is None:  # saved without ZenFlow: it starts afresh from the loaded masters
            for acc in self.acc:
                acc.zero_()
            self.selection = [None] * len(self.acc)
            self.pending, self.last_selection, self.everything_selected, self._unpublished = 0, None, False, None
            self._auto_crit = self._auto_rest = self._saved_partitions = None
            return
        for acc, saved in zip(self.acc, state["accumulated"]):
            if acc.numel() != saved.numel():
                raise ValueError("ZenFlow's pending gradients were saved with another partition layout")
            acc.copy_(saved)
        for key in ("steps", "pending", "window_start", "last_selection", "everything_selected", "max_staleness",
                    "cpu_updates"):
            setattr(self, key, state[key])
        self._unpublished = state["unpublished"]
        self.selection = [None if s is None else _Selection(s["idx"].clone(), s["weights"].clone(),
                                                            s["exp_avg"].clone(), s["exp_avg_sq"].clone(),
                                                            int(s["step"])) for s in state["selection"]]
        auto = state["auto"]
        self._auto_crit, self._auto_rest = (None, None) if auto is None else (auto[0].clone(), auto[1].clone())
        self._saved_partitions = state.get("model_partitions")

    def loaded(self, masters: list[torch.nn.Parameter]) -> None:
        saved = self._saved_partitions
        with torch.no_grad():
            for gi, (part, master) in enumerate(zip(self.inner.partitions, masters)):
                part.copy_(saved[gi] if saved is not None else master.detach())
        self._saved_partitions = None

    def close(self) -> None:
        if self._job is not None:
            self._job.result()
            self._job = None
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        self._pipeline.close()
        self.inner.close()

    # --- accounting -----------------------------------------------------------------------------------------
    def extra_bytes(self) -> int:
        """Host bytes ZenFlow adds: the window buffers and the selected elements' weights, moments, indices."""
        buffers = sum(a.numel() * 4 for a in self.acc) * (2 if self.worker is not None else 1)
        chosen = sum(s.idx.numel() for s in self.selection if s is not None)
        return buffers + chosen * (3 * 4 + 8)


def staleness_bound(update_interval: int, overlap_step: bool) -> int:
    """The most steps between a gradient and the step whose update publishes it to an unselected column."""
    interval = update_interval or AUTO_MAX_INTERVAL
    return interval if overlap_step else interval - 1


def topk_columns(cols: int, topk_ratio: float) -> int:
    """How many of a 2-D parameter's ``cols`` columns are selected."""
    return int(topk_ratio * cols) if cols else 0


def selected_fraction(shapes: list[torch.Size], topk_ratio: float) -> float:
    """The share of elements ZenFlow updates every step for parameters of ``shapes`` (1-D ones always)."""
    total = sum(math.prod(s) for s in shapes) or 1
    chosen = sum(math.prod(s) if len(s) < 2 else s[0] * topk_columns(math.prod(s[1:]), topk_ratio) for s in shapes)
    return chosen / total
