"""The support ledger's proof for keys whose effect shows only between ranks: two gloo ranks, one optimizer
step per config, every collective the engine issues recorded (op, dtype, elements, asynchronous or not).
Each ``test_key_changes_behaviour[KEY]`` compares a config with the key changed against the same config
without it. One launch runs every case."""
from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.helpers import run_ranks

BASE_ZERO = {"stage": 1, "reduce_bucket_size": 400, "allgather_bucket_size": 10**9, "overlap_comm": False}
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
CASES: dict[str, tuple[dict, dict]] = {  # key -> (zero_optimization changes, top-level changes)
    "base": ({}, {}),
    "zero_optimization.reduce_bucket_size": ({"reduce_bucket_size": 100}, {}),
    "zero_optimization.allgather_bucket_size": ({"allgather_bucket_size": 40}, {}),
    "zero_optimization.reduce_scatter": ({"reduce_scatter": False}, {}),
    "zero_optimization.overlap_comm": ({"overlap_comm": True}, {}),
    "communication_data_type": ({}, {"communication_data_type": "bf16"}),
    # the reduced gradients are summed, not averaged: SGD's step is twice as long on two ranks
    "sgd": ({}, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True}),
    "gradient_allreduce_op": ({}, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
                                   "gradient_allreduce_op": "sum"}),
    # ZeRO-3 over two steps (the second prefetches along the recorded trace), nothing persistent
    "base3": (dict(STAGE3, stage3_allgather_sequential=True), {}),
    "zero_optimization.stage3_allgather_sequential": (dict(STAGE3, stage3_allgather_sequential=False), {}),  # one per fetch
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": (dict(STAGE3, stage3_use_all_reduce_for_fetch_params=True,
                                                                   stage3_allgather_sequential=False), {}),
}
WRAPPED = ("all_reduce", "reduce_scatter", "all_gather", "all_gather_into_tensor")


def record_collectives(rank: int, world: int) -> dict[str, list[tuple]]:
    import torch
    import torch.nn.functional as F

    import dsrun
    from dsrun import comm

    calls: list[tuple] = []

    def wrap(name: str) -> Any:
        original = getattr(comm, name)

        def recorded(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            first = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
            calls.append((name, str(first.dtype), int(first.numel()), bool(kwargs.get("async_op", False))))
            return original(tensor, *args, **kwargs)
        return recorded

    results = {}
    for key, (zero, top) in CASES.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        # unclipped, so the step lengths compare (gradient_allreduce_op: sum steps twice as far as mean)
        config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 0.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {**BASE_ZERO, **zero}, **top}
        engine = dsrun.initialize(model=model, config=config)[0]
        saved = {name: getattr(comm, name) for name in WRAPPED}
        for name in WRAPPED:
            setattr(comm, name, wrap(name))
        before = torch.cat([p.detach().double().flatten() for p in model.parameters()])
        losses = []
        try:
            calls.clear()
            torch.manual_seed(1 + rank)
            for _ in range(2 if zero.get("stage") == 3 else 1):
                x, y = torch.randn(2, 16), torch.randn(2, 4)
                loss = F.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(("loss", loss.item()))
        finally:
            for name, original in saved.items():
                setattr(comm, name, original)
        after = torch.cat([p.detach().double().flatten() for p in model.parameters()])
        # the overflow and norm flags are single elements; the last entry is the step's length
        results[key] = [c for c in calls if c[2] > 1] + losses + [("step", float((after - before).norm()))]
    return results


@functools.lru_cache(maxsize=None)
def recorded() -> dict[str, list[tuple]]:
    return run_ranks(record_collectives, 2, timeout=300)[0]


def ops(key: str, name: str) -> list[tuple]:
    return [c for c in recorded()[key] if c[0] == name]


@pytest.mark.parametrize("key", [k for k in CASES if k not in ("base", "base3", "sgd")])
def test_key_changes_behaviour(key: str) -> None:
    base = recorded()["base"]
    assert base and recorded()[key] != base
    grads = len(ops("base", "reduce_scatter"))
    if key == "zero_optimization.reduce_bucket_size":  # 676 gradient elements in buckets of 100, not 400
        assert len(ops(key, "reduce_scatter")) > grads >= 2
    elif key == "zero_optimization.allgather_bucket_size":  # the updated partitions gathered in pieces
        assert len(ops(key, "all_gather")) > len(ops("base", "all_gather")) + len(ops("base", "all_gather_into_tensor"))
    elif key == "zero_optimization.reduce_scatter":  # all-reduce every bucket, keep the own piece
        assert not ops(key, "reduce_scatter") and len(ops(key, "all_reduce")) == grads
    elif key == "zero_optimization.overlap_comm":  # the reductions are launched asynchronously
        assert all(c[3] for c in ops(key, "reduce_scatter")) and not any(c[3] for c in ops("base", "reduce_scatter"))
    elif key == "gradient_allreduce_op":  # summed over 2 ranks: SGD's step doubles (fp32 rounding of ~1e-2 steps)
        step, mean_step = recorded()[key][-1][1], recorded()["sgd"][-1][1]
        assert step == pytest.approx(2 * mean_step, rel=1e-4) and mean_step > 0
    elif key == "zero_optimization.stage3_allgather_sequential":  # false: one all-gather per module fetch
        sequential = ops("base3", "all_gather_into_tensor")
        assert len(sequential) == 12 and len(ops(key, "all_gather_into_tensor")) == 6  # each Linear's weight + bias
        assert [c[2] for c in ops(key, "all_gather_into_tensor")] == [a[2] + b[2] for a, b in zip(sequential[::2],
                                                                                                  sequential[1::2])]
        assert ops(key, "loss") == ops("base3", "loss")  # bitwise: the same values gathered
    elif key == "zero_optimization.stage3_use_all_reduce_for_fetch_params":  # a sum of zero-padded shards
        assert not ops(key, "all_gather_into_tensor") and not ops(key, "all_gather")
        coalesced = ops("zero_optimization.stage3_allgather_sequential", "all_gather_into_tensor")
        assert [c[1:] for c in ops(key, "all_reduce")] == [c[1:] for c in coalesced]
        assert ops(key, "loss") == ops("base3", "loss")  # bitwise: 0 + x is exact
    elif key == "communication_data_type":  # gradients travel in bf16
        assert {c[1] for c in ops(key, "reduce_scatter")} == {"torch.bfloat16"}
        assert {c[1] for c in ops("base", "reduce_scatter")} == {"torch.float32"}
