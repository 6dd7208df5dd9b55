"""DeepSpeed's capability-checked collectives (``allgather_fn``, ``reduce_scatter_fn``,
``has_all_gather_into_tensor``, ``has_reduce_scatter_tensor``) and ``TorchBackend``, in a one-rank gloo world
(tests/integration/test_zero3_leaf_modules.py gathers across two ranks). Each call is counted by the comms
logger like dsrun's own collectives."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from dsrun import comm
from dsrun.comm import comm as comm_module
from tests.unit.runtime import conftest as _runtime

world_of_one = _runtime.world_of_one


def test_the_capability_checks_refuse_before_init_as_deepspeed_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comm_module, "is_initialized", lambda: False)
    for check in (comm.has_all_gather_into_tensor, comm.has_reduce_scatter_tensor):
        with pytest.raises(AssertionError, match="DeepSpeed backend not set"):
            check()
    with pytest.raises(AssertionError, match="init_process_group"):
        comm.allgather_fn(torch.zeros(2), torch.zeros(2))


@pytest.mark.usefixtures("world_of_one")
def test_allgather_fn_and_reduce_scatter_fn_use_the_single_tensor_collectives() -> None:
    assert comm.has_all_gather_into_tensor() and comm.has_reduce_scatter_tensor()
    comm.reset_comms_stats()
    out = torch.zeros(3)
    assert comm.allgather_fn(out, torch.tensor([1.0, 2.0, 3.0]), debug="caller") is None  # synchronous: no work
    assert out.tolist() == [1.0, 2.0, 3.0]
    work = comm.allgather_fn(out, torch.tensor([4.0, 5.0, 6.0]), async_op=True)
    work.wait()
    assert out.tolist() == [4.0, 5.0, 6.0]
    reduced = torch.zeros(2)
    comm.reduce_scatter_fn(reduced, torch.tensor([7.0, 8.0]), prof=True)
    assert reduced.tolist() == [7.0, 8.0]
    stats = comm.get_comms_stats()
    assert stats["all_gather"]["count"] == 2 and stats["reduce_scatter"]["count"] == 1


@pytest.mark.usefixtures("world_of_one")
def test_without_the_single_tensor_collectives_they_fall_back_to_the_list_forms(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without ``all_gather_into_tensor`` / ``reduce_scatter_tensor``: DeepSpeed's fallbacks."""
    monkeypatch.setattr(comm_module, "_all_gather_single", None)
    monkeypatch.setattr(comm_module, "_reduce_scatter_single", None)
    assert not comm.has_all_gather_into_tensor() and not comm.has_reduce_scatter_tensor()
    assert comm.TorchBackend.get_all_gather_function() is None
    assert comm.TorchBackend.get_reduce_scatter_function() is None
    out = torch.zeros(2)
    comm.allgather_fn(out, torch.tensor([1.5, 2.5]))
    assert out.tolist() == [1.5, 2.5]  # gathered through all_gather into out's pieces
    reduced = torch.zeros(2)
    comm.reduce_scatter_fn(reduced, torch.tensor([3.0, 4.0]))
    assert reduced.tolist() == [3.0, 4.0]


@pytest.mark.usefixtures("world_of_one")
def test_torch_backend_hands_out_the_functions_deepspeed_calls_by_torchs_keyword_names() -> None:
    gather = comm.TorchBackend.get_all_gather_function()  # a class method: scripts call it on the class
    assert gather is not None
    comm.reset_comms_stats()
    out = torch.zeros(2)
    gather(output_tensor=out, input_tensor=torch.tensor([1.0, 2.0]), group=None, async_op=False)
    assert out.tolist() == [1.0, 2.0] and comm.get_comms_stats()["all_gather"]["count"] == 1
    scatter = comm.TorchBackend.get_reduce_scatter_function()
    reduced = torch.zeros(2)
    scatter(reduced, torch.tensor([5.0, 6.0]))
    assert reduced.tolist() == [5.0, 6.0]

    backend = comm.TorchBackend("gloo", timedelta(minutes=5), None)  # the world exists: nothing new is joined
    assert backend.is_initialized() and backend.initialized and backend.name == "torch"
    assert backend.has_all_gather_into_tensor() and backend.has_reduce_scatter_tensor()
    assert (backend.get_rank(), backend.get_world_size(), backend.get_backend()) == (0, 1, "gloo")
    assert not backend.using_mpi
    tensor = torch.tensor([2.0, 3.0])
    backend.all_reduce(tensor)
    backend.broadcast(tensor, 0)
    assert tensor.tolist() == [2.0, 3.0]
    pieces = [torch.zeros(2)]
    backend.all_gather(pieces, tensor)
    assert pieces[0].tolist() == [2.0, 3.0]
    backend.barrier()
