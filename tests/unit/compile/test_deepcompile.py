"""DeepCompile (``dsrun/compile``): ZeRO-3 inside the compiled graph, its passes, schedule and fallbacks.

The backend is driven directly in this process (parameters partitioned over a one-rank world, whose shards are
the whole values: the graph's gathers, releases and reduces run as on many ranks), and once through the engine
on two ranks against eager ZeRO-3. Dynamo's ``eager`` backend (AOT autograd, the passes, the FX interpreter):
the same graphs inductor gets, without its seconds of code generation.
"""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.compile import backend as backend_mod
from dsrun.compile.handle import get_deepcompile_handle
from dsrun.compile.init import resolve_schedule
from dsrun.compile.patch_compiled_func import get_backward_inputs
from dsrun.compile.passes import prefetch, selective_gather, zero3_compile
from dsrun.utils.errors import ConfigError
from tests.helpers import run_ranks

STEPS = 3
# DeepSpeed's default schedule with its step 5 brought forward: step 2 runs what selective gather kept at step 1
SCHEDULE = [(0, ["zero3_compile"]), (1, ["zero3_compile", "prefetch", "selective_gather"])]


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).pow(2).sum()


class _BrokenMLP(_MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(hidden).pow(2).sum()


def _compiled_mlp(schedule: list, cls: type = _MLP, **keep: bool) -> tuple[torch.nn.Module, torch.nn.Module,
                                                                          dict[str, torch.Tensor], object]:
    """A reference MLP, its twin partitioned and compiled through DeepCompile's backend, and where the twin's
    reduced gradients land (by parameter name)."""
    from dsrun.zero.partition_params import partition_param

    torch.manual_seed(0)
    reference, model = cls(), cls()
    model.load_state_dict(reference.state_dict())
    names = {}
    handle = get_deepcompile_handle()
    handle.cleanup()
    for name, p in model.named_parameters():
        partition_param(p)
        handle.register_z3_param(p)
        names[id(p)] = name
    grads: dict[str, torch.Tensor] = {}
    handle.init(lambda p, g: grads.__setitem__(names[id(p)], g.reshape(p.ds_shape)))
    backend_mod.init_schedule(schedule)
    torch._dynamo.reset()
    backend = backend_mod.DeepCompileBackend("eager", names, debug_log=True, **keep)
    compiled = torch.compile(backend_mod.gathered_forward(model), backend=backend)
    return reference, compiled, grads, backend


def test_the_passes_put_zero3_in_the_graph(world_of_one, monkeypatch) -> None:
    from torch._dynamo.utils import counters

    reference, compiled, grads, backend = _compiled_mlp([(0, [zero3_compile.add_z3_gather_release])],
                                                        keep_all_input_tensors=True)
    handle = get_deepcompile_handle()
    handle.record_order = True
    handle.set_sync_points(before_allgather=True, after_reduce=True)  # compile.sync_before_allgather, ...
    launched: list[int] = []
    handle.release_buckets = lambda: launched.append(handle.stats.reduced)
    x = torch.randn(3, 8)
    counters.clear()
    logged: list[str] = []
    monkeypatch.setattr(backend_mod, "log_rank0", logged.append)
    loss = compiled(x)
    loss.backward()
    assert int(sum(counters["graph_break"].values())) == 0 and counters["stats"]["unique_graphs"] == 1
    expected = reference(x)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for name, p in reference.named_parameters():  # every gradient reached the reduction, whole
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7)
    ids = list(handle.params)  # a.weight, a.bias, b.weight, b.bias (ds_ids count on across the process)
    order = [(op, ids.index(ds_id)) for op, ds_id in handle.stats.order]
    forward, backward = order[:8], order[8:]  # four parameters, each gathered and released once
    # each parameter gathered just before its layer and released after it: never both layers whole at once
    assert forward == [("gather", 0), ("gather", 1), ("release", 1), ("release", 0),
                       ("gather", 2), ("gather", 3), ("release", 3), ("release", 2)]
    assert handle.stats.peak_live_numel == 8 * 16 + 16  # the larger layer
    assert handle.stats.gathers == 0  # a world of one copies its shard: no collective
    assert handle.stats.reduced == 4
    # the backward gathers again what it reads (b's weight: nothing whole kept from the forward), releases it,
    # and each gradient is reduced right where the graph computes it
    assert backward[:2] == [("gather", 2), ("release", 2)]
    assert sorted(backward[2:]) == [("reduce", 0), ("reduce", 1), ("reduce", 2), ("reduce", 3)]
    from dsrun.compile.ops import END_BACKWARD, REDUCE

    bwd = backend.profiling_results[0].bwd_graph
    assert all(n.prev is n.args[0] for n in bwd.nodes if n.target is REDUCE)
    # the backward ends after its four reductions, and (the step's only backward graph) launches the buckets
    (end,) = [n for n in bwd.nodes if n.target is END_BACKWARD]
    assert [n.target for n in end.args[0]] == [REDUCE] * 4 and end.args[1:] == (0, True)
    assert launched == [4] and handle.stats.backward_ends == handle.stats.bucket_releases == 1
    # a synchronization before each gather and after each reduction
    assert handle.stats.syncs == [op for op, _ in handle.stats.order].count("gather") + 4
    # compile.keep_all_input_tensors: the stored inputs a pass may run the graph on again are x itself, not ones
    (stored_x,) = [t for t in backend.input_storages[0].get() if isinstance(t, torch.Tensor) and t.shape == x.shape]
    assert torch.equal(stored_x, x)
    assert backend.graph_order == [(0, True)]
    assert "forward graph 0 after ['add_z3_gather_release']" in logged[0]  # compile.debug_log
    assert "release_param" in logged[0] and "backward graph 0" in logged[1]


