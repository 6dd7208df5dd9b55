"""ZeRO-Infinity parameter offload (``offload_param`` cpu | nvme, stage 3) over 2 gloo ranks.

Parity: every offloaded run (parameters to CPU or NVMe, alone or with the optimizer offloaded to CPU or
NVMe) tracks the same run without offload within the bound between two runs derived from the arithmetic
(tests/tolerance.py: ``2 K x`` the spread of valid orderings of the PyTorch reference around
its wider-precision run, for fp32 and for bf16; parameter offload alone gives identical numbers, the CPU
optimizer and the fused 16-bit write-back of optimizer offload differ in rounding only). Also: a model built
under ``zero.Init`` with NVMe offload trains like one built whole; a checkpoint of an NVMe-offloaded run
resumes exactly, offloaded or not; the swap files are gone afterwards; and with NVMe offload a rank's RSS is
lower by the shards it no longer holds. The runs are ``Case`` records (tests/harness/runs.py), run with the
checkpoint round trip by one 2-rank launch.
"""
from __future__ import annotations

import functools
import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness.launch import Launch
from tests.harness.models import build_model, global_batch, loss_terms
from tests.harness.runs import Case, reference_run, train_steps, world_suite, zero3_config
from tests.helpers import run_ranks
from tests import tolerance as t

STEPS = 5


def nvme(root: str, **extra: Any) -> dict[str, Any]:
    """An NVMe ``offload_param`` section with a pool small enough that shards are evicted and read again."""
    return {"device": "nvme", "nvme_path": root, "buffer_count": 3, "buffer_size": 4096, "max_in_cpu": 0,
            **extra}


def nvme_optimizer(root: str) -> dict[str, Any]:
    return {"sub_group_size": 3000,
            "offload_optimizer": {"device": "nvme", "nvme_path": root, "buffer_count": 12}}


