"""DeepSpeed's ``offload_activations``: marked checkpoint inputs to host memory and back (CPU-runnable parts).

On the CPU a marked tensor is never moved (it is in host memory already): the context counts it as skipped and
backward is unchanged. The copy path itself (dense host buffer, strides rebuilt, buffer pool) is driven
directly on CPU tensors; the keep-last window and the stream path need a CUDA device (DeepSpeed's own tests).
"""
from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dsrun.activation_checkpointing.offload_activations import (CheckpointHiddenStatesOffload,
                                                                 get_checkpoint_hidden_states_offloading_ctx_manager)


def _fn(x: torch.Tensor) -> torch.Tensor:
    return x.sin().square()


def test_marks_count_and_cpu_tensors_stay_with_unchanged_gradients():
    x_ref = torch.randn(4, 8, requires_grad=True)
    _fn(checkpoint(_fn, x_ref, use_reentrant=False)).sum().backward()

    x = x_ref.detach().clone().requires_grad_(True)
    offload = get_checkpoint_hidden_states_offloading_ctx_manager(use_streams=True, min_offload_bytes=0)
    assert offload.use_streams is False  # no streams on the CPU
    with offload:
        offload.mark(x)
        _fn(checkpoint(_fn, x, use_reentrant=False)).sum().backward()
    assert offload.stats.marked_tensors == 1
    assert offload.stats.skipped_marked_tensors == 1  # the checkpoint saved x once: its one mark consumed
    assert offload.stats.offloaded_tensors == 0
    assert offload.stats.saved_tensors_seen >= 2  # x and the sin's input of the outer _fn at least
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="not re-entrant"):
        with offload:
            offload.__enter__()
    for key in ("keep_last_count", "min_offload_bytes", "max_fwd_stash_count", "max_cpu_buffer_pool_count"):
        with pytest.raises(ValueError, match=key):
            CheckpointHiddenStatesOffload(**{key: -1})


def test_host_copy_rebuilds_strides_and_reuses_the_pooled_buffer():
    offload = CheckpointHiddenStatesOffload(use_streams=False, use_pin_memory=False, min_offload_bytes=0,
                                            keep_last_count=0)
    source = torch.arange(48.0).reshape(6, 8)[:, ::2]  # a strided view: the host copy must be dense
    offload._start_offload(1, source)
    buffer = offload._tracker[1].buffer
    assert buffer.is_contiguous() and buffer.data_ptr() != source.data_ptr()
    assert offload.stats.offloaded_bytes == 24 * 4
    restored = offload._restore_tensor(1)
    assert restored.stride() == source.stride() and restored.storage_offset() == 0
    torch.testing.assert_close(restored, source, rtol=0, atol=0)
    assert offload._restore_tensor(1) is restored  # a retained graph unpacks it again: the same tensor
    assert (offload.stats.restored_tensors, offload.stats.restored_bytes) == (1, 24 * 4)
    assert offload._cpu_buffer_pool_count == 1  # the buffer went back to the pool ...
    dense_same_shape = torch.zeros(6, 4)
    again, key = offload._empty_cpu_like(dense_same_shape)  # ... and serves the next tensor of its shape
    assert again is buffer and key == offload._buffer_key(source)
    assert offload._cpu_buffer_pool_count == 0
    with pytest.raises(RuntimeError, match="no longer tracked"):
        offload.restore_input(7)


def test_gradient_checkpointing_layer_marks_its_hidden_states_while_open():
    transformers = pytest.importorskip("transformers")
    layer_class = transformers.GradientCheckpointingLayer
    original = layer_class.__call__

    class Layer(layer_class):
        def forward(self, hidden_states):
            return _fn(hidden_states)

    layer = Layer().train()
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    hidden = torch.randn(4, 8, requires_grad=True)
    outer = CheckpointHiddenStatesOffload(min_offload_bytes=0)
    inner = CheckpointHiddenStatesOffload(min_offload_bytes=0)
    with outer:
        patched = layer_class.__call__
        assert patched is not original
        with inner:
            layer(hidden).sum().backward()
            assert layer_class.__call__ is patched
        assert inner.stats.marked_tensors == 1 and outer.stats.marked_tensors == 0  # the innermost one marks
        assert inner.stats.skipped_marked_tensors == 1 and not inner._allowed
    assert layer_class.__call__ is original  # removed when the last context closed
    layer(hidden)
    assert inner.stats.marked_tensors == 1
    with pytest.raises(ValueError, match="boom"):
        with outer:
            raise ValueError("boom")
    assert layer_class.__call__ is original
