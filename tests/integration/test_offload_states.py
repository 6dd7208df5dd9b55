"""``engine.offload_states()`` / ``reload_states()`` over 2 gloo ranks at ZeRO stages 1-3 (fp32 and bf16).

Each rank holds its own partitions of masters, optimizer states, gradients and (stage 3) parameters. Every CPU
tensor is counted as accelerator memory (``HostCopies.on_accelerator``), so the named states really go to new
host storage and back as they would on CUDA; after an offload of everything following a step, and of the
gradients between a backward and its step, both ranks' losses and fp32 masters equal those of the same run
without the round trips, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import run_ranks

CASES = [(stage, bf16) for stage in (1, 2, 3) for bf16 in (False, True)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _run(stage: int, bf16: bool, rank: int, round_trips: bool) -> tuple[list[float], list[torch.Tensor]]:
    import dsrun
    from dsrun.zero.offload_config import OffloadStateTypeEnum

    config = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "sub_group_size": 300,
                                    "stage3_param_persistence_threshold": 20}}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine = dsrun.initialize(model=_model(), config=config)[0]
    gen = torch.Generator().manual_seed(1 + rank)
    losses = []
    for step in range(4):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.module[0].weight.dtype)).float(), y)
        engine.backward(loss)
        if round_trips and step == 2:  # reduced gradients waiting for the step
            engine.offload_states(include=[OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.optim_states])
            engine.reload_states()
        engine.step()
        losses.append(loss.item())
        if round_trips and step == 1:
            engine.offload_states(non_blocking=True)
            assert engine.strategy.offloaded_states == set(OffloadStateTypeEnum)
            engine.reload_states(non_blocking=True)
    masters = [m.detach().clone() for m in engine.strategy.masters]
    engine.destroy()
    return losses, masters


def round_trips_rank(rank: int, world: int) -> dict:
    from dsrun.offload.state_moves import HostCopies

    HostCopies.on_accelerator = staticmethod(lambda tensor: tensor.device.type != "meta")  # this process only
    return {case: (_run(*case, rank, False), _run(*case, rank, True)) for case in CASES}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(round_trips_rank, 2, timeout=600)


@pytest.mark.parametrize("stage,bf16", CASES)
def test_two_ranks_train_on_bit_identically_after_round_trips(results, stage, bf16):
    for rank in results:
        (losses, masters), (moved_losses, moved_masters) = rank[(stage, bf16)]
        assert moved_losses == losses
        assert all(torch.equal(a, b) for a, b in zip(moved_masters, masters))
    assert results[0][(stage, bf16)][0][0] != results[1][(stage, bf16)][0][0]  # the ranks saw different data