def test_a_graph_break_keeps_the_gradients_and_loses_the_memory_saving(world_of_one) -> None:
    from torch._dynamo.utils import counters

    reference, compiled, grads, _ = _compiled_mlp([(0, [zero3_compile.add_z3_gather_release])], _BrokenMLP)
    handle = get_deepcompile_handle()
    x = torch.randn(3, 8)
    counters.clear()
    compiled(x).backward()
    reference(x).backward()
    assert int(sum(counters["graph_break"].values())) == 1  # the one the model asks for, none of dsrun's
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7)
    # the graph before the break gathers every parameter (the forward reads them all up front) and hands the
    # values on: whole until the last graph that reads them, no release (docs/deepcompile.md)
    assert handle.stats.peak_live_numel == sum(p.numel() for p in reference.parameters())
    assert handle.stats.releases == 0 and handle.stats.reduced == 4


def test_the_eager_fallback_holds_what_a_forward_read_until_its_backward(world_of_one) -> None:
    """DeepSpeed's z3_eager_fallback on dsrun's partitioned parameters: an eager forward (the code a graph break
    leaves out of the graphs) gathers each parameter on read; they stay gathered until that forward's backward
    completed, then are released; a guard's read gathers nothing; GatheredParameters over a parameter the forward
    still needs leaves it gathered, and an overlapping nested block is refused before gathering."""
    from dsrun.engine.output_hooks import register_output_backward_hooks
    from dsrun.zero import eager_fallback
    from dsrun.zero.gathered import GatheredParameters
    from dsrun.zero.partition_params import ParamStatus, partition_param

    torch.manual_seed(0)
    reference, model = _MLP(), _MLP()
    model.load_state_dict(reference.state_dict())
    for p in model.parameters():
        partition_param(p)
    ids = [p.ds_id for p in model.parameters()]

    class Engine:
        module = model
        is_deepcompile_active = zero_optimization_partition_weights = staticmethod(lambda: True)

    engine = Engine()
    fallback = engine._deepcompile_z3_eager_fallback = eager_fallback.DeepCompileZ3EagerFallback(engine)
    x = torch.randn(3, 8)
    with eager_fallback.deepcompile_z3_forward_context(engine) as active:
        guard = {"__name__": "torch._dynamo.guards", "m": model}
        exec("seen = m.a.weight", guard)  # as dynamo's guard code reads it: the shard, no gather
        assert guard["seen"].ds_status is ParamStatus.NOT_AVAILABLE and guard["seen"].numel() == 0
        loss = model(x)
    assert active is fallback and fallback.stats()["last_guard_suppressed_param_ids"] == [ids[0]]
    graph = fallback.record_forward_graph()
    register_output_backward_hooks(loss, lambda: fallback.record_backward_start(graph))
    assert fallback.stats()["param_graph_claim_ids"] == {i: [graph] for i in ids}
    assert all(p.ds_status is ParamStatus.AVAILABLE for p in model.parameters())
    with GatheredParameters([model.b.weight]):  # the forward's backward still needs it: not released here
        with pytest.raises(RuntimeError, match=rf"cannot overlap parameters.*\[{ids[2]}\]"):
            with GatheredParameters([model.b.bias, model.b.weight]):
                pass
    assert model.b.weight.ds_status is ParamStatus.AVAILABLE and model.b.bias.ds_status is ParamStatus.AVAILABLE
    loss.backward()
    expected = reference(x)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    fallback.complete_backward()  # the engine's post-backward hook in DeepSpeed
    assert fallback.stats()["last_released_param_ids"] == ids and fallback.stats()["tracked_param_ids"] == []
    assert all(p.ds_status is ParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in model.parameters())
    # zero.Init's torch.nn.init interception inside a user's block over the same parameter: not a refused
    # overlap; the new values reach the shard
    with dsrun.zero.Init(), GatheredParameters([model.a.bias]):
        torch.nn.init.constant_(model.a.bias, 0.5)
    with GatheredParameters([model.a.bias]):
        assert torch.equal(model.a.bias.detach(), torch.full((16,), 0.5))


