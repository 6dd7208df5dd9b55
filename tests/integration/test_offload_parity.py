"""Optimizer offload (CPU at stages 1-3, NVMe at stage 3) over 2 gloo ranks tracks the in-memory runs.

fp32: losses track single-process PyTorch at each step within the bound derived from the arithmetic
(tests/tolerance.py: ``(K + 1) x`` the spread of valid fp32 orderings of the reference around
its float64 run; the in-memory stages meet the same bound in test_engine_parity / test_zero3_parity), and
offloaded runs equal the in-memory run of their stage exactly (the same CPU Adam kernel on the same numbers).
bf16: stage-3 NVMe and stage-2 CPU offload against in-memory bf16 ZeRO-3, within the bound between two runs
that round differently (``2 K x`` the spread of PyTorch's own bf16 runs; observed: identical, the fused 16-bit
write rounds like the in-memory copy). Resident memory: NVMe offload's RSS is below the in-memory run's by at
least the bytes of the offloaded fp32 masters and Adam states. The parity runs are ``Case`` records
(tests/harness/runs.py), run by one 2-rank launch.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness.launch import Launch
from tests.helpers import run_ranks
from tests import tolerance as t
from tests.harness.models import loss_terms
from tests.harness.runs import Case, ds_config, reference_run, world_suite

STEPS = 8
FP32_CASES = ["cpu/1", "cpu/2", "cpu/3", "nvme/3", "nvme_fast/3", "ratio/3"]
BF16_CASES = ["base_bf16/3", "nvme_bf16/3", "cpu_bf16/2"]
GAS_CASES = ["nvme_gas/3"]


def offload_section(device: str, nvme_path: str | None = None, **extra: Any) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": True, **extra}
    if device == "nvme":
        section["nvme_path"] = nvme_path
        section.setdefault("buffer_count", 12)
    return section


def offload_config(stage: int, offload: dict[str, Any] | None, bf16: bool = False, gas: int = 1,
                   **extra: Any) -> dict[str, Any]:
    """``ds_config`` with sub-groups of 3000 elements, nothing persistent at stage 3 and ``offload`` as the
    ``offload_optimizer`` section (None: in memory)."""
    zero: dict[str, Any] = {"sub_group_size": 3000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload is not None:
        zero["offload_optimizer"] = offload
    return ds_config(stage, 2, gas, zero=zero, **({"bf16": {"enabled": True}} if bf16 else {}), **extra)


def offload_cases(nvme_path: str) -> list[Case]:
    """Each offloaded run and the in-memory run it must track (the GPT of tests/harness/models.py)."""
    nvme = functools.partial(offload_section, "nvme", nvme_path)
    configs = {
        "base/3": offload_config(3, None),
        **{f"cpu/{stage}": offload_config(stage, offload_section("cpu")) for stage in (1, 2, 3)},
        "nvme/3": offload_config(3, nvme()),
        "nvme_fast/3": offload_config(3, nvme(fast_init=True, buffer_count=4)),
        "ratio/3": offload_config(3, offload_section("cpu", ratio=0.5)),
        "base_bf16/3": offload_config(3, None, bf16=True),
        "nvme_bf16/3": offload_config(3, nvme(), bf16=True),
        "cpu_bf16/2": offload_config(2, offload_section("cpu"), bf16=True),
        "nvme_gas/3": offload_config(3, nvme(buffer_count=5), gas=2, gradient_clipping=0.05),
    }
    return [Case(key, "gpt", cfg, steps=STEPS) for key, cfg in configs.items()]


def launches(root) -> dict:
    return {"parity": Launch(world_suite, 2, (offload_cases(str(root)),), timeout=600, rank=0)}


@pytest.fixture(scope="module")
def suite(runs) -> dict:
    return runs["parity"]


@functools.lru_cache(maxsize=None)
def spread(global_size: int, clip: float = 0.0, dtype: torch.dtype = torch.float32) -> t.Spread:
    def run(d: torch.dtype, parts: int, reverse: bool) -> dict:
        return reference_run("gpt", STEPS, global_size, clip, d, parts, reverse)
    return t.spread(run, dtype, loss_terms("gpt", global_size))


def test_fp32_cpu_and_nvme_offload_track_pytorch_and_in_memory(suite):
    s = spread(4)
    for key in ["base/3"] + FP32_CASES:
        t.assert_tracks(suite[key], s.reference, s, key, what=("losses",))
    for key in ("cpu/3", "nvme/3", "nvme_fast/3", "ratio/3"):
        assert suite[key]["losses"] == suite["base/3"]["losses"], key
        np.testing.assert_array_equal(suite[key]["params"], suite["base/3"]["params"])


def test_gradient_accumulation_and_clipping_with_nvme(suite):
    s = spread(8, 0.05)
    t.assert_tracks(suite["nvme_gas/3"], s.reference, s, "nvme_gas/3", what=("losses", "norms"))


def test_bf16_offload_tracks_in_memory_bf16(suite):
    s = spread(4, dtype=torch.bfloat16)
    for key in ("nvme_bf16/3", "cpu_bf16/2"):
        t.assert_tracks(suite[key], suite["base_bf16/3"], s, key, against="run", what=("losses",))


def resident_memory(rank: int, world: int, nvme_path: str | None, steps: int = 2) -> dict[str, Any]:
    """Rank entry point: train a ~20M-parameter GPT in bf16 at ZeRO-3 (NVMe optimizer offload when
    ``nvme_path``); this rank's RSS (psutil) after the steps, and the bytes its swap files hold."""
    import psutil

    import dsrun
    from dsrun.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=2048, block_size=16, n_layer=6, n_head=8, n_embd=512, dropout=0.0)
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 250_000,
                            "reduce_bucket_size": 500_000, "stage3_prefetch_bucket_size": 500_000}
    if nvme_path:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 12}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero, "steps_per_print": 1000}
    engine, *_ = dsrun.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 2048, (2, 17), generator=gen)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    from dsrun.zero import host_memory

    host_memory.trim()
    placement = getattr(engine.strategy, "placement", None)  # stage 3: the stores of its sub-groups
    swapped = getattr(placement and placement.offloaded, "swapped", None)
    return {"rss": psutil.Process().memory_info().rss, "losses": losses,
            "swapped_bytes": swapped.swapped_bytes if swapped is not None else 0,
            "trainable": sum(sg.numel for sg in engine.strategy.sub_groups),
            "memory": engine.memory_breakdown().as_dict()}


@pytest.mark.slow
def test_nvme_offload_lowers_resident_memory_by_the_offloaded_states(tmp_path):
    in_memory = run_ranks(resident_memory, 2, None, timeout=300)
    nvme = run_ranks(resident_memory, 2, str(tmp_path), timeout=300)
    for rank, (mem, off) in enumerate(zip(in_memory, nvme)):
        offloaded = 12 * off["trainable"]  # fp32 master + exp_avg + exp_avg_sq per trainable element
        assert off["swapped_bytes"] == offloaded
        saved = mem["rss"] - off["rss"]
        assert saved >= offloaded, (f"rank {rank}: RSS {mem['rss'] / 2**20:.0f} MiB in memory vs "
                                    f"{off['rss'] / 2**20:.0f} MiB with NVMe: saved {saved / 2**20:.0f} MiB, "
                                    f"offloaded {offloaded / 2**20:.0f} MiB")
        # the same fp32 Adam kernel on the same gradients, bf16 written round-to-nearest-even in both: the
        # offload moves where the states live, not the arithmetic
        assert off["losses"] == mem["losses"], (off["losses"], mem["losses"])
