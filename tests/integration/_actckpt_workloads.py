"""Rank entry points for the activation-checkpointing multi-process tests (importable by spawned ranks).

``partition_suite``: two ranks form one model-parallel group; the same GPT and batch on both (as the
hidden states of a tensor-parallel transformer are identical across its group), checkpointed with the
activations partitioned, against the same run unpartitioned. ``zero_suite``: a GPT with frozen parameters,
every block checkpointed, trained under ZeRO 0-3 and offload, against ZeRO-0 without checkpointing.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from tests.harness.models import GPT_KW, flat_named, global_batch
from tests.harness.runs import full_params, train_steps
from tests.harness.runs import zero3_config as zero_ds_config

STEPS = 6


class WorldModelParallel:
    """An ``mpu`` whose model-parallel group is every rank (and each rank its own data-parallel group)."""

    def get_model_parallel_group(self) -> Any:
        return None  # the default group: the world

    def get_model_parallel_rank(self) -> int:
        from dsrun import comm

        return comm.get_rank()

    def get_model_parallel_world_size(self) -> int:
        from dsrun import comm

        return comm.get_world_size()


def saved_storages(fn: Any, module: torch.nn.Module) -> tuple[Any, list[int]]:
    """``fn()``'s result and the sizes (bytes) of the distinct non-parameter storages autograd saved meanwhile."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sorted(seen.values())


def _gpt_run(checkpoint_fn: Any) -> dict[str, Any]:
    from dsrun.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(**{**GPT_KW, "dropout": 0.1})
    if checkpoint_fn is not None:
        model.enable_activation_checkpointing(True, checkpoint_fn)
    inputs, targets = global_batch("nanogpt", 0, 4)
    torch.manual_seed(1)
    loss, storages = saved_storages(lambda: model(inputs, targets), model)
    loss.backward()
    return {"storages": storages, "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters()}}


def partition_suite(rank: int, world: int) -> dict[str, Any]:
    import dsrun.activation_checkpointing.api as ckpt
    from dsrun import comm
    from dsrun.utils.errors import ConfigError

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    comm.init_distributed(verbose=False)
    out: dict[str, Any] = {"none": _gpt_run(None)}
    for name, fn in (("reentrant", ckpt.checkpoint), ("non_reentrant", ckpt.non_reentrant_checkpoint)):
        ckpt.configure(None)
        out[f"whole/{name}"] = _gpt_run(fn)
        ckpt.configure(WorldModelParallel(), partition_activations=True)
        out[f"partitioned/{name}"] = _gpt_run(fn)
        for slots in (GPT_KW["n_layer"], GPT_KW["n_layer"] + 1):
            ckpt.configure(WorldModelParallel(), partition_activations=True, contiguous_checkpointing=True,
                           num_checkpoints=slots)
            out[f"contiguous{slots}/{name}"] = _gpt_run(fn)
        ckpt.configure(WorldModelParallel(), partition_activations=True, contiguous_checkpointing=True,
                       num_checkpoints=GPT_KW["n_layer"] - 1)
        try:
            _gpt_run(fn)
        except ConfigError as err:
            out[f"too_few_slots/{name}"] = str(err)
    return out


def build_frozen_gpt(mode: str) -> torch.nn.Module:
    """The ZeRO-3 suite's GPT with the token embedding (hence the tied head) and the first block frozen."""
    from dsrun.models.gpt import GPT

    torch.manual_seed(1234)
    model = GPT(**GPT_KW, activation_checkpointing=mode)
    model.transformer["wte"].requires_grad_(False)
    model.transformer["h"][0].requires_grad_(False)
    return model


def engine_run(model: torch.nn.Module, config: dict[str, Any], rank: int, world: int,
               initial: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Train ``model`` with dsrun for ``STEPS`` steps: the global mean losses, the full final parameters,
    whether the frozen ones still hold their ``initial`` values and every trainable one moved."""
    import dsrun

    engine, _, _, _ = dsrun.initialize(model=model, config=config)
    losses, _ = train_steps(engine, lambda step, size: global_batch("nanogpt", step, size), STEPS, rank, world)
    full = full_params(engine)
    params = dict(engine.module.named_parameters())
    frozen = [n for n, p in params.items() if not p.requires_grad]
    return {"losses": losses, "params": flat_named(full).numpy(),
            "frozen_unchanged": bool(frozen) and all(torch.equal(full[n], initial[n]) for n in frozen),
            "trained": all(not torch.equal(full[n], initial[n]) for n in params if n not in frozen)}


ZERO_CASES = {  # case -> (stage, model.activation_checkpointing, checkpoint function, zero_optimization extras)
    "0/none": (0, "none", None, {}), "0/full": (0, "full", None, {}),
    "1/none": (1, "none", None, {}), "1/full": (1, "full", None, {}),
    "2/none": (2, "none", None, {}), "2/every_2": (2, "every_2", None, {}),
    "3/none": (3, "none", None, {}), "3/full": (3, "full", None, {}),
    "3/selective": (3, "selective", None, {}), "3/reentrant": (3, "full", "reentrant", {}),
    "2+offload/none": (2, "none", None, {"offload_optimizer": {"device": "cpu"}}),
    "2+offload/full": (2, "full", None, {"offload_optimizer": {"device": "cpu"}}),
    "3+offload/none": (3, "none", None, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
    "3+offload/full": (3, "full", None, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
}


def plain_case(key: str) -> str:
    """The same stage and offload without checkpointing."""
    return key.split("/")[0] + "/none"


def zero_suite(rank: int, world: int) -> dict[str, Any]:
    import dsrun.activation_checkpointing.api as ckpt

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    initial = {n: p.detach().clone() for n, p in build_frozen_gpt("none").named_parameters()}
    results = {}
    for key, (stage, mode, fn, zero) in ZERO_CASES.items():
        model = build_frozen_gpt(mode)
        if fn == "reentrant":
            model.enable_activation_checkpointing(True, ckpt.checkpoint)
        results[key] = engine_run(model, zero_ds_config(stage, 2, 1, zero=zero), rank, world, initial)
    return results
