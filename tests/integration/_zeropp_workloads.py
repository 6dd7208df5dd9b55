"""Rank workloads for tests/integration/test_zeropp.py: ZeRO++'s quantized collectives on their own, and
stage-3 engines with and without zero_quantized_* counted by the comms logger. One launch runs every case."""
from __future__ import annotations

from typing import Any

import torch

IN, HIDDEN, OUT, STEPS, MICRO = 64, 256, 4, 3, 2


def collective_inputs(world: int, seed: int, shard: int = 300, chunk: int = 700) -> tuple[list, list]:
    """Every rank's all-gather shard (fp32) and reduce-scatter rows ((world, chunk) fp32), the same in
    every process."""
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(shard, generator=g) * (r + 1) for r in range(world)]
    rows = [torch.randn(world, chunk, generator=g) * torch.logspace(-2, 1, chunk) for _ in range(world)]
    return shards, rows


def collectives(rank: int, world: int, node_sizes: tuple[int, ...]) -> dict[str, Any]:
    """The quantized all-gather (synchronous and asynchronous, into bf16 too) and the quantized
    reduce-scatter for each ``node_sizes`` entry (ranks per node)."""
    from dsrun import comm
    from dsrun.comm import quantized as q

    comm.init_distributed("gloo")
    shards, rows = collective_inputs(world, seed=7)
    out: dict[str, Any] = {}
    gathered = torch.empty(world * shards[0].numel())
    q.quantized_all_gather_into_tensor(gathered, shards[rank])
    out["gather"] = gathered
    gathered16 = torch.empty(world * shards[0].numel(), dtype=torch.bfloat16)
    q.quantized_all_gather_into_tensor(gathered16, shards[rank], async_op=True).wait()
    out["gather_bf16"] = gathered16
    for node in node_sizes:
        reducer = q.make_reduce_scatter(None, node_size=node)
        result = torch.empty(rows[0].shape[1])
        reducer(result, rows[rank])
        out[f"reduce/{node}"] = (result, reducer.hierarchical)
    return out


def _model(freeze_first: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    if freeze_first:
        model[0].requires_grad_(False)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO, IN, generator=g), torch.randn(MICRO, OUT, generator=g)


ENGINE_CASES: dict[str, tuple[dict, bool, bool]] = {  # name -> (zero_optimization keys, bf16, freeze first layer)
    "plain": ({}, False, False),
    "qwz": ({"zero_quantized_weights": True}, False, False),
    "qgz": ({"zero_quantized_gradients": True}, False, False),
    "both": ({"zero_quantized_weights": True, "zero_quantized_gradients": True}, False, False),
    "plain_bf16": ({}, True, False),
    "both_bf16": ({"zero_quantized_weights": True, "zero_quantized_gradients": True}, True, False),
    "frozen": ({}, False, True),
    "frozen_nontrainable": ({"zero_quantized_nontrainable_weights": True}, False, True),
    "frozen_dequantized": ({}, False, True),  # plain, the frozen weights set to what the key keeps (below)
}
FROZEN_CASES = ("frozen", "frozen_nontrainable", "frozen_dequantized")