def test_prefetch_and_selective_gather_from_their_step(world_of_one) -> None:
    """Also: a pass's ``create_inputs_fn`` gives the graph's real inputs, the backward's captured from its first
    call while ``torch.autograd.Function`` is patched, which ends with the backward's compile."""
    seen: list[tuple[bool, list[torch.Tensor], bool, set]] = []
    original_function = torch.autograd.Function

    def record_inputs(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd):
        seen.append((bwd, list(create_inputs_fn()), torch.autograd.Function is original_function,
                     set(backend_mod.frames_needing_bwd)))
        return gm

    reference, compiled, grads, backend = _compiled_mlp([(0, [zero3_compile.add_z3_gather_release, record_inputs]),
                                                         (1, [zero3_compile.add_z3_gather_release,
                                                              prefetch.schedule_prefetch,
                                                              selective_gather.selective_gather])])
    handle = get_deepcompile_handle()
    x = torch.randn(3, 8)
    for step in range(3):
        assert backend_mod.launch_compile_passes(step) == (step < 2)  # DeepSpeed's: each scheduled step, 0 too
        assert not backend_mod.launch_compile_passes(step)  # another micro-step of the same step: no recompile
        handle.reset_stats()
        compiled(x).backward()
        if step == 0:
            assert handle.stats.prefetched == 0 and not handle.persistent
            (fwd, fwd_inputs, fwd_unpatched, awaited), (bwd, bwd_inputs, bwd_unpatched, _) = seen
            assert not fwd and bwd and not fwd_unpatched and awaited == {(backend, 0)}
            assert any(t is x for t in fwd_inputs)  # the very tensors the step ran on
            # compile.keep_int_input_tensors (default) keeps integer inputs' values only: a float input is stored
            # as its layout, rebuilt as ones
            assert any(t.shape == x.shape and torch.equal(t, torch.ones_like(x))
                       for t in backend.input_storages[0].get() if isinstance(t, torch.Tensor))
            # the backward's: the saved relu output, at its real values, and the loss's gradient, 1
            assert any(t.shape == (3, 16) and torch.equal(t, torch.relu(x @ reference.a.weight.T + reference.a.bias))
                       for t in bwd_inputs)
            assert any(t.shape == () and t.item() == 1.0 for t in bwd_inputs)
            assert torch.autograd.Function is original_function and not backend_mod.frames_needing_bwd
            assert not backend.owned_frames and not get_backward_inputs()
        handle.invalidate()  # what the optimizer step does
    # from step 1: every gather but each graph's first was started ahead; all four parameters fit the host's
    # memory less the margin, so they are kept: the backward's gathers are served from the kept copies
    assert handle.stats.prefetched >= 3
    assert handle.persistent == set(handle.params)
    assert handle.stats.persistent_hits > 0
    assert backend.profiling_results[max(backend.profiling_results)].bwd_mem  # profiled after each pass


