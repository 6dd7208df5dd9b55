"""Checkpoint and recompute: ``checkpoint`` (reentrant) and ``non_reentrant_checkpoint``.

Both keep only the function's inputs (as :mod:`.storage` says: whole, partitioned, on the host) and the
random-number states, and run the function again in backward. They take any arguments (tensors, ``None``,
integers, integer tensors, nested tuples and dicts, keyword arguments) and return whatever the function
returns (a tensor, a tuple, a dict ...).

* :func:`checkpoint` is DeepSpeed's ``CheckpointFunction``: the forward runs under ``no_grad`` inside one
  autograd function whose backward recomputes and back-propagates through the recomputed graph.
* :func:`non_reentrant_checkpoint` records the forward's graph as usual but, through saved-tensor hooks,
  stores a placeholder for every tensor autograd would keep; the first placeholder unpacked in backward
  reruns the function and hands back what it saved. Parameters reached only inside (frozen embeddings
  before the first block, ZeRO-3 parameters) need no special care, and each recomputed tensor is dropped as
  soon as backward has used it.

Everything a checkpoint keeps goes through ``save_for_backward`` (of its own small node), so saved-tensor
hooks, and tools built on them, see exactly what it holds. ``synchronize_checkpoint_boundary`` calls the
accelerator's ``synchronize`` at the start and end of each forward and each recompute; ``profile`` prints
their times, numbered by the call's position in the forward.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Iterator, Protocol, Sequence, TypeVar

import torch
from torch.autograd.function import FunctionCtx
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from dsrun import comm
from dsrun.accelerator import get_accelerator
from dsrun.activation_checkpointing.rng import RNGSnapshot, autocast_state, replayed
from dsrun.activation_checkpointing.settings import STATE
from dsrun.activation_checkpointing.storage import StashedInput, restore_inputs, stash_inputs
from dsrun.activation_checkpointing.guards import recompute_guarded

Record = TypeVar("Record")
Kept = TypeVar("Kept")


class RecomputePolicy(Protocol[Record, Kept]):
    """What a non-reentrant checkpoint asks of a selective policy (:class:`.selective.SelectivePolicy`): record
    in forward, keep what it recorded, hand it back in the recompute."""

    def keep(self) -> ContextManager[Record]: ...

    def retained(self, record: Record) -> Kept: ...

    def reuse(self, kept: Kept) -> ContextManager[object]: ...


# --- call numbering, boundaries, profile ------------------------------------------------------------------
def _begin_call() -> int:
    """The number of this checkpoint call in the current forward (a backward since the last call starts a
    new forward at 0)."""
    if STATE.in_backward and not STATE.recomputing:
        STATE.in_backward = False
        STATE.calls = 0
    return STATE.calls


def _end_call() -> None:
    if not STATE.recomputing:
        STATE.calls += 1


@contextlib.contextmanager
def _boundary(index: int, phase: str) -> Iterator[None]:
    settings = STATE.settings
    sync = settings.synchronize_checkpoint_boundary or settings.profile  # a time needs the device's work done
    if sync:
        get_accelerator().synchronize()
    start = time.perf_counter()
    yield
    if sync:
        get_accelerator().synchronize()
    if settings.profile and comm.get_rank() == 0:
        print(f"[dsrun] activation checkpoint {index}: {phase} {(time.perf_counter() - start) * 1e3:.3f} ms",
              flush=True)


@contextlib.contextmanager
def _recomputing() -> Iterator[None]:
    STATE.in_backward = True
    STATE.recomputing += 1
    try:
        with recompute_guarded():  # e.g. ZeRO-3 keeps the parameters it had gathered
            yield
    finally:
        STATE.recomputing -= 1


def _device_type(values: Sequence[Any]) -> str:
    return next((v.device.type for v in values if isinstance(v, torch.Tensor)), "cpu")


def _detached_like(values: Sequence[Any], requires_grad: Sequence[bool]) -> list[Any]:
    """Inputs for a recompute: cut from the forward's graph, asking for gradients where the originals did."""
    return [v.detach().requires_grad_(rg) if isinstance(v, torch.Tensor) else v
            for v, rg in zip(values, requires_grad)]


def _requires_grad(values: Sequence[Any]) -> list[bool]:
    return [isinstance(v, torch.Tensor) and v.requires_grad for v in values]


