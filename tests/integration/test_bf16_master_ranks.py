"""bf16 master state (``bf16.bf16_master_weights_and_grads`` + ``bf16_optimizer_states``) on two ranks at ZeRO 1-3:
each rank holds half of the bf16 masters and moments, the all-gather (stages 1-2) or the gather (stage 3) gives
both ranks the same bf16 model, and the losses stay within the single-process test's bound of the fp32-master run
(tests/unit/runtime/test_bf16_master_state.py derives it)."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import run_ranks

STEPS = 6
UNIT_ROUNDOFF = 2.0 ** -8


def _train_both(rank: int, world_size: int, stage: int) -> dict:
    import dsrun
    from dsrun.zero.stage3 import full_state_dict

    results = {}
    for low in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
        trainable = sum(p.numel() for p in model.parameters())
        bf16 = {"enabled": True, "bf16_master_weights_and_grads": low, "bf16_optimizer_states": low}
        config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1e6, "bf16": bf16,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
        engine = dsrun.initialize(model=model, config=config)[0]
        gen = torch.Generator().manual_seed(1 + rank)  # each rank its own samples
        teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
        losses, grad_norms, weight_norms = [], [], []
        for _ in range(STEPS):
            x = torch.randn(8, 16, generator=gen)
            loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), torch.tanh(x @ teacher))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            grad_norms.append(float(engine.get_global_grad_norm()))
            square = torch.stack([m.detach().float().square().sum() for m in engine.strategy.masters]).sum()
            torch.distributed.all_reduce(square)  # the ranks' partitions are disjoint: the whole model's
            weight_norms.append(math.sqrt(float(square)))
        full = full_state_dict(engine.module) if stage == 3 else {k: v.clone() for k, v in
                                                                  engine.module.state_dict().items()}
        states = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        results[low] = {"losses": losses, "grad_norm": max(grad_norms), "weight_norm": max(weight_norms),
                        "full": full, "master_dtypes": {str(m.dtype) for m in engine.strategy.masters},
                        "state_elements": sum(v.numel() for v in states),
                        "state_dtypes": {str(v.dtype) for v in states}, "trainable": trainable}
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_master_state_on_two_ranks(stage):
    ranks = run_ranks(_train_both, 2, stage)
    for rank in ranks:
        low, ref = rank[True], rank[False]
        assert low["master_dtypes"] == low["state_dtypes"] == {"torch.bfloat16"}
        # this rank's half of the two moments (stages 1-2 pad to 2 x world size elements)
        assert 2 * low["trainable"] / 2 <= low["state_elements"] <= 2 * (low["trainable"] / 2 + 4)
        bound = ref["grad_norm"] * 2 * STEPS * UNIT_ROUNDOFF * ref["weight_norm"]
        assert max(abs(a - b) for a, b in zip(low["losses"], ref["losses"])) <= bound
    for name, value in ranks[0][True]["full"].items():  # both ranks hold the same bf16 model
        assert value.dtype == torch.bfloat16 and torch.equal(value, ranks[1][True]["full"][name])