def test_offload_activation_moves_saved_values_out_and_back(world_of_one, monkeypatch) -> None:
    """``compile.offload_activation``'s schedule: from step 0 each saved value goes to a host buffer after its
    last forward use and comes back just before its first backward reader (the backward receives the host
    copies, the gradients do not change); from WARMUP the planner keeps on the device what the budget holds."""
    from dsrun.compile.init import WARMUP, schedule_for
    from dsrun.compile.passes import offload_activation as act
    from dsrun.config.misc import CompileConfig

    monkeypatch.setenv("DS_DC_OFFLOAD_ACT_MIN_SIZE_MB", "0")  # the MLP's values are far below 5 MB
    monkeypatch.setenv("DS_DC_OFFLOAD_ACT_BUDGET_GB", "0")  # no room: everything moves
    monkeypatch.setattr(act, "_h2d_bandwidth", lambda: 10e9)  # not measured: the plan does not need it here
    received: list[list[torch.Tensor]] = []

    def record_backward_inputs(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget,
                               param_manager, bwd):
        if bwd:
            received.append(list(create_inputs_fn()))
        return gm

    section = CompileConfig(deepcompile=True, offload_activation=True)
    act.configure(section)
    schedule = [(step, passes + [record_backward_inputs]) for step, passes in schedule_for(section)]
    assert [step for step, _ in schedule] == [0, WARMUP]
    assert act.pin_memory  # offload_activation_pin_memory's default: page-locked (with an accelerator)
    act.configure(CompileConfig(deepcompile=True, offload_activation=True, offload_activation_pin_memory=False))
    assert not act.pin_memory
    act.configure(section)
    act.reset_offload_activation_stats()
    act._host_buffers.clear()
    reference, compiled, grads, backend = _compiled_mlp(schedule)
    x = torch.randn(3, 8)
    assert backend_mod.launch_compile_passes(0)
    compiled(x).backward()
    reference(x).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7)
    fwd, bwd = backend.profiling_results[0].fwd_graph, backend.profiling_results[0].bwd_graph
    moved = [n.args[0] for n in fwd.nodes if n.target is torch.ops.dc.offload_tensor.default]
    assert moved and all(n.next.target is torch.ops.dc.wait_offload.default for n in fwd.nodes
                         if n.target is torch.ops.dc.offload_tensor.default)
    output = next(n for n in fwd.nodes if n.op == "output").args[0]
    assert not set(moved) & set(output)  # the graph hands the backward the waits' host copies, not the values
    for value in moved:  # each copy starts right after the value's last forward reader
        readers = [u for u in value.users if u.target is not torch.ops.dc.offload_tensor.default]
        assert max(list(fwd.nodes).index(u) for u in readers) + 1 == list(fwd.nodes).index(
            next(u for u in value.users if u.target is torch.ops.dc.offload_tensor.default))
    reloads = [n for n in bwd.nodes if n.target is torch.ops.dc.wait_reload.default]
    assert len(reloads) == len(moved) and all(n.users for n in reloads)
    stats = act.get_offload_activation_stats()
    assert stats["offload_nodes"] == stats["reload_nodes"] == len(moved)
    buffers = {id(b) for b in act._host_buffers.values()}
    assert len(buffers) == len(moved) and sum(id(t) in buffers for t in received[0]) == len(moved)
    hidden = torch.relu(x @ reference.a.weight.T + reference.a.bias)  # the MLP's saved activation, at its value
    assert any(b.shape == hidden.shape and torch.equal(b, hidden) for b in act._host_buffers.values())
    # from WARMUP the planner: with room for everything, every value stays and the reloads go
    monkeypatch.setenv("DS_DC_OFFLOAD_ACT_BUDGET_GB", "100")
    assert backend_mod.launch_compile_passes(WARMUP)
    for p in reference.parameters():
        p.grad = None
    compiled(x).backward()
    reference(x).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7)
    result = backend.profiling_results[max(backend.profiling_results)]  # compiled again: the next graph id
    fwd, bwd = result.fwd_graph, result.bwd_graph
    assert not [n for n in list(fwd.nodes) + list(bwd.nodes) if str(n.target).startswith(("dc.offload", "dc.wait",
                                                                                             "dc.reload"))]
    assert act.get_offload_activation_stats()["planned_offloads"] == 0


def test_free_activation_releases_saved_values_after_their_last_backward_use(world_of_one) -> None:
    """``compile.free_activation``: the backward frees each saved activation of at least the threshold's bytes
    right after its last reader (its storage is gone before the backward returns); the caller's own input, saved
    too, is never freed; gradients unchanged. A threshold above every value frees nothing."""
    from dsrun.compile.passes import free_activation

    for threshold, expect_freed in ((0, True), (10 * 1024 * 1024, False)):
        received: list[torch.Tensor] = []

        def record(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd):
            if bwd:
                received.extend(create_inputs_fn())
            return gm

        reference, compiled, grads, backend = _compiled_mlp([(0, [zero3_compile.add_z3_gather_release, record])])
        backend.free_activation_threshold = threshold  # what init_z3 gives it from the compile section
        free_activation.freed.update(tensors=0, bytes=0)
        x = torch.randn(3, 8)
        compiled(x).backward()
        reference(x).backward()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7)
        hidden = [t for t in received if t is not x and t.shape != ()]  # the saved relu output and its kin
        frees = [n for n in backend.profiling_results[0].bwd_graph.nodes
                 if n.target is torch.ops.dc.free_tensors.default]
        assert x.numel() == 24  # the input is the caller's: kept
        if expect_freed:
            assert frees and free_activation.freed["tensors"] == sum(len(n.args[0]) for n in frees) > 0
            assert free_activation.freed["bytes"] >= 3 * 16 * 4  # the relu output at least
            assert any(t.numel() == 0 for t in hidden)  # released before the backward returned
        else:
            assert not frees and free_activation.freed["tensors"] == 0


