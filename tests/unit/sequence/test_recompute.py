"""``dsrun.sequence.recompute.ExchangedFromSource`` on one process (the exchange stood in for by a transpose):
a projection's saved input is kept as the exchange's source, which the op before saves already, so the saved
bytes drop by exactly that tensor; backward rebuilds it and the gradients are the same, on its own, under a
memory counter's hooks and under dsrun's non-reentrant activation checkpoint. Also the sliced-batch entry of the
GPT (``sequence_sharded``) without sequence parallelism."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsrun.activation_checkpointing.api import non_reentrant_checkpoint
from dsrun.profiling.tensor_memory import SavedTensorBytes
from dsrun.sequence import shard_sequence
from dsrun.sequence.recompute import ExchangedFromSource
from dsrun.utils.errors import UserError

SEQ, BATCH, WIDTH = 6, 3, 4


def exchange(source: torch.Tensor) -> torch.Tensor:
    return source.transpose(0, 1).contiguous()  # [SEQ, BATCH, W] -> [BATCH, SEQ, W], a copy like the all-to-all


def project(x: torch.Tensor, weight: torch.Tensor, redone: list[int] | None) -> torch.Tensor:
    """tanh (saves its output, the source), the exchange, then a linear layer that saves its input."""
    source = torch.tanh(x)
    exchanged = exchange(source)
    if redone is None:
        return F.linear(exchanged.reshape(BATCH * SEQ, WIDTH), weight)

    def redo(s: torch.Tensor) -> torch.Tensor:
        redone.append(1)
        return exchange(s)

    with ExchangedFromSource(exchanged, source, redo):
        return F.linear(exchanged.reshape(BATCH * SEQ, WIDTH), weight)


def grads_and_saved(redone: list[int] | None, checkpointed: bool = False):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SEQ, BATCH, WIDTH, generator=gen, requires_grad=True)
    weight = torch.randn(5, WIDTH, generator=gen, requires_grad=True)
    with SavedTensorBytes(exclude=[weight]) as saved:
        out = non_reentrant_checkpoint(project, x, weight, redone) if checkpointed else project(x, weight, redone)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    return x.grad, weight.grad, saved.bytes


def test_the_projection_keeps_the_source_and_backward_redoes_the_exchange():
    plain_x, plain_w, plain_saved = grads_and_saved(None)
    redone: list[int] = []
    x_grad, w_grad, saved = grads_and_saved(redone)
    assert plain_saved - saved == SEQ * BATCH * WIDTH * 4  # the exchanged copy is no longer kept
    assert len(redone) == 1  # rebuilt once, in backward
    assert torch.equal(x_grad, plain_x) and torch.equal(w_grad, plain_w)


def test_it_composes_with_an_activation_checkpoint():
    plain_x, plain_w, _ = grads_and_saved(None)
    redone: list[int] = []
    x_grad, w_grad, saved = grads_and_saved(redone, checkpointed=True)
    assert saved == SEQ * BATCH * WIDTH * 4  # the checkpoint's input alone; nothing of the region is kept
    assert len(redone) == 1  # the recomputed region's source, exchanged again for the projection's backward
    assert torch.equal(x_grad, plain_x) and torch.equal(w_grad, plain_w)


def test_a_redo_of_another_layout_is_refused():
    x = torch.randn(SEQ, BATCH, WIDTH, requires_grad=True)
    source = torch.tanh(x)
    exchanged = exchange(source)
    with ExchangedFromSource(exchanged, source, lambda s: s.contiguous()):  # not the forward's operation
        out = F.linear(exchanged, torch.ones(2, WIDTH, requires_grad=True))
    with pytest.raises(RuntimeError, match="redo must repeat the forward's operations"):
        out.sum().backward()


def test_sliced_batches_without_sequence_parallelism_are_whole_ones():
    from dsrun.models.gpt import GPT

    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    assert shard_sequence(inputs) is inputs  # no engine: a group of one rank holds the whole sequence
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8, sequence_parallel=True)
    assert torch.equal(model(inputs, targets, sequence_sharded=True), model(inputs, targets))
    with pytest.raises(UserError, match="seqlen curriculum truncates whole sequences"):
        model(inputs, targets, curriculum_seqlen=4, sequence_sharded=True)