def offload_cases(root: str) -> list[Case]:
    """Every case trains dsrun's GPT (``nanogpt``) at stage 3 with the ZeRO-3 tests' buckets; ``ref`` and
    ``bf16_ref`` are the same runs without offload. Each engine is destroyed after its run (its swap files)."""
    bf16 = {"bf16": {"enabled": True}}
    runs = {  # case -> (zero_optimization extras, top-level extras, build under zero.Init)
        "ref": ({}, {}, False),
        "cpu": ({"offload_param": {"device": "cpu", "pin_memory": True}}, {}, False),
        "nvme": ({"offload_param": nvme(root)}, {}, False),
        # every shard cached in host memory after its first read; prefetch off
        "nvme_cached": ({"offload_param": nvme(root, max_in_cpu=10**9), "stage3_prefetch_bucket_size": 0}, {},
                        False),
        "nvme_init": ({"offload_param": nvme(root)}, {}, True),
        "bf16_ref": ({}, bf16, False),
        "bf16_nvme": ({"offload_param": nvme(root)}, bf16, False),
        # with optimizer offload (dsrun/offload/shard_store.py) as well: ZeRO-Offload / ZeRO-Infinity
        "both_cpu": ({"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}, {}, False),
        # the CPU optimizer steps 3000-element tiles: shards that straddle two tiles are written in parts
        "opt_cpu_param_nvme": ({"offload_param": nvme(root), "sub_group_size": 3000,
                                "offload_optimizer": {"device": "cpu"}}, {}, False),
        "both_nvme": ({"offload_param": nvme(root), **nvme_optimizer(root)}, {}, True),
        "both_nvme_bf16": ({"offload_param": nvme(root), **nvme_optimizer(root)}, bf16, True),
    }
    return [Case(key, "nanogpt", zero3_config(3, 2, 1, zero=zero, **top), zero_init=zero_init, steps=STEPS,
                 destroy=True) for key, (zero, top, zero_init) in runs.items()]


def _build(cfg: dict[str, Any], zero_init: bool) -> Any:
    import dsrun
    from dsrun import comm

    comm.init_distributed(verbose=False)
    if zero_init:
        with dsrun.zero.Init(config_dict_or_path=cfg):
            model = build_model("nanogpt")
    else:
        model = build_model("nanogpt")
    engine, _, _, _ = dsrun.initialize(model=model, config=cfg)
    return engine


def _batch(step: int, size: int) -> Any:
    return global_batch("nanogpt", step, size)


def offload_suite(rank: int, world: int, root: str, ckpt_dir: str) -> dict[str, Any]:
    """Rank entry point: every case, the checkpoint round trip, then the swap files left behind."""
    out = world_suite(rank, world, offload_cases(root))
    out["ckpt"] = checkpoint_round_trip(rank, world, root, ckpt_dir)
    out["leftover"] = sorted(str(p) for p in Path(root).rglob("*.swp"))
    return out


def checkpoint_round_trip(rank: int, world: int, root: str, ckpt_dir: str) -> dict[str, list[float]]:
    """Train 3 steps with NVMe parameter offload, save, train 2 more; then a fresh offloaded engine and a
    fresh in-memory one load the checkpoint and train the same 2 steps."""
    cfg = zero3_config(3, 2, 1, zero={"offload_param": nvme(root)})
    first = _build(cfg, zero_init=True)
    train_steps(first, _batch, 3, rank, world)
    first.save_checkpoint(ckpt_dir, tag="ckpt")
    later = lambda step, size: _batch(step + 3, size)  # noqa: E731
    cont, _ = train_steps(first, later, 2, rank, world)
    first.destroy()  # its swap files go now, not when the process exits
    results = {"continued": cont}
    for name, config in (("loaded_nvme", cfg), ("loaded_plain", zero3_config(3, 2, 1))):
        engine = _build(config, zero_init=False)
        engine.load_checkpoint(ckpt_dir, tag="ckpt")
        results[name], _ = train_steps(engine, later, 2, rank, world)
        engine.destroy()
    return results


@functools.lru_cache(maxsize=None)
def spread(dtype: torch.dtype = torch.float32) -> t.Spread:
    def run(d: torch.dtype, parts: int, reverse: bool) -> dict:
        return reference_run("nanogpt", STEPS, 4, 0.0, d, parts, reverse)
    return t.spread(run, dtype, loss_terms("nanogpt", 4))


def launches(root) -> dict:
    return {"suite": Launch(offload_suite, 2, (f"{root}/nvme", f"{root}/ckpt"), timeout=300)}


@pytest.fixture(scope="module")
def results(runs) -> list[dict]:
    return runs["suite"]


@pytest.mark.parametrize("case", ["cpu", "nvme", "nvme_cached", "nvme_init", "both_cpu", "opt_cpu_param_nvme",
                                  "both_nvme"])
def test_fp32_offloaded_runs_track_the_in_memory_run(results: list[dict], case: str) -> None:
    ref, got = results[0]["ref"], results[0][case]
    # final parameters too: Adam turns rounding noise of near-zero gradients into visible parameter noise, in
    # PyTorch's own orderings as in dsrun's, which the spread measures
    t.assert_tracks(got, ref, spread(), case, against="run")
    np.testing.assert_array_equal(results[1][case]["params"], got["params"])  # both ranks gather the same


@pytest.mark.parametrize("case", ["bf16_nvme", "both_nvme_bf16"])
def test_bf16_nvme_tracks_bf16_in_memory(results: list[dict], case: str) -> None:
    ref, got = results[0]["bf16_ref"], results[0][case]
    t.assert_tracks(got, ref, spread(torch.bfloat16), case, against="run", what=("losses",))


def test_nvme_shards_leave_memory_and_are_read_ahead(results: list[dict]) -> None:
    for rank_result in results:
        nvme, ref = rank_result["nvme"], rank_result["ref"]
        assert nvme["device"] == "nvme"
        assert nvme["memory"]["parameters"] < ref["memory"]["parameters"]  # only persistent ones stay
        stats = nvme["stats"]
        assert stats["swapped_params"] > 0 and stats["cached_numel"] == 0  # max_in_cpu=0: nothing cached
        assert stats["buffers"] <= 3  # never more than buffer_count buffers
        assert stats["read_ahead_hits"] > 0  # the recorded order let reads start before their use
        assert stats["read_bytes"] > 0 and stats["written_bytes"] > 0
        cached = rank_result["nvme_cached"]["stats"]
        assert cached["cached_numel"] > 0 and cached["read_bytes"] < stats["read_bytes"]


def test_checkpoint_of_an_nvme_offloaded_run_resumes_exactly(results: list[dict]) -> None:
    # the exact fp32 masters and Adam moments come back, and offloaded fp32 steps equal in-memory ones exactly
    # (test_offload_parity): the continued curve is the same numbers
    ckpt = results[0]["ckpt"]
    assert ckpt["loaded_nvme"] == ckpt["continued"] and ckpt["loaded_plain"] == ckpt["continued"]


def test_swap_files_are_removed_when_the_store_closes(results: list[dict]) -> None:
    for rank_result in results:
        assert rank_result["leftover"] == []


ALLOCATOR_SLACK = 16 * 2**20  # heap pages glibc keeps after malloc_trim differ by this much between runs


RSS_GPT = dict(vocab_size=256, block_size=32, n_layer=16, n_head=8, n_embd=512)


def rss_run(rank: int, world: int, offload: dict[str, Any] | None, root: str) -> dict[str, Any]:
    """Rank entry point: build a 50M-parameter bf16 GPT under zero.Init, train 2 steps; return this rank's RSS
    afterwards. ``offload``: keys added to ``zero_optimization`` (None: everything in memory).

    The in-memory run opens an (unused) swap store too, so both processes load the async I/O library and
    start its threads: the difference between them is where the shards live, not the cost of the library."""
    import psutil

    import dsrun
    from dsrun.models.gpt import GPT
    from dsrun.offload.swap_store import SwapStore
    from dsrun.zero import host_memory

    idle_store = SwapStore(root, rank=rank) if offload is None else None

    zero = {"stage": 3, "stage3_param_persistence_threshold": 10_000, "reduce_bucket_size": 1_000_000,
            "sub_group_size": 1_000_000}
    if offload is not None:
        zero.update(offload)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
           "steps_per_print": 1000}
    dsrun.comm.init_distributed(verbose=False)
    torch.manual_seed(0)
    with dsrun.zero.Init(config_dict_or_path=cfg):
        model = GPT(**RSS_GPT)
    engine, _, _, _ = dsrun.initialize(model=model, config=cfg)

    def batch(step: int, size: int) -> Any:
        tokens = torch.randint(0, 256, (size, 17), generator=torch.Generator().manual_seed(step))
        return (tokens[:, :-1], tokens[:, 1:])

    losses, _ = train_steps(engine, batch, 2, rank, world)
    engine.empty_partition_cache()
    gc.collect()
    host_memory.trim()
    owner = engine.strategy.param_offload
    placement = getattr(engine.strategy, "placement", None)  # stage 3: the stores of its sub-groups
    swapped = getattr(placement and placement.offloaded, "swapped", None)  # NVMe optimizer offload (masters and states)
    result = {"rss": psutil.Process().memory_info().rss, "losses": losses,
              "offloaded": owner.offloaded_bytes() if owner is not None else 0,
              "pool": owner.buffer_bytes() if owner is not None else 0,
              "optimizer_swapped": swapped.swapped_bytes if swapped is not None else 0,
              "optimizer_pool": swapped.resident_bytes if swapped is not None else 0}
    engine.destroy()
    if idle_store is not None:
        idle_store.close()
    return result


@pytest.mark.slow
def test_nvme_offload_lowers_resident_memory_by_the_offloaded_state(tmp_path) -> None:
    """Per-rank RSS (psutil) after two steps of a 50M-parameter bf16 GPT built under zero.Init, against the
    same run in memory (both runs load the async I/O library, see ``rss_run``):

    * NVMe parameters: lower by the bf16 shards now in files, less the read pool that replaces them and an
      allocator slack of 16 MiB (measured: 34-46 MiB saved of 48 MiB of shards, pool 4.6 MiB);
    * NVMe parameters and optimizer (ZeRO-Infinity): lower by at least the shards plus the swapped fp32
      masters and Adam states, less both pools.
    """
    nvme = str(tmp_path)
    params = {"offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4, "buffer_size": 600_000,
                                "max_in_cpu": 0}}
    both = {**params, "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4}}
    in_memory = run_ranks(rss_run, 2, None, nvme, timeout=240)
    param_only = run_ranks(rss_run, 2, params, nvme, timeout=240)
    infinity = run_ranks(rss_run, 2, both, nvme, timeout=240)
    for mem, off, inf in zip(in_memory, param_only, infinity):
        assert off["offloaded"] > 40 * 2**20  # about 48 MiB of bf16 shards per rank
        saved = mem["rss"] - off["rss"]
        assert saved >= off["offloaded"] - off["pool"] - ALLOCATOR_SLACK, (saved, off["offloaded"], off["pool"])
        offloaded = inf["offloaded"] + inf["optimizer_swapped"]
        assert inf["optimizer_swapped"] > 200 * 2**20  # fp32 masters + two moments: 12 B per element
        saved = mem["rss"] - inf["rss"]
        assert saved >= offloaded - inf["pool"] - inf["optimizer_pool"], (saved, offloaded)
        # where the shards and states live does not change the arithmetic: the same bf16 values read back, the
        # same fp32 Adam kernel, bf16 written round-to-nearest-even in both
        assert off["losses"] == mem["losses"], (off["losses"], mem["losses"])
        assert inf["losses"] == mem["losses"], (inf["losses"], mem["losses"])