def test_offload_parameters_moves_each_shard_out_after_its_last_use(world_of_one, monkeypatch) -> None:
    """``compile.offload_parameters``' pass: in both graphs each shard comes back just before its gather and goes to
    its host buffer right after the gathered value's release; its storage on the training device is freed there
    (at most one layer's shards resident at once, none between the graphs), the host copies hold its values, and
    the gradients are the plain model's, over two steps, the second after values written into the shards on the
    host (as the stage-3 step writes 16-bit shards). A gather that finds its shard on the host reloads it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from dsrun.compile.ops import ALLGATHER, OFFLOAD_PARAM, RELEASE, RELOAD_PARAM
    from dsrun.compile.passes import offload_parameters

    reference, compiled, grads, backend = _compiled_mlp([(0, [zero3_compile.add_z3_gather_release,
                                                              offload_parameters.offload_parameter_fwd])])
    handle = get_deepcompile_handle()
    handle.record_order = True
    params = list(handle.params.values())  # a.weight, a.bias, b.weight, b.bias
    total = sum(p.ds_numel for p in params) * 4
    x = torch.randn(3, 8)
    device_storages = [StorageWeakRef(p.ds_tensor.untyped_storage()) for p in params]  # where they start

    def watch_reloads(moves) -> None:  # the storage each reload makes on the device
        reload = moves.reload

        def move(ds_id: int) -> None:
            reload(ds_id)
            device_storages.append(StorageWeakRef(handle.params[ds_id].ds_tensor.untyped_storage()))

        monkeypatch.setattr(moves, "reload", move)

    for step in range(2):
        loss = compiled(x)
        moves = handle.param_moves  # made by the pass: each registered shard a unit of its own
        if step == 0:
            watch_reloads(moves)
        assert moves.resident_bytes() == 0 and moves.host_bytes() == total  # none left between the graphs
        assert all(ref.expired() for ref in device_storages)  # every device copy of a shard was freed
        loss.backward()
        assert moves.resident_bytes() == 0 and all(ref.expired() for ref in device_storages)
        if step == 0:
            moves.reset_stats()  # counted from here: step 1 starts with every shard on the host
        reference(x).backward()
        for name, p in reference.named_parameters():  # the same as the plain model's, step after step
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7)
            p.grad = None
        with torch.no_grad():
            for p, ref in zip(params, reference.parameters()):  # the round trips kept every shard's value
                assert torch.equal(p.ds_tensor, ref.detach().reshape(-1))
                # a step writes each (16-bit) shard where it is, on the host here: the next forward reads it
                p.ds_tensor.mul_(0.5)
                ref.mul_(0.5)
    # a step: the forward's four shards and the backward's one (b's weight, for the relu's gradient) come back and
    # go out
    assert (moves.stats.offloads, moves.stats.reloads, moves.stats.late_reloads) == (5, 5, 0)  # at step 1
    assert moves.stats.peak_resident_bytes == (8 * 16 + 16) * 4  # at most the larger layer's shards at once
    for graph in (backend.profiling_results[0].fwd_graph, backend.profiling_results[0].bwd_graph):
        for gather in [n for n in graph.nodes if n.target is ALLGATHER]:
            reload = gather.prev  # just before the gather, for the same parameter, whose token the gather reads
            assert reload.target is RELOAD_PARAM and reload.args[3] == gather.args[1] and gather.args[0] is reload
            (release,) = [u for u in gather.users if u.target is RELEASE]  # right after the release, reading the value
            assert release.next.target is OFFLOAD_PARAM and release.next.args[::2] == (gather, gather.args[1])
    ids = [p.ds_id for p in params]
    order = [(op, ids.index(ds_id)) for op, ds_id in handle.stats.order]
    for i in range(4):  # the forward's first steps: each shard back, gathered, released, out
        ops = [op for op, j in order if j == i][:4]
        assert ops == ["reload", "gather", "release", "offload"]
    # a gather that finds its shard on the host (a pass ordered its readers first) brings it back itself
    assert torch.equal(handle.allgather(params[0].ds_id), reference.a.weight.detach())
    assert moves.stats.late_reloads == 1 and moves.resident_bytes() == params[0].ds_numel * 4
    handle.cleanup()  # every shard back where it was, the host buffers gone
    assert all(p.ds_tensor.untyped_storage().data_ptr() != 0 for p in params) and handle.param_moves is None


def test_schedules_are_checked_against_the_contracts() -> None:
    assert resolve_schedule(None)[1][0] == 5  # DeepSpeed's default: the profile-driven passes from step 5
    with pytest.raises(ValueError, match="requires"):
        resolve_schedule([(0, ["prefetch"])])  # prefetch needs the gathers zero3_compile places
    with pytest.raises(ConfigError, match="unknown pass 'prefetchh'"):
        resolve_schedule([(0, ["zero3_compile", "prefetchh"])])
    # DeepSpeed's passes dsrun refuses: scheduled by name, each refused with its reason when it runs
    for name, function, reason in [("zero1_compile", "add_z1_reduce", "stage's hooks"),
                                   ("zero2_compile", "add_z2_reduce", "stage's hooks")]:
        refused = resolve_schedule([(0, [name])])[0][1][-1]
        assert refused.__name__ == function
        with pytest.raises(ConfigError, match=f"pass '{name}'.*{reason}"):
            refused(None, 0, [], {}, None, 0.0, {}, True)
    # the offload keys pick DeepSpeed's schedules, and init_z3 refuses, before touching the engine, the
    # optimizer-state pass beside ZeRO's optimizer offload, and two offload targets
    from types import SimpleNamespace

    from dsrun.compile.init import init_z3, schedule_for
    from dsrun.compile.passes import offload_adam_states
    from dsrun.config.misc import CompileConfig

    opt = schedule_for(CompileConfig(deepcompile=True, offload_opt_states=True))
    assert [step for step, _ in opt] == [0, 1] and opt[1][1][0] is offload_adam_states.offload_adam_states_for_init
    assert opt[1][1][-1] is offload_adam_states.move_opt_states
    from dsrun.compile.passes import offload_parameters

    assert schedule_for(CompileConfig(deepcompile=True, offload_parameters=True)) == [  # DeepSpeed's, from step 0
        (0, [zero3_compile.add_z3_gather_release, offload_parameters.offload_parameter_fwd])]
    with pytest.raises(ValueError, match="conflicts"):  # one offload target per schedule (the contracts)
        resolve_schedule([(0, ["zero3_compile", "offload_parameters", "offload_adam_states_sync"])])
    for keys, cpu_optimizer, bad in [({"offload_opt_states": True}, True, "offload_opt_states"),
                                     ({"offload_activation": True, "offload_opt_states": True}, False,
                                      "offload_activation"),
                                     ({"offload_parameters": True, "offload_opt_states": True}, False,
                                      "offload_parameters"),
                                     ({"offload_activation": True, "offload_parameters": True}, False,
                                      "offload_activation"),
                                     ({"free_activation": True}, False, "free_activation")]:
        engine = SimpleNamespace(zero_use_cpu_optimizer=lambda: cpu_optimizer)  # nothing else is reached
        with pytest.raises(ConfigError, match=f"compile.{bad}"):
            init_z3(engine, "inductor", CompileConfig(deepcompile=True, **keys), {})
    # the key with a schedule that leaves its pass out would do nothing: refused before the engine changes
    engine = SimpleNamespace(zero_use_cpu_optimizer=lambda: False)
    with pytest.raises(ConfigError, match="compile.offload_parameters.*no 'offload_parameters' pass"):
        init_z3(engine, "eager", CompileConfig(deepcompile=True, offload_parameters=True), {},
                schedule=[(0, ["zero3_compile"])])


def test_the_persistence_budget_leaves_the_transient_peak_and_a_margin() -> None:
    budget = selective_gather._compute_persistence_budget([[("a", 700, 0, 980)], [("b", 720, 20, 800)], []],
                                                           total_mem=1000, mem_margin=0.1)
    assert budget == {"usable_mem": 900, "peak_resident_alloc": 720, "transient_peak": 980, "available_mem": 0,
                      "profiled_list_count": 2}
    assert selective_gather._compute_persistence_budget([[("a", 100, 0, 300)]], 1000, 0.1)["available_mem"] == 600


def test_the_host_memory_figures_the_budget_reads() -> None:
    from dsrun.accelerator import get_accelerator

    accelerator = get_accelerator()
    assert 0 < accelerator.available_memory() <= accelerator.total_memory()


def _resident_moments(engine) -> int:
    """Bytes of Adam's moments the optimizer holds now (its host buffers not counted)."""
    return sum(v.nbytes for state in engine.optimizer.state.values() for k, v in state.items()
               if k in ("exp_avg", "exp_avg_sq"))


