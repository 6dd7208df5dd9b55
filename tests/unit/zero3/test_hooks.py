"""The parameter coordinator in one process: gather around each module, trace, reuse planning."""
from __future__ import annotations

import torch
from torch import nn

from dsrun.zero.hooks import ParameterCoordinator
from dsrun.zero.module_gathers import add_external_param, module_params
from dsrun.zero.partition_params import ParamStatus, partition_param


def _partitioned(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        partition_param(p)
    return model


def test_forward_and_backward_gather_and_release() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    _partitioned(model)
    coordinator = ParameterCoordinator(model, prefetch_bucket_size=0, max_reuse_distance=0)
    x = torch.randn(3, 4)
    coordinator.begin_forward()
    out = model(x)
    # after the forward every parameter is back to its shard
    assert all(p.ds_status is ParamStatus.NOT_AVAILABLE for p in model.parameters())
    out.sum().backward()
    coordinator.end_backward()
    reference(x).sum().backward()
    torch.testing.assert_close(out, reference(x))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)  # backward re-gathered the weights it needed
        assert p.ds_status is ParamStatus.NOT_AVAILABLE
    # the first forward+backward recorded the module order: forward 0, 2, then backward 2, 0
    ids = [id(model[0]), id(model[2])]
    assert coordinator.trace_complete
    assert coordinator.trace == [(ids[0], "fwd"), (ids[1], "fwd"), (ids[1], "bwd"), (ids[0], "bwd")]


def test_reuse_distance_keeps_the_last_layer_for_backward() -> None:
    model = _partitioned(nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)))
    coordinator = ParameterCoordinator(model, prefetch_bucket_size=0, max_reuse_distance=0)
    coordinator.begin_forward()
    model(torch.ones(1, 4)).sum().backward()
    coordinator.end_backward()
    coordinator.max_reuse_distance = 0
    coordinator._plan_reuse()
    # distance 0: only the last layer, used again by the very next event (its backward), is kept
    assert coordinator._keep_after == {1: {id(model[1].weight)}}
    coordinator.max_reuse_distance = 32  # the first layer is next used after layer 2 runs forward and backward (2 x 16)
    coordinator._plan_reuse()
    assert coordinator._keep_after == {0: {id(model[0].weight)}, 1: {id(model[1].weight)}}
    coordinator.begin_forward()
    model(torch.ones(1, 4))
    assert all(p.ds_status is ParamStatus.AVAILABLE for p in model.parameters())


def test_prefetch_gathers_the_next_modules_ahead() -> None:
    model = _partitioned(nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(4))))
    coordinator = ParameterCoordinator(model, prefetch_bucket_size=32, max_reuse_distance=0)
    for _ in range(2):  # the first pass records, the second follows the trace
        coordinator.begin_forward()
        model(torch.ones(1, 4)).sum().backward()
        coordinator.end_backward()
    assert coordinator.prefetched_numel > 0


def test_a_changed_module_order_drops_the_trace() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    model = _partitioned(nn.ModuleList([a, b]))
    coordinator = ParameterCoordinator(model, prefetch_bucket_size=100)
    coordinator.begin_forward()
    b(a(torch.ones(1, 2))).sum().backward()
    coordinator.end_backward()
    coordinator.begin_forward()
    out = a(b(torch.ones(1, 2)))  # another order: no prediction, still correct
    assert not coordinator.trace_complete
    out.sum().backward()
    coordinator.end_backward()
    assert not coordinator.trace_complete  # the pass that left the trace records nothing
    coordinator.begin_forward()
    a(b(torch.ones(1, 2))).sum().backward()
    coordinator.end_backward()
    assert coordinator.trace_complete and coordinator.trace[0] == (id(b), "fwd")


def test_external_parameters_are_gathered_for_the_module_that_uses_them() -> None:
    owner, user = nn.Linear(2, 2), nn.Identity()
    add_external_param(user, owner.weight)
    assert module_params(user) == []  # not a ZeRO parameter yet
    partition_param(owner.weight)
    assert module_params(user) == [owner.weight]


def test_max_live_parameters_bounds_prefetch_and_reuse() -> None:
    model = _partitioned(nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(4))))
    coordinator = ParameterCoordinator(model, prefetch_bucket_size=1000, max_live_parameters=20,
                                       max_reuse_distance=10**9)
    for _ in range(2):
        coordinator.begin_forward()
        out = model(torch.ones(1, 4))
        # one 16-element layer at a time fits under 20; keeping or prefetching a second one would not
        assert coordinator.total_numel == 64
        assert sum(p.ds_status is not ParamStatus.NOT_AVAILABLE for p in model.parameters()) <= 1
        out.sum().backward()
        coordinator.end_backward()
    assert coordinator.prefetched_numel == 0
