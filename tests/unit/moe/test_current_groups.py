"""One copy of each process group: DeepSpeed's module-level getters (``deepspeed.utils.groups``) answer from the
run's one ProcessGroups (``dsrun.comm.groups.current_groups``), the engine's once it exists."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.comm import ProcessGroups
from dsrun.comm.groups import current_groups, set_current_groups
from dsrun.moe.layer import MoE
from dsrun.utils import groups

pytestmark = pytest.mark.usefixtures("world_of_one")


@pytest.fixture(autouse=True)
def _fresh_groups():
    groups._reset()
    yield
    groups._reset()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.moe = MoE(4, torch.nn.Linear(4, 4), num_experts=2, k=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0].pow(2).mean()


def test_expert_and_sequence_getters_read_the_engines_groups() -> None:
    engine, *_ = dsrun.initialize(model=Net(), config={"train_batch_size": 4,
                                                      "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    assert current_groups() is engine.groups
    assert engine.groups.expert_sizes() == [1]
    assert groups._get_expert_parallel_group("ep_size_1") is engine.groups.expert(1)
    assert groups._get_expert_data_parallel_group_dict() == {"ep_size_1": engine.groups.expert_data(1)}
    assert groups._get_sequence_data_parallel_group() is engine.groups.data
    assert groups._get_sequence_parallel_group() is engine.groups.sequence
    engine.destroy()
    assert current_groups() is None
    assert groups._get_sequence_parallel_world_size() == 1 and groups._get_max_expert_size() is None
    with pytest.raises(KeyError, match="ep_size_1"):
        groups._get_expert_parallel_group("ep_size_1")


def test_groups_made_before_an_engine_are_the_runs_and_carry_over_to_the_next() -> None:
    groups._create_expert_and_data_parallel(1)
    first = current_groups()
    assert isinstance(first, ProcessGroups) and groups._get_max_expert_size_name() == "ep_size_1"
    second = ProcessGroups()
    set_current_groups(second)
    assert current_groups() is second and second.expert_sizes() == [1]
    assert groups._get_expert_parallel_group("ep_size_1") is second.expert(1)