# the optimizer-state offload joins at step 1 (its states exist after step 0's update; DeepSpeed's for_init empties
# them before the profile), beside prefetch and selective gather
OFFLOAD_SCHEDULE = [(0, ["zero3_compile"]), (1, ["offload_adam_states_for_init", "zero3_compile",
                                                 "offload_adam_states", "prefetch", "selective_gather"])]


def _train(deepcompile: bool, stage: int = 3, offload: bool = False, double_buffer: bool = True,
           schedule: list | None = None, offload_parameters: bool = False) -> dict:
    from dsrun.compile.passes import offload_adam_states
    from dsrun.models.gpt import GPT
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              # buckets of 4096 elements: several per backward (the model has about 28k), for compile.double_buffer
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096},
              "compile": {"deepcompile": deepcompile, "offload_opt_states": offload, "double_buffer": double_buffer,
                          "offload_parameters": offload_parameters,
                          "sync_before_allgather": deepcompile, "sync_after_allgather": deepcompile,
                          "sync_before_reduce": deepcompile, "sync_after_reduce": deepcompile}}
    if offload_parameters:  # fp32: the shards are views of their sub-group's master, which moves: several here
        config["zero_optimization"]["sub_group_size"] = 4096
    torch._dynamo.reset()
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
    if offload_parameters:  # the key's own schedule (DeepSpeed's): zero3_compile and offload_parameters from step 0
        engine.compile(backend="eager")
    elif deepcompile:  # DeepSpeed's way: deepcompile, then compile()
        engine.compile(backend="eager", schedule=schedule or (OFFLOAD_SCHEDULE if offload else SCHEDULE))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1 + dsrun.comm.get_rank()))
    handle = get_deepcompile_handle()
    out = {"losses": [], "breaks": [], "graphs": [], "stats": [], "active": engine.is_deepcompile_active(),
           "moments": [], "shard_bytes": []}
    offload_adam_states.reset_offload_op_stats()
    moves = handle.param_moves  # compile.offload_parameters' units
    shard_bytes = (lambda: moves.resident_bytes()) if moves is not None else (lambda: None)
    for step in range(STEPS):
        counters.clear()
        handle.reset_stats()
        loss = engine(x, x)
        moments_in_forward, shards_in_forward = _resident_moments(engine), shard_bytes()
        engine.backward(loss)
        out["moments"].append((moments_in_forward, _resident_moments(engine)))
        shards_after_backward = shard_bytes()
        if stage == 3 and step == STEPS - 1:  # a checkpoint's masters, taken before the step (shards out, if moved)
            out["masters"] = torch.cat(engine.strategy.state_dict()["fp32_flat_groups"])
        engine.step()
        out["shard_bytes"].append((shards_in_forward, shards_after_backward, shard_bytes()))
        out["losses"].append(loss.item())
        out["breaks"].append(int(sum(counters["graph_break"].values())))
        out["graphs"].append(int(counters["stats"]["unique_graphs"]))
        s = handle.stats
        out["stats"].append((s.gathers, s.prefetched, s.persistent_hits, s.releases, s.reduced, s.peak_live_numel,
                             s.syncs, s.peak_reduces_in_flight))
    out["numel"] = sum(p.ds_numel for p in engine.strategy.params) if stage == 3 else 0
    out["shard_numel"] = sum(p.ds_partition_numel for p in engine.strategy.params) if stage == 3 else 0
    out["trainable"] = sum(1 for p in model.parameters() if p.requires_grad)
    out["offload"] = offload_adam_states.get_offload_op_stats()
    if moves is not None:
        out["units"], out["unit_bytes"], out["moves"] = len(moves.units), moves.total_bytes(), moves.stats
    engine.destroy()
    return out


