"""Activation memory of a GPT-style decoder for one micro batch, with and without activation checkpointing.

The count follows Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), which gives ``s*b*h*(34 + 5*a*s/h)`` bytes per layer for 16-bit activations with dropout and
explicit attention. We keep its term-by-term derivation, with the element size ``e`` (2 for fp16/bf16, 4
for fp32), the feed-forward width ``f`` (4h by default), dropout on or off, and fused attention, so each
term says which tensor autograd keeps (b = micro batch, s = sequence, h = hidden, a = heads):

=====================================  =======================================
tensor saved for backward              bytes
=====================================  =======================================
LayerNorm 1 input (+ fp32 mean, rstd)  ``e*sbh + 8*sb``
QKV projection input                   ``e*sbh``
Q, K, V                                ``3*e*sbh``
rotary positions only                  ``3*e*sbh`` (rotated Q and K; the fused kernel
                                       then writes its output head-major, so the
                                       output projection gets its own copy)
attention, fused kernel                ``4*a*s*b`` (fp32 log-sum-exp)
attention, explicit softmax            ``e*a*s*s*b`` (+ ``(1+e)*a*s*s*b`` with dropout)
output projection input                ``e*sbh``
LayerNorm 2 input (+ mean, rstd)       ``e*sbh + 8*sb``
MLP input, GeLU input, GeLU output     ``e*sbh + 2*e*sbf``
dropout masks (attention out, MLP)     ``2*sbh`` when dropout is on
=====================================  =======================================

With e=2, f=4h, dropout and explicit attention this is Korthikanti's 34*sbh + 5*a*s*s*b (we also count
the small LayerNorm statistics). Around the blocks: the final LayerNorm input and the LM-head input
(``2*e*sbh``), and at the loss the logits the caller holds, their fp32 log-softmax (saved), and, when
backward starts, the fp32 gradients of both, which exist together (``b*s*V*(e + 12)``).

Backward also needs a workspace while it walks through a block: the gradients of the MLP's wide
activations (``2*e*sbf``), or of the attention scores with explicit attention (``2*e*a*s*s*b``), whichever
is larger.

Activation checkpointing (``model.activation_checkpointing``, :mod:`dsrun.activation_checkpointing.modes`)
changes what each block keeps between its forward and its backward:

* a block that is not checkpointed keeps everything (``block``);
* a checkpointed block keeps its input (``e*sbh``);
* under ``selective`` every block keeps its input and the outputs of the fused attention kernel (``e*sbh``
  and the fp32 log-sum-exp ``4*a*s*b``), the attention output projection (``e*sbh``), the MLP
  up-projection (``e*sbf``) and down-projection (``e*sbh``); with explicit attention nothing of the
  attention is kept.

Tensor parallelism (AutoTP, ``tensor_parallel.autotp_size`` T, docs/autotp.md): a rank holds 1/T of the heads
and of the MLP width, so Q, K, V, the attention's per-head tensors, the output projection's input (the
attention output) and the MLP's wide GeLU input and output are 1/T; the tensors that enter a column-parallel
linear (the norms' inputs, the QKV and MLP inputs, whole on every rank of the group) and the all-reduced
outputs of the row-parallel linears (the residual stream, the dropout masks) stay whole, as does everything
around the blocks (the LM head is not split).

Backward walks the blocks from the last: while it is in block ``i``, blocks ``0..i-1`` still hold what they
keep and block ``i`` holds its full activations again (recomputed around what it kept). That is largest at
the last block: ``sum(kept of blocks 0..L-2) + block``. So ``none`` gives ``L*block``, ``full``
``(L-1)*e*sbh + block``, ``every_N`` counts its non-checkpointed blocks whole, ``selective``
``(L-1)*kept + block``.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsrun.estimate.inputs import GPTShape
from dsrun.activation_checkpointing.modes import CheckpointMode


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one micro batch on one rank: ``per_block`` (one transformer block's saved
    tensors), ``blocks`` (all blocks, as kept in the chosen mode), ``head`` (final norm, LM head, loss),
    ``workspace`` (gradients of one block's activations during backward)."""

    per_block: int
    blocks: int
    head: int
    workspace: int = 0

    @property
    def total(self) -> int:
        return self.blocks + self.head + self.workspace


def element_size(precision: str) -> int:
    """Bytes of one activation element: 2 in fp16/bf16 (the model runs in 16-bit), 4 in fp32."""
    return 2 if precision in ("fp16", "bf16") else 4


