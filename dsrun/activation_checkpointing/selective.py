"""Selective recompute: keep the outputs of the expensive operations, recompute the cheap ones.

A plain checkpoint reruns the whole function; a selective one keeps some operations' outputs from the
forward and, in the recompute, hands them back instead of computing them again (in the spirit of
Megatron's and torchtitan's selective activation checkpointing). Which outputs is a *policy*, decided per
operation as the function runs (a ``TorchDispatchMode`` sees every aten operation below autograd).

:class:`TransformerBlockPolicy` is the policy of the ``selective`` mode of dsrun's GPT. In a block
``x + attn(ln_1(x))``, ``+ mlp(ln_2(·))`` with fused attention it keeps the output of the attention kernel
(with its log-sum-exp) and of three of the four projections (attention output, MLP up and MLP down),
and recomputes the LayerNorms, GELU, the residual adds and the QKV projection. Per token of width ``h``
that keeps ``4h + 4h`` of the ``16h`` values the block saves, for ``6h²`` of its ``24h²`` matmul FLOPs
again (the QKV projection) instead of all of them: more than half of full checkpointing's memory saving at
a quarter of its extra compute (the figures: docs/activation_checkpointing.md). The fused kernel's backward
recomputes the attention scores from Q, K and the log-sum-exp anyway, so they are never stored.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from dsrun.activation_checkpointing.checkpoint import Retained, retain, run_non_reentrant

aten = torch.ops.aten

def _ops(*names: str) -> frozenset:
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


LINEAR_MATMULS = _ops("mm", "addmm")
FUSED_ATTENTION = _ops("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")

Decider = Callable[[OpOverload], bool]


@dataclass
class _KeptOutput:
    op: OpOverload
    spec: TreeSpec
    leaves: list[Any]  # tensors replaced by None (they are in the retaining node)


class _Keep(TorchDispatchMode):
    """Forward: remember the outputs of the operations ``decide`` picks."""

    def __init__(self, decide: Decider):
        super().__init__()
        self.decide = decide
        self.outputs: list[_KeptOutput] = []
        self.tensors: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: OpOverload, types: tuple[type, ...], args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.decide(func):
            leaves, spec = tree_flatten(out)
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    self.tensors.append(leaf.detach())
            self.outputs.append(_KeptOutput(func, spec, [None if isinstance(x, torch.Tensor) else x
                                                         for x in leaves]))
        return out


class _Reuse(TorchDispatchMode):
    """Recompute: hand back the kept outputs, in order, instead of running those operations again."""

    def __init__(self, decide: Decider, outputs: Sequence[_KeptOutput], tensors: Sequence[torch.Tensor]):
        super().__init__()
        self.decide = decide
        self.outputs = iter(outputs)
        self.tensors = iter(tensors)

    def __torch_dispatch__(self, func: OpOverload, types: tuple[type, ...], args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> Any:
        if not self.decide(func):
            return func(*args, **(kwargs or {}))
        kept = next(self.outputs, None)
        if kept is None or kept.op is not func:
            raise RuntimeError(f"selective checkpoint: the recompute ran {func} where the forward kept "
                               f"{kept.op if kept else 'nothing more'}; the function must run the same "
                               "operations each time")
        leaves = [next(self.tensors).detach() if x is None else x for x in kept.leaves]
        return tree_unflatten(leaves, kept.spec)


class SelectivePolicy:
    """A selective-recompute policy: ``decider()`` returns a fresh function ``op -> keep its output?`` for
    one pass (the forward, or one recompute), so a policy may count operations."""

    def decider(self) -> Decider:  # pragma: no cover - every policy overrides it
        raise NotImplementedError

    @contextlib.contextmanager
    def keep(self) -> Iterator[_Keep]:
        with _Keep(self.decider()) as mode:
            yield mode

    def retained(self, record: _Keep) -> tuple[list[_KeptOutput], Retained | None]:
        """What the forward kept, its tensors held by a node of their own (so autograd accounts for them)."""
        return record.outputs, retain(record.tensors)

    def reuse(self, kept: tuple[list[_KeptOutput], Retained | None]) -> _Reuse:
        outputs, node = kept
        return _Reuse(self.decider(), outputs, node.saved_tensors if node is not None else ())


@dataclass(frozen=True)
class TransformerBlockPolicy(SelectivePolicy):
    """Keep fused-attention outputs and every linear-layer matmul output after the first
    ``recompute_projections`` of the block (the QKV projection); recompute everything else."""

    recompute_projections: int = 1

    def decider(self) -> Decider:
        seen = 0

        def decide(op: OpOverload) -> bool:
            nonlocal seen
            if op in FUSED_ATTENTION:
                return True
            if op in LINEAR_MATMULS:
                seen += 1
                return seen > self.recompute_projections
            return False

        return decide


def selective_checkpoint(function: Callable[..., Any], *args: object, policy: SelectivePolicy | None = None,
                         **kwargs: object) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` (any arguments) without reentry, keeping the outputs ``policy`` picks
    (default: :class:`TransformerBlockPolicy`)."""
    return run_non_reentrant(function, args, kwargs, policy or TransformerBlockPolicy())