def _two_rank_runs(rank: int, world_size: int) -> tuple[dict, dict, dict]:
    import os

    os.environ["DS_DC_OFFLOAD_OPT_BUDGET_GB"] = "0"  # a budget of 0: every state moves
    # compile.double_buffer off, with compile.offload_parameters: compiled once (the key's schedule; the
    # double buffer's waits are in the gradient intake, not in a pass)
    return _train(True, offload=True), _train(False), _train(True, double_buffer=False, offload_parameters=True)


def test_zero3_in_the_graph_trains_as_eager_zero3() -> None:
    """With ``compile.offload_opt_states`` (DeepCompile's optimizer-state offload, from step 1): the same losses,
    bit for bit, with Adam's moments gone from the optimizer from the forward's start until the backward's reload
    (the key's own schedule, without prefetch: ``test_schedules_are_checked_against_the_contracts``). With
    ``compile.double_buffer: false`` a gradient waits for the reduction in flight: one at most, not two; the same
    losses."""
    compiled, eager, single = run_ranks(_two_rank_runs, 2, timeout=180)[0]
    assert compiled["active"] and not eager["active"]
    assert compiled["losses"] == eager["losses"] == single["losses"]  # the same ops, gathered and reduced by the graph
    # compile.offload_parameters (the third engine): every shard's master (several sub-groups) on the host between
    # the forward and the backward and after the backward, none of its device storage left; all back for the step
    # and for a checkpoint, whose masters are eager ZeRO-3's, bit for bit
    assert single["units"] > 1 and single["unit_bytes"] == 4 * single["shard_numel"]
    assert single["shard_bytes"] == [(0, 0, single["unit_bytes"])] * STEPS
    assert single["moves"].late_reloads == 0 and single["moves"].recalls == single["units"] * STEPS
    assert single["moves"].offloads > single["units"] * STEPS  # each unit out in the forward, and again in the backward
    assert torch.equal(single["masters"], eager["masters"]) and torch.equal(compiled["masters"], eager["masters"])
    # double-buffered (the default): the bucket launched runs on while the next fills, the one before waited for
    assert [stats[-1] for stats in compiled["stats"]] == [2] * STEPS
    assert [stats[-1] for stats in single["stats"]] == [1] * STEPS
    assert [stats[4] for stats in single["stats"]] == [single["trainable"]] * STEPS
    assert compiled["breaks"] == [0] * STEPS  # none: the gathers are ops in the graph, not hooks
    assert compiled["graphs"] == [1, 1, 0]  # compiled at step 0 and again at step 1's passes
    for step, (gathers, prefetched, hits, releases, reduced, peak, syncs, _) in enumerate(compiled["stats"]):
        assert reduced == compiled["trainable"]  # every gradient reduce-scattered from the graph
        assert gathers + hits == releases  # each gathered value released
        assert syncs == 2 * releases + 2 * reduced  # compile.sync_*: one before and one after each gather, reduce
        assert gathers > 0 and peak < compiled["numel"]  # never the whole model gathered at once
        assert (prefetched > 0) == (step >= 1)  # the schedule: prefetch from step 1
        assert (hits > 0) == (step >= 2)  # selective gather decides at step 1's backward compile
    # AdamW's two fp32 moments of this rank's half of the parameters, in the optimizer after each backward;
    # between the forward's start and the backward's reload none from step 1 (step 0 has no states yet)
    moments = 2 * 4 * compiled["numel"] // 2
    assert compiled["moments"] == [(0, 0), (0, moments), (0, moments)]
    # the graph's ops ran: both moments (fp32: the master is the shards' storage, it stays) at steps 1 and 2
    assert compiled["offload"] == {"launches": 2 * 2, "reloads": 2 * 2}


