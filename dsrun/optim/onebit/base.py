"""What 1-bit Adam, 0/1 Adam and 1-bit LAMB share: binding to the engine's ZeRO strategy, the compressed
exchange and its error buffers, ``exp_avg_mask``, the backward-reduction switch, and the rank state that
checkpoints carry.

**Binding.** The engine builds its ZeRO strategy (stage 0 or 1, no optimizer offload) and calls
:meth:`OneBitOptimizer.bind_strategy` (through ``OneBitFeature``, an engine feature). From then on each
param group is one flat fp32 master (this rank's partition at stage 1), and the optimizer:

* attaches at the strategy's ``before_update`` hook, where it notes the step's coefficient (loss scale, clip)
  and each rank's whole local gradient (``state.local_gradients()``, what the worker side compresses at
  stage 1), and at ``after_update``, where it sets ``strategy.enable_backward_allreduce`` for the next step:
  off once compression starts, so backward all-reduces nothing;
* exchanges with :class:`dsrun.comm.compressed.CompressedAllreduce` over the data-parallel group, one call
  per master, whose chunks are the ZeRO-1 partitions at stage 1 (rank r serves exactly the part it updates).

**Rank state.** The worker error differs on every rank and the server error is per chunk, so neither fits the
replicated optimizer state DeepSpeed saves (which is why DeepSpeed resets them on every load). Both are
returned by :meth:`rank_state_dict`, which the checkpoint writes once per data-parallel rank, and restored by
:meth:`load_rank_state_dicts` exactly (same world size) or re-cut for another world size: worker errors
become their mean over the saved ranks on every new rank (the total the servers still owe is kept), server
errors are laid end to end and split into the new chunks. Elements are matched by parameter name, so the
param-group layout may change too.

Unbound (``torch.optim``-style use outside ``dsrun.initialize``) the optimizer runs on a single process
only, where DeepSpeed's also skips compression; with more ranks it refuses to step.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from dsrun import comm
from dsrun.comm.comm import ProcessGroup
from dsrun.optim.rank_state import RangeRead, mean_into, read_in_memory, read_whole
from dsrun.comm.compressed import CompressedBackend, CompressedLayout, CompressedResult, check_backend_name
from dsrun.utils.errors import ConfigError, Problem, show
from dsrun.utils.zero_to_fp32 import Slot, master_slots
from dsrun.utils.dynamo_free import DynamoFreeOptimizer

PARAMS = "optimizer.params"


class StepView(Protocol):
    """What the 1-bit optimizers read of a step hook's state (``dsrun.zero.step_hooks.StepState``)."""

    coef: float

    @property
    def reduced(self) -> bool: ...

    def local_gradients(self) -> list[torch.Tensor] | None: ...


class _StrategyContext(Protocol):
    group: ProcessGroup
    device: torch.device


class _StepHooks(Protocol):
    def add(self, point: str, fn: Callable[[StepView], None]) -> object: ...


class BoundStrategy(Protocol):
    """What the 1-bit optimizers read of the ZeRO strategy they bind to (``dsrun.zero.base.ZeroStrategy``,
    stages 0-1): its layout, its group and step hooks, and DeepSpeed's backward-reduction switch."""

    stage: int
    world_size: int
    rank: int
    ctx: _StrategyContext
    hooks: _StepHooks
    supports_local_gradients: bool
    enable_backward_allreduce: bool
    param_alignment_paddings: list[list[int]] | None

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def checkpoint_param_shapes(self) -> list["OrderedDict[str, torch.Size]"]: ...


def require(condition: bool, key: str, message: str, hint: str = "") -> None:
    if not condition:
        raise ConfigError(Problem(f"{PARAMS}.{key}", message, hint))


def check_common(lr: float, betas: Any, eps: float, weight_decay: float, max_grad_norm: float, amsgrad: bool,
                 name: str) -> tuple[float, float]:
    """The Adam/LAMB arguments every 1-bit optimizer takes; returns the betas."""
    require(not amsgrad, "amsgrad", f"got True; {name} has no AMSGrad variant (as in DeepSpeed)", "remove it")
    require(not max_grad_norm, "max_grad_norm", f"got {show(max_grad_norm)}; {name} does not clip by itself",
            "clip with the top-level \"gradient_clipping\" instead")
    require(lr >= 0, "lr", f"got {show(lr)}; expected >= 0")
    require(eps >= 0 and weight_decay >= 0, "eps" if eps < 0 else "weight_decay", "expected >= 0")
    require(isinstance(betas, (list, tuple)) and len(betas) == 2 and all(0 <= b < 1 for b in betas), "betas",
            f"got {show(betas)}; expected two numbers in [0, 1)")
    return float(betas[0]), float(betas[1])