def kept_frozen_value(value: torch.Tensor, world: int) -> torch.Tensor:
    """What zero_quantized_nontrainable_weights keeps of a frozen weight: each rank's shard of the flat,
    zero-padded value quantized on its own (INT8, one scale per WEIGHT_BLOCK), decoded."""
    from dsrun.comm import quantized as q

    flat = value.detach().reshape(-1)
    part = -(-flat.numel() // world)
    padded = torch.cat([flat, flat.new_zeros(part * world - flat.numel())])
    shards = [q.dequantize(*q.quantize(padded[r * part:(r + 1) * part], 8, q.WEIGHT_BLOCK), q.WEIGHT_BLOCK)
              for r in range(world)]
    return torch.cat(shards)[:flat.numel()].view_as(value)


def _case_model(name: str, freeze: bool, world: int) -> torch.nn.Module:
    model = _model(freeze)
    if name == "frozen_dequantized":
        with torch.no_grad():
            for p in model[0].parameters():
                p.copy_(kept_frozen_value(p, world))
    return model


def engines(rank: int, world: int) -> dict[str, Any]:
    """Per case: the losses of STEPS steps and the comms logger's message bytes per (op, size)."""
    import dsrun
    from dsrun import comm

    out: dict[str, Any] = {"collectives": collectives(rank, world, (world, 1))}
    for name, (zero, bf16, freeze) in ENGINE_CASES.items():
        config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "bf16": {"enabled": bf16},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "overlap_comm": True, **zero}}
        engine = dsrun.initialize(model=_case_model(name, freeze, world), config=config)[0]
        comm.reset_comms_stats()
        hidden: list[torch.Tensor] = []
        hook = engine.module[0].register_forward_hook(lambda m, i, o: hidden.append(o.detach().clone()))
        losses = _train(engine, rank, range(STEPS))
        hook.remove()
        sizes: dict[str, dict[int, int]] = {}
        for (op, size), stats in comm.comms_logger.by_size.items():
            sizes.setdefault(op, {})[size] = stats.count
        out[name] = {"losses": losses, "sizes": sizes}
        if name == "qwz":
            out[name]["exact"] = _gathers_exact_values(engine)
        if name in FROZEN_CASES:
            out[name].update(first_hidden=hidden[0], parameter_bytes=engine.memory_breakdown().parameters,
                             trainable=_full_values(engine.module[2]), frozen=_full_values(engine.module[0]))
        if name == "frozen_nontrainable":
            out[name]["resume"] = _resume(engine, rank, lambda: _case_model(name, freeze, world), config)
    return out


def _train(engine: Any, rank: int, steps: Any) -> list[float]:
    import torch.nn.functional as F

    losses = []
    for step in steps:
        x, y = batch(step, rank)
        x, y = x.to(engine.module[0].weight.dtype), y.to(engine.module[0].weight.dtype)
        loss = F.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _full_values(module: torch.nn.Module) -> list[torch.Tensor]:
    from dsrun.zero.partition_params import full_tensor

    return [full_tensor(p) for p in module.parameters()]


def _resume(engine: Any, rank: int, make_model: Any, config: dict) -> dict[str, Any]:
    """Save, train two more steps; a fresh engine whose weights were all halved loads the checkpoint and
    trains the same two steps: losses, weights and the kept INT8 messages, before and after."""
    import os
    import shutil
    import tempfile

    import dsrun
    from dsrun import comm
    from dsrun.zero import quantized_shards

    path = os.path.join(tempfile.gettempdir(), f"dsrun_zpp_resume_{os.environ['MASTER_PORT']}")
    messages = lambda e: [quantized_shards.message_of(p).clone() for p in e.module[0].parameters()]  # noqa: E731
    engine.save_checkpoint(path, tag="t")
    saved = messages(engine)
    losses = _train(engine, rank, range(STEPS, STEPS + 2))
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    fresh = dsrun.initialize(model=model, config=config)[0]
    changed = [not torch.equal(a, b) for a, b in zip(messages(fresh), saved)]
    fresh.load_checkpoint(path, tag="t")
    loaded = [torch.equal(a, b) for a, b in zip(messages(fresh), saved)]
    resumed = _train(fresh, rank, range(STEPS, STEPS + 2))
    comm.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {"losses": losses, "resumed": resumed, "changed_before_load": changed, "loaded_exactly": loaded,
            "weights": _full_values(engine.module), "resumed_weights": _full_values(fresh.module)}


def _gathers_exact_values(engine: Any) -> bool:
    """Under qwZ, GatheredParameters (and so saving full weights) sees the exact shards, and writing a
    gathered value back (modifier_rank) leaves them as they were."""
    import dsrun
    from dsrun.utils import safe_get_full_fp32_param

    params = list(engine.module.parameters())
    before = [p.ds_tensor.clone() for p in params]
    with dsrun.zero.GatheredParameters(params, modifier_rank=0):
        full = [p.data.clone() for p in params]
    exact = all(torch.equal(f, safe_get_full_fp32_param(p)) for f, p in zip(full, params))
    return exact and all(torch.equal(b, p.ds_tensor) for b, p in zip(before, params))