@pytest.mark.usefixtures("world_of_one")
def test_deepcompile_falls_back_where_deepspeed_does() -> None:
    # stage 1: the stage's hooks reduce; ZeRO-3 over one rank keeps parameters whole: the torch compiler
    for stage in (1, 3):
        run = _train(True, stage)
        assert not run["active"] and run["graphs"][0] == 1 and run["breaks"][0] == 0
        assert run["losses"] == _train(False, stage)["losses"]


def test_the_aot_arguments_run_the_graph_maker_then_the_compiler() -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    from dsrun.compile.inductor import _patch_deepcompile_aot_kwargs
    from dsrun.compile.ops import ALLGATHER

    calls: list[str] = []

    def maker(tag: str):
        return lambda gm, inputs: calls.append(f"make {tag}") or gm.graph

    def compiler(gm, inputs):
        calls.append("compile")
        return gm

    partitioned: set[int] = set()
    kwargs = {"fw_compiler": compiler, "partition_fn": lambda joint, *a, **k: (joint, joint)}
    common = dict(graph_id=3, z3_partition=True, make_fw_graph=maker("fw"), make_bw_graph=maker("bw"),
                  real_inputs=(), param_indices=[], param_manager={}, frame_id=9, frames_partitioned=partitioned)
    assert _patch_deepcompile_aot_kwargs(kwargs, **common)
    assert kwargs["inference_compiler"] is kwargs["fw_compiler"]
    graph = torch.fx.Graph()
    gather = graph.call_function(ALLGATHER, (graph.placeholder("p"), 0))
    activation = graph.placeholder("x")
    # the full parameter's view and that view's downcast would hold its memory if saved for backward
    view = graph.call_function(torch.ops.aten.t.default, (gather,))
    cast = graph.call_function(torch.ops.prims.convert_element_type.default, (view, torch.bfloat16))
    product = graph.call_function(torch.ops.aten.mm.default, (activation, cast))  # a new value: min-cut's choice
    saved = graph.call_function(torch.ops.aten.neg.default, (activation,))
    saved.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    graph.output((product, saved))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    kwargs["fw_compiler"](gm, [])
    kwargs["bw_compiler"](gm, [])  # none was given: the forward's compiler, after the backward's maker
    assert calls == ["make fw", "compile", "make bw", "compile"]
    kwargs["partition_fn"](gm, [])
    assert gather.meta["recompute"] is CheckpointPolicy.MUST_RECOMPUTE and partitioned == {9}
    assert view.meta["recompute"] is cast.meta["recompute"] is CheckpointPolicy.MUST_RECOMPUTE
    assert "recompute" not in product.meta and saved.meta["recompute"] is CheckpointPolicy.MUST_SAVE
    assert all(n.meta["ac_graph_id"] == 1 for n in graph.nodes)  # what min-cut reads of a recomputed node
    untouched = {"fw_compiler": compiler}  # no partitioner (torch_xla's shape): left as it is
    assert not _patch_deepcompile_aot_kwargs(untouched, **common) and untouched == {"fw_compiler": compiler}


def test_planning_figures_agree_over_the_ranks_without_a_collective_under_the_fake_mode(world_of_one) -> None:
    """The passes reduce their figures (profile complete, memory budgets) while a graph compiles, under the
    compiler's fake mode: they come back as plain numbers, and a world of one sends nothing (a gloo all-reduce
    dispatched through the fake mode hung this file's free_activation test in CI)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsrun import comm
    from dsrun.compile.util import reduce_over_ranks

    before = comm.get_comms_stats().get("all_reduce", {}).get("count", 0)
    with FakeTensorMode():
        assert reduce_over_ranks([3, 1], "MIN", torch.int64) == [3, 1]
        assert backend_mod._sync_memory_profile_complete(False) is False
    assert comm.get_comms_stats().get("all_reduce", {}).get("count", 0) == before