def check_step_count(value: Any, key: str, minimum: int = 1) -> int:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, key,
            f"got {show(value)}; expected an integer >= {minimum}")
    return int(value)


@dataclass
class MasterLayout:
    """One master tensor's place in its flat group: the parameters' shapes, their elements in this master
    (``own``: this rank's partition at stage 1) and in the whole group (``full``) as checkpoint slots, the
    group's trainable elements (``numel``), the master's length, and the compressed exchange's layout."""

    shapes: "OrderedDict[str, torch.Size]"
    own: list[Slot]
    full: list[Slot]
    numel: int
    master_numel: int
    compressed: CompressedLayout


class OneBitOptimizer(DynamoFreeOptimizer):
    """Base of the 1-bit family (module docstring). Subclasses implement :meth:`step`."""

    supported_stages: tuple[int, ...] = (0, 1)

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], deepspeed: Any = None,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl"):
        super().__init__(params, defaults)
        self.deepspeed = deepspeed
        self.cuda_aware = bool(cuda_aware)
        self.comm_backend_name = check_backend_name(comm_backend_name)
        self.strategy: BoundStrategy | None = None
        self.layouts: list[MasterLayout] = []
        self.worker_errors: list[torch.Tensor | None] = []
        self.server_errors: list[torch.Tensor | None] = []
        self._backend: CompressedBackend | None = None
        self._masks: list[torch.Tensor | None] = []  # exp_avg_mask per master (this rank's elements)
        self._full_masks: list[torch.Tensor | None] = []  # ... over the whole flat group (stage 1's worker side)
        self._coef = 1.0
        self._local: list[torch.Tensor] | None = None
        self._announced = False
        if self.cuda_aware and comm.get_rank() == 0:
            # DeepSpeed's flag for a CUDA-aware MPI; dsrun hands device tensors to torch.distributed directly
            print(f"[dsrun] note: {type(self).__name__}: cuda_aware has no effect in dsrun: the compressed "
                  "all-reduce runs over torch.distributed, which takes device tensors as they are (NCCL on "
                  "CUDA, gloo on the CPU)", flush=True)

    # --- binding ----------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        if self.strategy is not None:
            return self.strategy.world_size
        return comm.get_world_size() if comm.is_initialized() else 1

    @property
    def stage(self) -> int:
        return self.strategy.stage if self.strategy is not None else 0

    def bind_strategy(self, strategy: BoundStrategy) -> None:
        """Attach to the engine's ZeRO strategy (called once, after the strategy flattened the groups)."""
        name = type(self).__name__
        if strategy.stage not in self.supported_stages or not strategy.supports_local_gradients:
            stages = " or ".join(str(s) for s in self.supported_stages)
            raise ConfigError(Problem("zero_optimization.stage", f"{name} runs at ZeRO stage {stages} without "
                                      f"optimizer offload (got stage {strategy.stage}"
                                      f"{', offloaded' if strategy.stage in self.supported_stages else ''})",
                                      f"set zero_optimization.stage to {stages}; docs/onebit.md says why"))
        if strategy.param_alignment_paddings is not None:  # its compressed buffers lay the parameters end to end
            raise ConfigError(Problem("zero_optimization.parameter_alignment", f"{name} lays the parameters end to "
                                      "end; the key leaves gaps between them", "leave parameter_alignment false"))
        self.strategy = strategy
        world, rank = strategy.world_size, strategy.rank
        shapes = strategy.checkpoint_param_shapes()
        own, _ = master_slots(strategy.stage, world, rank, shapes)
        full, _ = master_slots(0, world, rank, shapes)
        self._backend = CompressedBackend(strategy.ctx.group, device=strategy.ctx.device)
        self.layouts = []
        for gi, group in enumerate(self.param_groups):
            master = group["params"][0]
            numel = sum(s.length for s in full[gi])
            # stage 1: chunk r is rank r's partition; stage 0: the master is the whole group
            compressed = (self._backend.layout(numel, chunk=master.numel()) if strategy.stage == 1
                          else self._backend.layout(master.numel()))
            self.layouts.append(MasterLayout(shapes[gi], own[gi], full[gi], numel, master.numel(), compressed))
        self.worker_errors = [None] * len(self.param_groups)
        self.server_errors = [None] * len(self.param_groups)
        self._full_masks = [self._flat_mask(gi, group) for gi, group in enumerate(self.param_groups)]
        self._masks = [None if m is None else self.own_slice(gi, m) for gi, m in enumerate(self._full_masks)]
        strategy.hooks.add("before_update", self._before_update)
        strategy.hooks.add("after_update", self._after_update)
        self._apply_switch()

    def _flat_mask(self, gi: int, group: dict[str, Any]) -> torch.Tensor | None:
        """``exp_avg_mask`` as one flat fp32 vector over the group's trainable elements, in their order."""
        mask = group.get("exp_avg_mask")
        if mask is None:
            return None
        layout = self.layouts[gi]
        if not torch.is_tensor(mask) or mask.numel() != layout.numel:
            raise ConfigError(Problem(f"param_groups[{gi}]['exp_avg_mask']",
                                      f"has {mask.numel() if torch.is_tensor(mask) else show(mask)} elements; the "
                                      f"group's trainable parameters have {layout.numel}",
                                      "give one mask element per parameter element, in the group's order"))
        return mask.detach().reshape(-1).to(device=group["params"][0].device, dtype=torch.float32)

    def own_slice(self, gi: int, full: torch.Tensor) -> torch.Tensor:
        """The master-shaped piece (this rank's partition at stage 1) of a vector over the whole flat group
        (``layout.numel`` elements or more); padding reads as 0."""
        layout = self.layouts[gi]
        lo = self.strategy.rank * layout.master_numel if self.stage == 1 else 0
        out = torch.zeros(layout.master_numel, dtype=full.dtype, device=full.device)
        n = max(0, min(layout.master_numel, min(full.numel(), layout.numel) - lo))
        out[:n] = full[lo:lo + n]
        return out

    def mask(self, gi: int, tensor: torch.Tensor) -> torch.Tensor:
        """Zero ``tensor`` (master-shaped) where ``exp_avg_mask`` is 0 (unbound: the param's own mask)."""
        if self.strategy is not None:
            mask = self._masks[gi]
        else:
            mask = self.param_groups[gi].get("exp_avg_mask")
            mask = None if mask is None else mask.to(device=tensor.device, dtype=tensor.dtype).reshape(tensor.shape)
        return tensor if mask is None else tensor.mul_(mask)

    def mask_full(self, gi: int, tensor: torch.Tensor) -> torch.Tensor:
        """Zero a whole-group vector (``layout.numel`` elements) where ``exp_avg_mask`` is 0."""
        mask = self._full_masks[gi] if self.strategy is not None else None
        return tensor if mask is None else tensor.mul_(mask)

    def gather_full(self, gi: int, own: torch.Tensor) -> torch.Tensor:
        """Every rank's master-shaped piece of master ``gi`` laid end to end (``layout.numel`` elements), one
        fp32 all-gather (stage 1; at stage 0 the master already is the whole group)."""
        layout = self.layouts[gi]
        if self.stage == 0:
            return own.float().clone()
        out = torch.empty(layout.master_numel * self.world_size, dtype=torch.float32, device=own.device)
        comm.all_gather_into_tensor(out, own.float().contiguous(), group=self.strategy.ctx.group)
        return out[:layout.numel]

    def _before_update(self, state: StepView) -> None:
        self._coef = state.coef
        self._local = None if state.reduced else state.local_gradients()

    def _after_update(self, state: StepView) -> None:
        self._apply_switch()

    def _apply_switch(self) -> None:
        if self.strategy is None or self.strategy.world_size == 1:
            return
        reduce = self.reduce_next_step()
        if not reduce and not self._announced and comm.get_rank() == 0:
            print(f"[dsrun] {type(self).__name__}: {self.phase_note()}", flush=True)
            self._announced = True
        self.strategy.enable_backward_allreduce = reduce

    # --- what subclasses define -------------------------------------------------------------------------
    def steps_taken(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    return int(self.state[p]["step"])
        return 0

    def reduce_next_step(self) -> bool:
        """Whether the next step's gradients are all-reduced in backward."""
        raise NotImplementedError

    def phase_note(self) -> str:
        return "compressed communication starts"

    # --- the step's shared parts ------------------------------------------------------------------------
    def begin_step(self, closure: Any = None) -> Any:
        """Run ``closure`` (gradients on) and check the optimizer can step; returns the closure's loss or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_can_step()
        return loss

    def moment_state(self, p: torch.Tensor, **extra: Any) -> dict[str, Any]:
        """``p``'s state, created on first use: step 0, ``extra``, and fp32 first and second moments."""
        state = self.state[p]
        if not state:
            state.update(step=0, **extra)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        return state

    # --- the exchange -----------------------------------------------------------------------------------
    def check_can_step(self) -> None:
        if self.strategy is None and self.world_size > 1:
            raise RuntimeError(f"{type(self).__name__} communicates by itself: pass it to dsrun.initialize "
                               "(optimizer=...), which binds it to the engine's data-parallel group")

    def errors(self, gi: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layouts[gi].compressed
        if self.worker_errors[gi] is None:
            self.worker_errors[gi] = torch.zeros(layout.numel, dtype=torch.float32, device=device)
            self.server_errors[gi] = torch.zeros(layout.chunk, dtype=torch.float32, device=device)
        return self.worker_errors[gi], self.server_errors[gi]

    def exchange(self, gi: int, x: torch.Tensor) -> CompressedResult:
        """The compressed mean over ranks of ``x`` (this master's whole flat group, fp32)."""
        layout = self.layouts[gi].compressed
        engine = self._backend.engine(layout.numel, layout.chunk if self.stage == 1 else None, device=x.device)
        worker, server = self.errors(gi, x.device)
        return engine(x[:layout.numel], worker, server)

    def own_part(self, gi: int, result: CompressedResult) -> torch.Tensor:
        """This rank's master-shaped piece of an exchanged vector."""
        if self.stage == 1:
            return result.own_chunk
        return result.decode()

    def full_local_gradient(self, gi: int, p: torch.Tensor) -> torch.Tensor:
        """This rank's whole unreduced gradient of master ``gi`` times the step's coefficient (fp32): at
        stage 0 the master's own gradient; at stage 1 the flat local gradient the hook noted."""
        if self.stage == 0 or self._local is None:
            return p.grad
        return self._local[gi].float().mul_(self._coef)

    # --- checkpoints -----------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As DeepSpeed: the live ``exp_avg_mask`` is kept (a mask may change between runs), never the saved one."""
        state_dict = {**state_dict, "param_groups": [dict(g) for g in state_dict["param_groups"]]}
        for live, saved in zip(self.param_groups, state_dict["param_groups"]):
            saved.pop("exp_avg_mask", None)
            if "exp_avg_mask" in live:
                saved["exp_avg_mask"] = live["exp_avg_mask"]
        super().load_state_dict(state_dict)
        self.after_load()
        self._apply_switch()

    def after_load(self) -> None:
        """Drop what was derived from the state before the load (subclasses)."""

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's error buffers and whatever else differs per rank (subclasses add to it)."""
        return {"optimizer": type(self).__name__, "world_size": self.world_size,
                "rank": self.strategy.rank if self.strategy is not None else 0,
                "param_shapes": [layout.shapes for layout in self.layouts],
                "chunks": [layout.compressed.chunk for layout in self.layouts],
                "worker_errors": [None if e is None else e.detach().cpu().clone() for e in self.worker_errors],
                "server_errors": [None if e is None else e.detach().cpu().clone() for e in self.server_errors]}

    def load_rank_state_dicts(self, states: list[dict[str, Any]], read: RangeRead = read_in_memory) -> None:
        """Restore :meth:`rank_state_dict`: ``states`` is this rank's own (same world size and layout) or every
        saved rank's in rank order (re-cut as the module docstring says), their tensors read through ``read``
        (:mod:`dsrun.optim.rank_state`: a re-cut reads only the elements this rank keeps). Empty: errors start
        at zero."""
        self.worker_errors = [None] * len(self.layouts)
        self.server_errors = [None] * len(self.layouts)
        states = [s for s in states if s.get("optimizer") == type(self).__name__]
        exact = bool(states) and self.exact_match(states)
        if exact:
            for gi in range(len(self.layouts)):
                device = self.param_groups[gi]["params"][0].device
                if states[0]["worker_errors"][gi] is not None:
                    self.worker_errors[gi] = read_whole(read, states[0]["worker_errors"][gi]).to(device)
                    self.server_errors[gi] = read_whole(read, states[0]["server_errors"][gi]).to(device)
        elif states and len(states) == states[0]["world_size"]:
            places = saved_places(states)
            rank = self.strategy.rank if self.strategy is not None else 0
            for gi, layout in enumerate(self.layouts):
                if not places:
                    break
                device = self.param_groups[gi]["params"][0].device
                worker, server = recut_errors(states, places, layout.shapes, layout.compressed, rank, read)
                self.worker_errors[gi], self.server_errors[gi] = worker.to(device), server.to(device)
        self.load_rank_extras(states, exact, read)

    def exact_match(self, states: list[dict[str, Any]]) -> bool:
        """Whether ``states`` is this rank's own, saved with this world size and master layout."""
        own = states[0]
        rank = self.strategy.rank if self.strategy is not None else 0
        return (len(states) == 1 and own["world_size"] == self.world_size and own["rank"] == rank
                and [list(s.items()) for s in own["param_shapes"]] == [list(l.shapes.items()) for l in self.layouts]
                and own["chunks"] == [l.compressed.chunk for l in self.layouts])

    def load_rank_extras(self, states: list[dict[str, Any]], exact: bool, read: RangeRead) -> None:
        """Subclasses restore their own rank state here (tensors through ``read``)."""


def shape_numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


def saved_places(states: list[dict[str, Any]]) -> dict[str, tuple[int, int, int]]:
    """Where each parameter's errors are in the saved ranks' flat groups: ``{name: (group, offset, numel)}``,
    for the groups every saved rank has errors of (parameters end to end, as stages 0-1 lay them out)."""
    places = {}
    for k, shapes in enumerate(states[0]["param_shapes"]):
        if any(s["worker_errors"][k] is None for s in states):
            continue
        offset = 0
        for name, shape in shapes.items():
            places[name] = (k, offset, shape_numel(shape))
            offset += shape_numel(shape)
    return places


def recut_errors(states: list[dict[str, Any]], places: dict[str, tuple[int, int, int]],
                 shapes: "OrderedDict[str, Any]", compressed: CompressedLayout, rank: int, read: RangeRead
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's worker and server errors (fp32, CPU) for a live master of ``shapes`` cut by ``compressed``,
    from every saved rank's ``states`` (in rank order), matched by parameter name: the worker error the saved
    ranks' mean, the server error this rank's chunk of the saved servers' errors laid end to end. Only those
    elements are read (``read``); a name the saved groups lack, or whose saved elements fall outside a saved
    buffer, is zeros."""
    worker, server = torch.zeros(compressed.numel), torch.zeros(compressed.chunk)
    low = rank * compressed.chunk
    high = low + compressed.valid(rank)
    offset = 0
    for name, shape in shapes.items():
        n = shape_numel(shape)
        if name in places and offset + n <= compressed.numel:
            k, saved_offset, saved_n = places[name]
            count = min(n, saved_n)
            rows = [s["worker_errors"][k] for s in states]
            mean_into(worker[offset:offset + count],
                      [(t, saved_offset) if saved_offset + saved_n <= t.numel() else None for t in rows], read)
            pieces = [s["server_errors"][k] for s in states]
            laid = min(sum(t.numel() for t in pieces), sum(shape_numel(v) for v in states[0]["param_shapes"][k].values()))
            lo, hi = max(offset, low), min(offset + count, high)
            if lo < hi and saved_offset + saved_n <= laid:
                _read_laid(pieces, saved_offset + lo - offset, server[lo - low:hi - low], read)
        offset += n
    return worker, server


def _read_laid(pieces: list[torch.Tensor], start: int, out: torch.Tensor, read: RangeRead) -> None:
    """Elements ``[start, start + out.numel())`` of ``pieces`` laid end to end, into ``out``."""
    first = 0
    for piece in pieces:
        lo, hi = max(start, first), min(start + out.numel(), first + piece.numel())
        if lo < hi:
            read(piece, lo - first, out[lo - start:hi - start])
        first += piece.numel()


def bias_corrections(bias_correction: bool, beta1: float, beta2: float, step: int, variance_updates: int
                     ) -> tuple[float, float]:
    """``(1 - beta1^step, 1 - beta2^variance_updates)``, or ``(1, 1)`` without bias correction."""
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1 ** step, 1.0 - beta2 ** max(1, variance_updates)


def adam_denominator(exp_avg_sq: torch.Tensor, bias2: float, eps: float, eps_inside_sqrt: bool) -> torch.Tensor:
    """``sqrt(v / bias2) + eps`` (or ``sqrt(v / bias2 + eps)`` with ``eps_inside_sqrt``), a new tensor."""
    if eps_inside_sqrt:
        return (exp_avg_sq / bias2).add_(eps).sqrt_()
    return (exp_avg_sq.sqrt() / bias2 ** 0.5).add_(eps)
