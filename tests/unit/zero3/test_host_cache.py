"""The host cache (csrc/host_cache, :func:`dsrun.zero.host_memory.cache_large_blocks`): a freed block of 1 MiB or
more goes back to the next request of its size instead of to the OS, the cache never holds more than its cap,
small requests pass through, and ZeRO-3 on the CPU uses it without changing one bit of training."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import dsrun
from dsrun.utils.errors import ConfigError
from dsrun.zero import host_memory
from tests.helpers import run_ranks

MIB = 1 << 20


@pytest.fixture
def cache(monkeypatch):
    """The process's cache at a 8 MiB cap for the test, its earlier cap restored after."""
    monkeypatch.delenv("DSRUN_HOST_CACHE_MB", raising=False)
    before = host_memory.host_cache_stats().get("cap_bytes", 0)
    assert host_memory.cache_large_blocks(8 * MIB)
    yield
    monkeypatch.delenv("DSRUN_HOST_CACHE_MB", raising=False)
    host_memory.cache_large_blocks(before)


def _delta(before: dict, key: str) -> int:
    return host_memory.host_cache_stats()[key] - before[key]


def test_a_freed_large_block_serves_the_next_request_of_its_size(cache) -> None:
    block = torch.empty(MIB // 2)  # 2 MiB
    address = block.data_ptr()
    del block
    before = host_memory.host_cache_stats()
    again = torch.empty(MIB // 2)
    assert again.data_ptr() == address and _delta(before, "hits") == 1 and _delta(before, "misses") == 0
    other = torch.empty(3 * MIB // 4)  # 3 MiB: no cached block of its size
    assert _delta(before, "misses") == 1
    small = torch.empty(1000)  # below 1 MiB: torch's own allocator, not counted
    assert _delta(before, "hits") + _delta(before, "misses") == 2
    again.fill_(1.5)
    assert torch.equal(again, torch.full_like(again, 1.5)) and small.numel() == 1000 and other.numel() > 0


def test_the_cache_never_holds_more_than_its_cap(cache) -> None:
    blocks = [torch.empty(3 * MIB // 4) for _ in range(4)]  # 4 x 3 MiB, cap 8 MiB: two are kept
    before = host_memory.host_cache_stats()
    del blocks
    stats = host_memory.host_cache_stats()
    assert stats["cached_bytes"] <= 8 * MIB and stats["cached_bytes"] - before["cached_bytes"] >= 3 * MIB
    assert _delta(before, "returned") >= 1
    host_memory.cache_large_blocks(0)  # off: the cache empties
    assert host_memory.host_cache_stats()["cached_bytes"] == 0


def test_the_environment_sets_the_cap_and_a_bad_value_is_one_line(monkeypatch, cache) -> None:
    monkeypatch.setenv("DSRUN_HOST_CACHE_MB", "0")
    assert host_memory.cache_large_blocks(64 * MIB) is False
    assert host_memory.host_cache_stats()["cap_bytes"] == 0
    monkeypatch.setenv("DSRUN_HOST_CACHE_MB", "lots")
    with pytest.raises(ConfigError, match=r"DSRUN_HOST_CACHE_MB='lots': expected a size in MiB"):
        host_memory.cache_large_blocks(64 * MIB)


def _train(cache_mb: str) -> dict:
    import os

    os.environ["DSRUN_HOST_CACHE_MB"] = cache_mb
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 2048), nn.GELU(), nn.Linear(2048, 256))  # 2 MiB weights
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = dsrun.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    losses = []
    for _ in range(3):
        x = torch.randn(8, 256, generator=generator)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with dsrun.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    return {"losses": losses, "weights": weights, "stats": host_memory.host_cache_stats()}


def _without_then_with_the_cache(rank: int, world: int) -> tuple[dict, dict]:
    return _train("0"), _train("")  # "0": never installed; then the strategy's own cap


def test_zero3_on_the_cpu_reuses_blocks_and_trains_bit_for_bit_as_without() -> None:
    results = run_ranks(_without_then_with_the_cache, 2, timeout=180)
    # the cap: 6 modules' gathered bytes (HOST_CACHE_MODULES), the largest module 2048 x 256 + 2048 elements
    cap = 6 * (2048 * 256 + 2048) * 4
    for plain, cached in results:
        stats = cached["stats"]
        assert plain["stats"] == {}  # DSRUN_HOST_CACHE_MB=0: never installed
        assert stats["cap_bytes"] == cap and stats["peak_cached_bytes"] <= cap
        assert stats["hits"] > 0, stats  # the second and third steps reuse the first one's blocks
        assert cached["losses"] == plain["losses"]
        assert all(torch.equal(a, b) for a, b in zip(cached["weights"], plain["weights"]))


def test_torch_profiler_sees_the_caches_blocks_come_and_go(cache) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        block = torch.empty(MIB // 2)
        del block  # kept by the cache, but freed for the profiler as for torch's own allocator
        block = torch.empty(MIB // 2)  # a hit: allocated again
        del block
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert sizes.count(2 * MIB) == 2 and sizes.count(-2 * MIB) == 2, sizes
