"""The NVMe bytes a ZeRO-Infinity step moves, counted by the swap stores, equal what the step must move."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dsrun
from dsrun.zero.swap_traffic import SwapTraffic

pytestmark = pytest.mark.usefixtures("world_of_one")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _config(nvme: Path, **zero) -> dict:
    return {"train_batch_size": 4, "bf16": {"enabled": True}, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {
                "stage": 3, "sub_group_size": 300, "stage3_param_persistence_threshold": 0,
                # every module's parameters are released after use: each shard is read for forward and backward
                "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 8,
                                      "fast_init": True},
                "offload_param": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 2, "buffer_size": 512,
                                  "max_in_cpu": 0}, **zero}}


def _step(engine, gen: torch.Generator) -> float:
    x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
    loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_each_step_moves_the_bytes_the_arithmetic_says(tmp_path: Path):
    """P elements, bf16 model, AdamW, one micro-step: the shards are read for forward and for backward (2 + 2
    bytes) and written after the step (2); the gradient is written in bf16 (2) and read by the step (2); the
    fp32 master and the two moments are read (12, none of the moments on the first step: ``fast_init``) and
    written (12). The counters are the stores' own, and the monitor's events carry them."""
    engine = dsrun.initialize(model=_model(), config=_config(tmp_path))[0]
    numel = sum(p.ds_numel for p in engine.module.parameters())
    swapped = engine.strategy.placement.offloaded.swapped
    assert sum(u.numel for u in swapped.units) == numel and len(swapped.units) > 1
    gen = torch.Generator().manual_seed(1)
    per_step, grad_files = [], []
    for _ in range(3):
        _step(engine, gen)
        per_step.append(engine.observer.last_swap_io)
        grad_files.append(all(swapped.store.path(f"grad.{u.index}").is_file() for u in swapped.units))
    # zero_grad forgot the gradients but kept their files: the next step rewrites their blocks in place
    assert not any(k.startswith("grad.") for k in swapped.store.keys()) and all(grad_files)
    for step, io in enumerate(per_step):
        moments_read = 8 * numel if step > 0 else 0
        assert io.read_bytes == (2 + 2) * numel + (2 + 4) * numel + moments_read
        assert io.written_bytes == 2 * numel + 2 * numel + 12 * numel
    # requests: one per shard per read or write, one per sub-group file
    params, units = len(list(engine.module.parameters())), len(swapped.units)
    assert per_step[-1].reads == 2 * params + 4 * units and per_step[-1].writes == params + 4 * units
    assert SwapTraffic(engine.strategy).total().read_bytes >= sum(io.read_bytes for io in per_step)
    engine.destroy()


def test_no_nvme_offload_counts_nothing():
    config = {"train_batch_size": 4, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3}}
    engine = dsrun.initialize(model=_model(), config=config)[0]
    _step(engine, torch.Generator().manual_seed(1))
    assert not engine.observer.swap_traffic.active and engine.observer.last_swap_io is None
    engine.destroy()


def test_shards_read_ahead_on_lanes_train_bit_identically_to_shards_in_memory(tmp_path: Path):
    """Parameter shards read ahead on one read lane per pool buffer (each waited for alone) and copied into
    reused gather buffers give the same losses and parameters as shards kept in host memory, bit for bit,
    and the reads ahead are used."""
    def run(offload_param: dict) -> tuple[list[float], list[torch.Tensor], object]:
        # a gather-buffer pool: the private copies of the swapped shards are reused from it
        cfg = _config(tmp_path, offload_optimizer={"device": "cpu"}, offload_param=offload_param,
                      stage3_prefetch_bucket_size=10_000)
        engine = dsrun.initialize(model=_model(), config=cfg)[0]
        gen = torch.Generator().manual_seed(1)
        losses = [_step(engine, gen) for _ in range(3)]
        if offload_param["device"] == "nvme":
            assert engine.strategy.coordinator.buffer_pool.numel > 0  # released copies went back to the pool
        with dsrun.zero.GatheredParameters(list(engine.module.parameters())):
            params = [p.detach().clone() for p in engine.module.parameters()]
        offload = engine.strategy.param_offload
        stats = offload.stats() if offload.device == "nvme" else None
        lanes = offload.store.read_lanes if offload.device == "nvme" else None
        engine.destroy()
        return losses, params, (stats, lanes)

    nvme = run({"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3, "buffer_size": 512,
                "max_in_cpu": 0})
    host = run({"device": "cpu"})
    assert nvme[0] == host[0]
    assert all(torch.equal(a, b) for a, b in zip(nvme[1], host[1]))
    stats, lanes = nvme[2]
    assert lanes == 3 and stats["read_ahead_hits"] > 0


def test_each_shard_is_read_once_per_fetch_under_pool_pressure_and_prefetch(tmp_path: Path):
    """The 4B run's layout at 1/4096 of its size (width 64 for 4096, the vocabulary cut as much, so the token
    embedding is 3x the largest layer matrix as there; a prefetch bucket just below the attention matrix; a
    pool of 4 buffers): ZeRO-3's prefetch runs ahead of the read-ahead, and a shard read ahead for a fetch
    that finds its parameter still gathered used to hold a buffer until evicted and read again (1.69x the
    bytes here, 1.9x at 4B). Now a forward and a backward read each swapped shard once; the tied embedding is
    read twice in forward (token embedding, output layer) and stays gathered from the output layer's forward
    (reuse distance 0: its backward comes next) until its gradient is complete: 4 bytes per swapped bf16
    element per step, every read but the forward's first one read ahead."""
    from dsrun.models.gpt import GPT

    torch.manual_seed(0)
    width, vocab = 64, 785
    nvme = {"nvme_path": str(tmp_path), "device": "nvme"}
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {
                  "stage": 3, "stage3_prefetch_bucket_size": 50_000_000 // 4096,
                  "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 1000,
                  "offload_optimizer": {"device": "cpu"},
                  "offload_param": {**nvme, "buffer_count": 4, "buffer_size": vocab * width, "max_in_cpu": 0}}}
    with dsrun.zero.Init(config_dict_or_path=config):
        model = GPT(vocab_size=vocab, block_size=16, n_layer=3, n_head=2, n_embd=width)
    engine = dsrun.initialize(model=model, config=config)[0]
    offload = engine.strategy.param_offload
    swapped = [p for p in engine.module.parameters() if offload.swapped(p)]
    assert any(p is engine.module.transformer["wte"].weight for p in swapped) and len(swapped) == 2 + 4 * 3
    tokens = torch.randint(0, vocab, (1, 17), generator=torch.Generator().manual_seed(1))
    hits = []
    for _ in range(3):
        before = offload.read_ahead_hits
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
        hits.append(offload.read_ahead_hits - before)
    io = engine.observer.last_swap_io  # the parameter store's only: the optimizer is in memory
    assert io.read_bytes == 2 * 2 * sum(p.ds_numel for p in swapped)
    assert io.reads == 2 * len(swapped) and hits[-1] == io.reads - 1
    engine.destroy()