def _kept_tensors(stashed: Sequence[StashedInput]) -> list[torch.Tensor]:
    return [s.kept for s in stashed if s.is_tensor]


def _without_tensors(stashed: Sequence[StashedInput]) -> list[StashedInput]:
    """The stash's description with the tensors taken out (they live in the saved tensors instead)."""
    return [s.without_tensor() for s in stashed]


# --- reentrant ----------------------------------------------------------------------------------------------
class CheckpointFunction(torch.autograd.Function):
    """DeepSpeed's reentrant checkpoint: ``CheckpointFunction.apply(run_function, all_outputs, *args)``.

    The forward runs ``run_function(*args)`` without a graph and returns its tensors (a flat tuple);
    ``all_outputs`` (a list) receives ``(spec, leaves)`` to rebuild the function's own output structure.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, run_function: Callable[..., Any], all_outputs: list,
                *args: object) -> tuple[torch.Tensor, ...]:
        ctx.run_function = run_function
        ctx.index = _begin_call()
        with _boundary(ctx.index, "forward"):
            ctx.snapshot = RNGSnapshot.capture()
            ctx.autocast = autocast_state(_device_type(args))
            ctx.input_requires_grad = _requires_grad(args)
            with torch.no_grad():
                outputs = run_function(*args)
            stashed = stash_inputs(args)
            _end_call()
        ctx.stashed = _without_tensors(stashed)
        ctx.save_for_backward(*_kept_tensors(stashed))
        leaves, spec = tree_flatten(outputs)
        all_outputs.append((spec, leaves))
        tensors = tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
        ctx.mark_non_differentiable(*(t for t in tensors if not (t.is_floating_point() or t.is_complex())))
        return tensors

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with _boundary(ctx.index, "recompute and backward"):
            with _recomputing():
                inputs = _detached_like(restore_inputs(ctx.stashed, ctx.saved_tensors), ctx.input_requires_grad)
                with replayed(ctx.snapshot), torch.enable_grad(), torch.autocast(**ctx.autocast):
                    outputs = ctx.run_function(*inputs)
            tensors = [leaf for leaf in tree_flatten(outputs)[0] if isinstance(leaf, torch.Tensor)]
            pairs = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(v.grad if isinstance(v, torch.Tensor) and rg else None
                                    for v, rg in zip(inputs, ctx.input_requires_grad))


def checkpoint(function: Callable[..., Any], *args: object, **kwargs: object) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` (reentrant; DeepSpeed's ``deepspeed.checkpointing.checkpoint``);
    any arguments, as the module docstring says.

    Gradients reach the parameters used inside even when no input requires a gradient (a frozen embedding
    before the first checkpointed block): the call always puts a node in the graph."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))

    def run(_anchor: torch.Tensor, *values: object) -> Any:
        call_args, call_kwargs = tree_unflatten(list(values), spec)
        return function(*call_args, **call_kwargs)

    anchor = torch.empty(0, requires_grad=True)
    all_outputs: list = []
    tensors = iter(CheckpointFunction.apply(run, all_outputs, anchor, *leaves))
    out_spec, out_leaves = all_outputs[0]
    return tree_unflatten([next(tensors) if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves],
                          out_spec)


# --- non-reentrant ------------------------------------------------------------------------------------------
class _Retain(torch.autograd.Function):
    """Keeps tensors for backward in a node of its own: autograd accounts for them (saved-tensor hooks see
    them) and the checkpoint reads them back from the node. Its output is thrown away, so it never runs
    backward; the tensors go when the node does."""

    @staticmethod
    def forward(ctx: FunctionCtx, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        ctx.count = len(tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[None, ...]:  # pragma: no cover - never used
        return (None,) * (1 + ctx.count)


class Retained:
    """Tensors kept for backward by a :class:`_Retain` node; ``saved_tensors`` reads them back. The node's
    output is held too: some torch releases (2.11) free a node's saved tensors once its output is gone."""

    __slots__ = ("output",)

    def __init__(self, tensors: Sequence[torch.Tensor]):
        with torch.enable_grad():
            self.output = _Retain.apply(torch.empty(0, requires_grad=True), *tensors)

    @property
    def saved_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.output.grad_fn.saved_tensors


