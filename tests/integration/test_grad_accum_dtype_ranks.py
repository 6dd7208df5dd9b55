"""``data_types.grad_accum_dtype`` on two ranks: ZeRO-1 accumulating a bf16 model's gradients in fp32 (DeepSpeed's
BF16_Optimizer: the fp32 sum is reduced in fp32) and ZeRO-2/3 accumulating their reduced partitions in bf16 each
equal, bit for bit, a plain-torch reference on the same rank that does the same arithmetic (the same payload
division, a sum over the two ranks in the same dtype, the same accumulation order), and hold the gradient bytes
counted in docs/precision.md. The single-process tests bound the difference between the two dtypes."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import run_ranks

MICRO_STEPS = 2
STEPS = 2
LR = 0.05


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _reference_step(model, masters, batches, accum: torch.dtype, per_micro_step: bool, world: int) -> None:
    """One optimizer step of the reference: the stage-1 way (each rank sums its micro-steps in ``accum``, then the
    sums are reduced) or the stage-2/3 way (each micro-step's bf16 gradient is reduced, then added in ``accum``)."""
    sums = [torch.zeros_like(m, dtype=accum) for m in masters]
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        (torch.nn.functional.mse_loss(model(x).float(), y) / MICRO_STEPS).backward()
        for total, p in zip(sums, model.parameters()):
            if per_micro_step:
                piece = p.grad / world  # the reduce-scatter's payload division, in the model's dtype
                torch.distributed.all_reduce(piece)
                total.add_(piece)
            else:
                total.add_(p.grad)
    if not per_micro_step:
        for total in sums:
            total.div_(world)
            torch.distributed.all_reduce(total)  # in the accumulator's dtype
    with torch.no_grad():
        for master, total, p in zip(masters, sums, model.parameters()):
            master.add_(total.float(), alpha=-LR)
            p.copy_(master)


def _both(rank: int, world_size: int) -> dict:
    import dsrun
    from dsrun.zero.stage3 import full_state_dict

    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own samples
    batches = [(x.bfloat16(), torch.sin(x[:, :4])) for x in
               (torch.randn(8, 16, generator=gen) for _ in range(STEPS * MICRO_STEPS))]
    results = {}
    for stage, accum in ((1, "fp32"), (2, "bf16"), (3, "bf16")):
        model = _model()
        config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": MICRO_STEPS,
                  "zero_allow_untested_optimizer": True, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": stage}, "data_types": {"grad_accum_dtype": accum}}
        engine = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)[0]
        gradient_bytes = engine.strategy.memory_breakdown().gradients
        for x, y in batches:
            engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
            engine.step()
        weights = full_state_dict(engine.module) if stage == 3 else engine.module.state_dict()
        engine_weights = [weights[name].clone() for name, _ in _model().named_parameters()]
        engine.destroy()
        reference = _model().bfloat16()
        masters = [p.detach().float() for p in reference.parameters()]
        dtype = torch.float32 if accum == "fp32" else torch.bfloat16
        for step in range(STEPS):
            _reference_step(reference, masters, batches[step * MICRO_STEPS:(step + 1) * MICRO_STEPS], dtype,
                            per_micro_step=stage >= 2, world=world_size)
        results[stage] = {"equal": all(torch.equal(a, b.detach()) for a, b in zip(engine_weights,
                                                                                  reference.parameters())),
                          "gradient_bytes": gradient_bytes}
    return results


@pytest.mark.parametrize("world", [2])
def test_grad_accum_dtype_on_two_ranks_equals_the_reference(world):
    trainable = sum(p.numel() for p in _model().parameters())  # 676: 2 x world divides it, no padding
    for rank in run_ranks(_both, world):
        assert all(rank[stage]["equal"] for stage in (1, 2, 3)), rank
        # stage 1: the whole bf16 gradient, the whole fp32 accumulator, the fp32 half it reduces into (the master
        # gradient itself); stages 2-3: their half of the gradient in bf16
        assert rank[1]["gradient_bytes"] == 2 * trainable + 4 * trainable + 4 * trainable // world
        assert rank[2]["gradient_bytes"] == 2 * trainable // world
        assert rank[3]["gradient_bytes"] >= 2 * trainable // world  # each parameter's shard padded to world
