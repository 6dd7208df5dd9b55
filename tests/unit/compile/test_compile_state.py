"""DeepCompile's process-wide state and who owns it: the captured backward inputs (``patch_compiled_func``), the
stored example inputs (``input_storage``), the AOT constructor patch, dynamo's shape settings, the expected
gradient dtype, and what an engine gives back at ``destroy()``. In-process, no compile: well under a second."""
from __future__ import annotations

from collections import deque

import pytest
import torch

from dsrun.compile import backend as backend_mod
from dsrun.compile import init as init_mod
from dsrun.compile import patch_compiled_func as pcf
from dsrun.compile.input_storage import InputStorage


def _compiled_function_class() -> type:
    """A class as AOT autograd defines one (its name and ``_backward_impl`` are what the capture keys on)."""

    class CompiledFunction(torch.autograd.Function):
        @staticmethod
        def _backward_impl(ctx, all_args):
            return [a * 2 for a in all_args]

    return CompiledFunction


def test_backward_inputs_are_captured_per_frame_and_released_by_owner() -> None:
    original = torch.autograd.Function
    mine, other = (object(), 1), (object(), 1)  # two engines' frames with the same frame id
    owned = {mine}
    try:
        backend_mod.frames_needing_bwd.update({mine, other})
        pcf.patch_compiled_func()
        assert torch.autograd.Function is not original
        pcf.register_backward_frame(mine)
        pcf.register_backward_frame(other)
        first, second = _compiled_function_class(), _compiled_function_class()  # claim the frames in order
        grads = [torch.ones(2)]
        assert first._backward_impl(None, grads)[0].tolist() == [2.0, 2.0]  # the backward itself unchanged
        second._backward_impl(None, [torch.zeros(1)])
        assert pcf.get_backward_inputs(mine) == [grads] and len(pcf.get_backward_inputs(other)) == 1
        assert pcf.pop_backward_input(mine) is grads and pcf.pop_backward_input(mine) is None
        first._backward_impl(None, grads)  # a frame whose inputs were taken is not recorded again
        assert pcf.get_backward_inputs(mine) == []
        backend_mod.cleanup_compiled_backward_state(owned_frames=owned)  # one engine's release
        assert owned == set() and backend_mod.frames_needing_bwd == {other}
        assert torch.autograd.Function is not original  # the other engine still waits for its backward
        backend_mod.cleanup_compiled_backward_state(other)
        assert torch.autograd.Function is original and pcf.get_backward_inputs() == {}
    finally:
        backend_mod.frames_needing_bwd.clear()
        pcf.unpatch_compiled_func()
    assert torch.autograd.Function is original


def test_stored_inputs_come_back_with_their_layout() -> None:
    storage = InputStorage(keep_int_input_tensors=True)
    ids = torch.tensor([[3, 1], [2, 0]])
    x = torch.randn(4, 3).t()  # not contiguous
    storage.put((x, {"ids": ids}, [7, None]))
    got_x, got, rest = storage.get()
    assert got_x.shape == (3, 4) and got_x.stride() == x.stride() and bool((got_x == 1).all())  # values not kept
    assert torch.equal(got["ids"], ids) and got["ids"] is not ids  # integer values kept (indices)
    assert rest == [7, None]
    keep_all = InputStorage(keep_all_input_tensors=True)
    keep_all.put([x])
    assert torch.equal(keep_all.get()[0], x)
    local = deque([(x,)])
    assert backend_mod._get_fw_real_inputs(local, storage, 0) == (x,)  # the graph's own inputs first, once
    assert backend_mod._get_fw_real_inputs(local, storage, 0)[0].shape == (3, 4)  # then rebuilt
    with pytest.raises(RuntimeError, match="graph_id 5"):
        backend_mod._get_fw_real_inputs(deque(), InputStorage(), 5)


def test_the_aot_constructor_patch_has_one_owner_at_a_time() -> None:
    from torch._dynamo.backends.common import AotAutograd

    from dsrun.compile.inductor import patch_create_aot_dispatcher_function

    original = AotAutograd.__init__
    made: list[str] = []

    def patch(tag: str):
        return patch_create_aot_dispatcher_function(
            0, False, lambda gm, i: made.append(tag), lambda gm, i: None, (), [], {}, 0, set())

    restore_old = patch("old")
    restore_new = patch("new")
    newer = AotAutograd.__init__
    restore_old()  # an older owner's restore leaves the newer patch
    assert AotAutograd.__init__ is newer
    aot = AotAutograd(fw_compiler=lambda gm, i: gm, partition_fn=lambda *a, **k: None)
    aot.kwargs["fw_compiler"](torch.fx.symbolic_trace(torch.nn.Identity()), [])
    assert made == ["new"]  # the graph maker of the patch in force ran before the compiler
    restore_new()
    restore_new()
    assert AotAutograd.__init__ is original and not hasattr(AotAutograd, "__original_init")


def test_dynamo_shape_settings_come_back_after_the_last_owner(world_of_one) -> None:
    import dsrun

    config = torch._dynamo.config
    original = torch.autograd.Function
    saved = (config.force_parameter_static_shapes, config.force_nn_module_property_static_shapes)
    first = init_mod._allow_dynamo_dynamic_parameter_shapes_for_z3({})
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1})
    engine._deepcompile_dynamo_config_restore = init_mod._allow_dynamo_dynamic_parameter_shapes_for_z3({})
    frame = (object(), 3)
    engine._deepcompile_owned_frames = {frame}
    backend_mod.frames_needing_bwd.add(frame)
    pcf.patch_compiled_func()
    engine.destroy()  # gives back its frame and its share of the settings
    assert not backend_mod.frames_needing_bwd and torch.autograd.Function is original  # its frame was the last
    assert not hasattr(engine, "_deepcompile_dynamo_config_restore")
    assert config.force_parameter_static_shapes is False  # the first owner still holds them
    first()
    first()  # a release counts once
    assert (config.force_parameter_static_shapes, config.force_nn_module_property_static_shapes) == saved


def test_gradients_reach_the_reduction_in_the_expected_dtype(world_of_one) -> None:
    from dsrun.compile.handle import DeepCompileHandle
    from dsrun.zero.partition_params import partition_param

    param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    partition_param(param)
    assert init_mod._resolve_expected_grad_dtype(param) is torch.bfloat16  # torch's default: the param's dtype
    param.grad_dtype = torch.float32
    assert init_mod._resolve_expected_grad_dtype(param) is torch.float32
    param.grad_dtype = None
    assert init_mod._resolve_expected_grad_dtype(param) is None  # any dtype accepted as it comes
    handle, got = DeepCompileHandle(), []
    handle.init(lambda p, g: got.append(g))
    handle.register_z3_param(param, torch.float32)
    grad = torch.full((4,), 0.5, dtype=torch.bfloat16)
    handle.reduce_grad(param.ds_id, grad)
    handle.register_z3_param(param, None)
    handle.reduce_grad(param.ds_id, grad)
    assert [g.dtype for g in got] == [torch.float32, torch.bfloat16] and got[1] is not grad
    assert got[0].tolist() == [0.5] * 4
