"""Activation checkpointing across processes: partitioned activations over a model-parallel group of two
(with the contiguous buffer and ``number_checkpoints``), and ZeRO 0-3, offload and frozen parameters.

``partition_suite``: two ranks form one model-parallel group; the same GPT and batch on both (as the hidden
states of a tensor-parallel transformer are identical across its group), checkpointed with the activations
partitioned, against the same run unpartitioned. ``ZERO_CASES``: the GPT with frozen parameters
(``frozen_gpt/<mode>`` of tests/harness/models.py), every block checkpointed, trained under ZeRO 0-3 and
offload, against the same stage without checkpointing (``Case`` records, tests/harness/runs.py).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from dsrun.profiling.tensor_memory import SavedTensorBytes
from tests.harness.launch import Launch
from tests.harness.models import GPT_KW, global_batch
from tests.harness.models import NANOGPT_SEQ as SEQ
from tests.harness.runs import Case, world_suite, zero3_config

# one block's input: the 4 x 16 tokens of the global batch, n_embd floats each
INPUT_BYTES = 4 * SEQ * GPT_KW["n_embd"] * 4
LAYERS = GPT_KW["n_layer"]
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


def _gpt_run(checkpoint_fn: Any) -> dict[str, Any]:
    from dsrun.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(**{**GPT_KW, "dropout": 0.1})
    if checkpoint_fn is not None:
        model.enable_activation_checkpointing(True, checkpoint_fn)
    inputs, targets = global_batch("nanogpt", 0, 4)
    torch.manual_seed(1)
    with SavedTensorBytes(exclude=model.parameters()) as saved:
        loss = model(inputs, targets)
    loss.backward()
    return {"storages": saved.sizes, "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters()}}


def partition_suite(rank: int, world: int) -> dict[str, Any]:
    """Rank entry point: the GPT's gradients and saved storages without checkpointing, checkpointed whole,
    partitioned, and partitioned into a contiguous buffer of enough and of too few slots."""
    import dsrun.activation_checkpointing.api as ckpt
    from dsrun import comm
    from dsrun.utils.errors import ConfigError

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


CPU_OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
ZERO_CASES = [  # key "<stage>/<mode>": the model frozen_gpt/<mode>, "<stage>+offload/<mode>" with CPU offload
    Case(f"{stage}{suffix}/{mode}", f"frozen_gpt/{mode}", zero3_config(stage, 2, 1, zero=zero), steps=STEPS)
    for stage, suffix, zero, modes in (
        (0, "", {}, ("none", "full")), (1, "", {}, ("none", "full")), (2, "", {}, ("none", "every_2")),
        (3, "", {}, ("none", "full", "selective", "reentrant")),
        (2, "+offload", CPU_OFFLOAD, ("none", "full")),
        (3, "+offload", {**CPU_OFFLOAD, "offload_param": {"device": "cpu"}}, ("none", "full")))
    for mode in modes]


def plain_case(key: str) -> str:
    """The same stage and offload without checkpointing."""
    return key.split("/")[0] + "/none"


LAUNCHES = {"partition": Launch(partition_suite, 2, timeout=300),
            "zero": Launch(world_suite, 2, (ZERO_CASES,), timeout=600)}


@pytest.fixture(scope="module")
def partition_results(runs) -> list[dict]:
    return runs["partition"]


@pytest.fixture(scope="module")
def zero_results(runs) -> list[dict]:
    return runs["zero"]


@pytest.mark.parametrize("fn", ["reentrant", "non_reentrant"])
def test_partitioned_activations_halve_what_each_rank_keeps_with_identical_gradients(partition_results, fn):
    for rank_result in partition_results:
        reference = rank_result["none"]["grads"]
        runs = {kind: rank_result[f"{kind}/{fn}"] for kind in ("whole", "partitioned", "contiguous2", "contiguous3")}
        for kind, run in runs.items():
            for name, grad in reference.items():
                np.testing.assert_array_equal(run["grads"][name], grad, err_msg=f"{kind}: {name}")
        whole, parted = Counter(runs["whole"]["storages"]), Counter(runs["partitioned"]["storages"])
        # each block's input (INPUT_BYTES) is kept as this rank's half
        assert whole - parted == Counter({INPUT_BYTES: LAYERS})
        assert parted - whole == Counter({INPUT_BYTES // 2: LAYERS})
        # contiguous: the halves live in one buffer of number_checkpoints slots
        for slots in (2, 3):
            contiguous = Counter(runs[f"contiguous{slots}"]["storages"])
            assert parted - contiguous == Counter({INPUT_BYTES // 2: LAYERS})
            assert contiguous - parted == Counter({slots * INPUT_BYTES // 2: 1})
        assert "number_checkpoints: 1 slots, but this forward makes checkpoint call 2" in \
            rank_result[f"too_few_slots/{fn}"]


def test_zero_stages_offload_and_frozen_parameters_train_as_without_checkpointing(zero_results):
    """Checkpointing changes no arithmetic: each checkpointed run is bitwise the run of the same stage
    without it (the ZeRO-3 parameters gathered again for the recompute, the frozen ones never updated)."""
    results = zero_results[0]
    for key in (case.key for case in ZERO_CASES):
        plain = results[plain_case(key)]
        np.testing.assert_array_equal(results[key]["losses"], plain["losses"], err_msg=key)
        np.testing.assert_array_equal(results[key]["params"], plain["params"], err_msg=key)
        assert results[key]["frozen_unchanged"] and results[key]["trained"], key


def test_zero3_with_non_reentrant_checkpointing_and_frozen_parameters_matches_zero0(zero_results):
    """ZeRO-3 and ZeRO-0 sum the same two gradients (a two-term sum does not depend on the order) and
    apply AdamW element by element, so they differ only where a compiled kernel rounds an element
    differently by its position in a shard (one ulp of one update, ~2^-24 * lr): over 6 steps the losses,
    means of 32 token losses near 5.5, move by orders of magnitude less than 1e-6 of themselves."""
    results = zero_results[0]
    zero3, zero0 = results["3/full"], results["0/none"]
    np.testing.assert_allclose(zero3["losses"], zero0["losses"], rtol=1e-6, atol=0)
    assert zero3["trained"] and zero3["frozen_unchanged"]