def retain(tensors: Sequence[torch.Tensor]) -> Retained | None:
    """``tensors`` kept for backward (None when there are none)."""
    return Retained(tensors) if tensors else None


class _Holder:
    """What autograd stores in place of a saved tensor inside a non-reentrant checkpoint."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: "_Frame", index: int):
        self.frame, self.index = frame, index


class _Frame:
    """One non-reentrant checkpoint call: how to rerun it and the tensors the rerun saved."""

    def __init__(self, function: Callable[..., Any], leaves: list[Any], spec: TreeSpec,
                 policy: RecomputePolicy[Any, Any] | None):
        self.function, self.spec, self.policy = function, spec, policy
        self.index = _begin_call()
        self.snapshot = RNGSnapshot.capture()
        self.autocast = autocast_state(_device_type(leaves))
        self.input_requires_grad = _requires_grad(leaves)
        stashed = stash_inputs(leaves)
        self.stashed = _without_tensors(stashed)
        self.inputs = retain(_kept_tensors(stashed))
        self.kept: Any = None  # selective: the outputs kept in forward (a policy's record)
        self.packed = 0
        self.recomputed: list[torch.Tensor | None] | None = None

    def pack(self, tensor: torch.Tensor) -> _Holder:
        holder = _Holder(self, self.packed)
        self.packed += 1
        return holder

    def take(self, index: int) -> torch.Tensor:
        if self.recomputed is None or self.recomputed[index] is None:
            self.recompute()
        assert self.recomputed is not None
        tensor, self.recomputed[index] = self.recomputed[index], None  # backward has it; free it with its use
        return tensor

    def recompute(self) -> None:
        saved: list[torch.Tensor | None] = []

        def pack(tensor: torch.Tensor) -> None:
            saved.append(tensor.detach())  # an alias: stays valid when ZeRO-3 releases a parameter's .data

        def unpack(_: None) -> torch.Tensor:  # pragma: no cover - the recompute's graph is never run
            raise RuntimeError("the recomputed graph of a checkpoint is not meant for backward")

        with _recomputing(), _boundary(self.index, "recompute"):
            kept = self.inputs.saved_tensors if self.inputs is not None else None
            leaves = _detached_like(restore_inputs(self.stashed, kept), self.input_requires_grad)
            args, kwargs = tree_unflatten(leaves, self.spec)
            reuse = self.policy.reuse(self.kept) if self.policy is not None else contextlib.nullcontext()
            with replayed(self.snapshot), torch.enable_grad(), torch.autocast(**self.autocast), \
                    saved_tensors_hooks(pack, unpack), reuse:
                self.function(*args, **kwargs)
        if len(saved) != self.packed:
            raise RuntimeError(f"activation checkpoint {self.index}: the recompute saved {len(saved)} tensors for "
                               f"backward, the forward {self.packed}; the checkpointed function must run the "
                               "same operations each time (no branching on global state or on the call count)")
        self.recomputed = saved


def _unpack(holder: _Holder) -> torch.Tensor:
    return holder.frame.take(holder.index)


def run_non_reentrant(function: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                      policy: RecomputePolicy[Any, Any] | None = None) -> Any:
    """``function(*args, **kwargs)`` checkpointed without reentry; ``policy`` (see :mod:`.selective`) keeps
    some operations' outputs instead of recomputing them."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    frame = _Frame(function, leaves, spec, policy)
    with _boundary(frame.index, "forward"):
        keep = policy.keep() if policy is not None else contextlib.nullcontext()
        with saved_tensors_hooks(frame.pack, _unpack), keep as record:
            output = function(*args, **kwargs)
        if policy is not None:
            frame.kept = policy.retained(record)
        _end_call()
    return output


def non_reentrant_checkpoint(function: Callable[..., Any], *args: object, **kwargs: object) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` (any arguments) without reentry (DeepSpeed's
    ``non_reentrant_checkpoint``): the graph of the forward is kept, the tensors it saved are recomputed in
    backward."""
    return run_non_reentrant(function, args, kwargs)


def reset() -> None:
    """Reset the contiguous-memory buffers (DeepSpeed's ``reset``): call it between forwards that have no
    backward (evaluation with gradients on), since otherwise each forward takes the next buffer slots."""
    STATE.reset_buffers()