def test_super_offload_steps_during_backward_bit_identically_with_fewer_bytes(tmp_path: Path):
    """``offload_optimizer.super_offload`` on the 1/4096 copy of the 4B layout (tied embedding: its sub-group's
    gradient stays open through backward; several sub-groups; both offloads on NVMe): every sub-group is stepped
    during backward, from the second step on with its state read ahead in the order the first step closed them;
    the losses and the parameters after 3 steps equal the step-after-backward run's bit for bit; each step reads
    and writes exactly the bf16 gradient file less (2 + 2 bytes per element), everything else the same; with
    two micro-steps per step too (the boundary's gradient read back, added to, stepped at once). A second
    boundary backward before step() or a learning rate changed between backward and step() is an error, and the
    settings it cannot honour are refused."""
    from dsrun.models.gpt import GPT
    from dsrun.utils.errors import ConfigError

    width, vocab = 64, 785
    nvme = {"nvme_path": str(tmp_path), "device": "nvme"}

    def config(super_offload: bool, **top) -> dict:
        return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "steps_per_print": 1000,
                "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **top,
                "zero_optimization": {
                    "stage": 3, "sub_group_size": 3 * width * width, "stage3_max_reuse_distance": 0,
                    "stage3_prefetch_bucket_size": 50_000_000 // 4096, "stage3_param_persistence_threshold": 1000,
                    "offload_optimizer": {**nvme, "buffer_count": 8, "fast_init": True,
                                          "super_offload": super_offload},
                    "offload_param": {**nvme, "buffer_count": 4, "buffer_size": vocab * width, "max_in_cpu": 0}}}

    tokens = torch.randint(0, vocab, (1, 17), generator=torch.Generator().manual_seed(1))

    def run(super_offload: bool, gas: int = 1):
        torch.manual_seed(0)
        cfg = config(super_offload, gradient_accumulation_steps=gas)
        with dsrun.zero.Init(config_dict_or_path=cfg):
            model = GPT(vocab_size=vocab, block_size=16, n_layer=3, n_head=2, n_embd=width)
        engine = dsrun.initialize(model=model, config=cfg)[0]
        assert engine.super_offload() is super_offload  # DeepSpeed's getter
        swapped = engine.strategy.placement.offloaded.swapped
        losses, traffic, stepped = [], [], []
        for _ in range(3 if gas == 1 else 2 * gas):
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            if super_offload:
                stepped.append(set(swapped.backward_steps.stepped))
            engine.step()
            losses.append(loss.item())
            traffic.append(engine.observer.last_swap_io)
        with dsrun.zero.GatheredParameters(list(engine.module.parameters())):
            params = [p.detach().clone() for p in engine.module.parameters()]
        if super_offload and gas == 1:
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            with pytest.raises(RuntimeError, match="second boundary backward before step"):
                engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.strategy.optimizer.param_groups[0]["lr"] = 0.5  # after backward stepped with 1e-3
            with pytest.raises(RuntimeError, match="param group's lr changed between backward and step"):
                engine.step()
        units = {u.index: u.numel for u in swapped.units}
        hits = swapped.backward_steps.read_ahead_hits if super_offload else None
        engine.destroy()
        return losses, traffic, params, stepped, units, hits

    after, during = run(False), run(True)
    units = during[4]
    assert len(units) >= 4 and all(s == set(units) for s in during[3])  # each sub-group stepped inside backward
    assert during[5] >= 2 * (len(units) - 1)  # steps 2 and 3: all but the first read ahead (step 1: no order yet)
    assert during[0] == after[0] and all(torch.equal(a, b) for a, b in zip(during[2], after[2]))
    numel = sum(units.values())  # the optimizer's elements: each one's gradient went through a bf16 file
    for plain, overlapped in zip(after[1], during[1]):
        assert overlapped.read_bytes == plain.read_bytes - 2 * numel
        assert overlapped.written_bytes == plain.written_bytes - 2 * numel
    # two micro-steps per step: the first writes its fp32 gradient, the boundary's adds to it and steps at once
    after, during = run(False, gas=2), run(True, gas=2)
    assert during[3] == [set(), set(units)] * 2
    assert during[0] == after[0] and all(torch.equal(a, b) for a, b in zip(during[2], after[2]))
    for top, match in (({"gradient_clipping": 1.0}, "gradient_clipping"), ({"bf16": {"enabled": False},
                                                                             "fp16": {"enabled": True}}, "fp16")):
        with pytest.raises(ConfigError, match=f"super_offload.*{match}"):
            dsrun.initialize(model=torch.nn.Linear(4, 4), config=config(True, **top))