def gpt_block_activation_bytes(shape: GPTShape, micro_batch: int, seq_len: int, elem: int, tp: int = 1) -> int:
    """Bytes one transformer block saves for backward (the table in the module docstring); ``tp``: the
    tensor-parallel degree (this rank's heads and MLP width are 1/tp)."""
    b, s, h, a, f = micro_batch, seq_len, shape.n_embd, shape.n_head // tp, shape.ffn // tp
    sbh, sb = s * b * h, s * b
    sbh_split = sbh // tp                # per-head tensors: this rank's heads
    total = elem * sbh + 8 * sb          # LayerNorm 1 input and statistics
    total += elem * sbh                  # QKV projection input
    total += 3 * elem * sbh_split        # Q, K, V
    if shape.rotary:
        # Rotated Q and K are new tensors; contiguous Q also makes the fused kernel write its output
        # head-major, so the output projection's input is a separate copy.
        total += 3 * elem * sbh_split
    if shape.flash_attention:
        total += 4 * a * s * b           # fused attention keeps only the log-sum-exp
    else:
        total += elem * a * s * s * b    # softmax output
        if shape.dropout:
            total += (1 + elem) * a * s * s * b  # dropout mask and dropped-out scores
    total += elem * sbh_split            # output projection input
    total += elem * sbh + 8 * sb         # LayerNorm 2 input and statistics
    total += elem * sbh + 2 * elem * s * b * f  # MLP input, GeLU input, GeLU output
    if shape.dropout:
        total += 2 * sbh                 # one-byte masks after attention and after the MLP
    return total


def gpt_selective_kept_bytes(shape: GPTShape, micro_batch: int, seq_len: int, elem: int, tp: int = 1) -> int:
    """Bytes one block keeps under selective checkpointing (the list in the module docstring)."""
    b, s, h = micro_batch, seq_len, shape.n_embd
    # input, attention out-projection, MLP up (this rank's width) and down (all-reduced: whole)
    kept = elem * s * b * h * 3 + elem * s * b * (shape.ffn // tp)
    if shape.flash_attention:  # the fused kernel's output and log-sum-exp: this rank's heads
        kept += elem * s * b * h // tp + 4 * (shape.n_head // tp) * s * b
    return kept


def gpt_head_activation_bytes(shape: GPTShape, micro_batch: int, seq_len: int, elem: int) -> int:
    """Bytes around the blocks: final LayerNorm and LM-head inputs, logits, fp32 log-probs and gradients."""
    b, s = micro_batch, seq_len
    return 2 * elem * s * b * shape.n_embd + 8 * s * b + b * s * shape.vocab_size * (elem + 12)


def gpt_backward_workspace_bytes(shape: GPTShape, micro_batch: int, seq_len: int, elem: int, tp: int = 1) -> int:
    """Gradients of one block's widest activations (this rank's share of them), live while backward passes
    through it."""
    b, s = micro_batch, seq_len
    mlp = 2 * elem * s * b * (shape.ffn // tp)
    attention = 0 if shape.flash_attention else 2 * elem * (shape.n_head // tp) * s * s * b
    return max(mlp, attention)


def gpt_activation_bytes(shape: GPTShape, micro_batch: int, seq_len: int, precision: str,
                         checkpointing: object, sequence_parallel_size: int = 1,
                         tensor_parallel_size: int = 1) -> ActivationBytes:
    """Peak activation bytes of one micro batch through a GPT (see the module docstring); ``checkpointing``
    is a mode (``none``, ``full``, ``every_N``, ``selective``) or a bool (full/none).

    ``sequence_parallel_size`` P (DeepSpeed-Ulysses): each rank holds every per-token tensor for 1/P of the
    tokens and every per-head one (the attention's) for 1/P of the heads over the whole sequence, so every
    term is divided by P; the exchanges add nothing that is kept (the output projection keeps the attention
    output from before the exchange back, ``dsrun.sequence.recompute``).

    ``tensor_parallel_size`` T (AutoTP): the per-head and MLP-wide terms of each block are 1/T (the module
    docstring)."""
    tp = max(1, int(tensor_parallel_size))
    if sequence_parallel_size > 1:
        whole = gpt_activation_bytes(shape, micro_batch, seq_len, precision, checkpointing,
                                     tensor_parallel_size=tp)
        p = int(sequence_parallel_size)
        return ActivationBytes(per_block=-(-whole.per_block // p), blocks=-(-whole.blocks // p),
                               head=-(-whole.head // p), workspace=-(-whole.workspace // p))
    elem = element_size(precision)
    per_block = gpt_block_activation_bytes(shape, micro_batch, seq_len, elem, tp)
    mode = CheckpointMode.parse(checkpointing)
    block_input = elem * seq_len * micro_batch * shape.n_embd
    selective = gpt_selective_kept_bytes(shape, micro_batch, seq_len, elem, tp)
    kept = [per_block if not mode.checkpoints(i) else selective if mode.kind == "selective" else block_input
            for i in range(shape.n_layer)]
    blocks = sum(kept[:-1]) + per_block  # backward in the last block (see the module docstring)
    head = gpt_head_activation_bytes(shape, micro_batch, seq_len, elem)
    workspace = gpt_backward_workspace_bytes(shape, micro_batch, seq_len, elem, tp)
    return ActivationBytes(per_block=per_block, blocks=blocks, head=head, workspace=workspace)
