"""Optimizer offload in one process: which strategy runs, clear errors, the pipelines' ordering, accounting."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import dsrun
from dsrun.ops.cpu_optimizer import CPUOptimizer
from dsrun.offload.pipeline import StepPipeline, run_swap_pipeline
from dsrun.utils.errors import ConfigError

pytestmark = pytest.mark.usefixtures("world_of_one")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _config(stage: int, offload: dict, optimizer: str = "AdamW", **extra) -> dict:
    zero = {"stage": stage, "sub_group_size": 100, "offload_optimizer": offload,
            "stage3_param_persistence_threshold": 0}
    params = {"lr": 0.01, "betas": [0.9, 0.99]} if optimizer == "Lion" else {"lr": 0.01}
    return {"train_batch_size": 4, "optimizer": {"type": optimizer, "params": params},
            "zero_optimization": zero, "steps_per_print": 1000, **extra}


def _train(engine, steps: int = 3) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.module[0].weight.dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", ["AdamW", "Adagrad", "Lion"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cpu_offload_steps_on_the_cpu_optimizer_like_in_memory(stage: int, optimizer: str):
    clip = {"gradient_clipping": 0.05}  # active: the norm of the host gradients is taken
    engine = dsrun.initialize(model=_model(), config=_config(stage, {"device": "cpu"}, optimizer, **clip))[0]
    assert type(engine.strategy).__name__ == f"Stage{stage}Strategy"  # the stage's own, its state on the host
    host = engine.strategy.store if stage < 3 else engine.strategy.placement.offloaded
    assert type(host).__name__ == ("HostFlatStore" if stage < 3 else "HostShardStore")
    assert isinstance(engine.optimizer, CPUOptimizer)
    offloaded = _train(engine)
    assert engine.get_global_grad_norm() > 0.05
    reference = dsrun.initialize(model=_model(), config=_config(stage, {"device": "none"}, optimizer, **clip))[0]
    if optimizer != "AdamW":  # in memory the torch versions run: same math, different rounding order
        torch.testing.assert_close(offloaded, _train(reference), rtol=1e-5, atol=0)
    else:
        assert offloaded == _train(reference)
    assert engine.strategy.last_step_times.units > 1  # sub_group_size 100: several tiles were pipelined


def test_nvme_offload_keeps_states_in_files(tmp_path: Path):
    cfg = _config(3, {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 12}, bf16={"enabled": True})
    engine = dsrun.initialize(model=_model(), config=cfg)[0]
    swapped = engine.strategy.placement.offloaded.swapped
    assert swapped.depth == 3 and len(swapped.units) > 2
    _train(engine, 2)
    keys = set(swapped.store.keys())
    for unit in swapped.units:
        assert {f"master.{unit.index}", f"exp_avg.{unit.index}", f"exp_avg_sq.{unit.index}"} <= keys
    assert not any(k.startswith("grad.") for k in keys)  # zero_grad dropped the step's gradients
    mem = engine.memory_breakdown()
    assert mem.master_weights == 0 and mem.optimizer_states == 0 and mem.gradients == 0
    # the swap buffers, plus the reduce-scatter buffers ZeRO-3 keeps for the next step's buckets
    reduce_buffers = engine.strategy.bucket_pool_bytes()
    assert 0 < mem.buffers <= 12 * swapped.pool.numel * 4 + 3 * swapped.pool.numel * 2 + reduce_buffers
    assert swapped.last_times.units == len(swapped.units)
    folder = swapped.store.folder
    engine.destroy()
    assert not folder.exists()


def test_clear_errors():
    with pytest.raises(ConfigError, match="zero_force_ds_cpu_optimizer: ZeRO-Offload needs DeepSpeedCPUAdam"):
        dsrun.initialize(model=_model(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                         config=_config(2, {"device": "cpu"}, zero_allow_untested_optimizer=True))
    # allowed when asked for: SGD steps the host partitions / sub-groups like in memory
    for stage in (2, 3):
        losses = []
        for device in ("cpu", "none"):
            engine = dsrun.initialize(model=_model(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                      config=_config(stage, {"device": device}, zero_force_ds_cpu_optimizer=False,
                                                     zero_allow_untested_optimizer=True))[0]
            losses.append(_train(engine, 3))
        assert losses[0] == losses[1] and losses[0][2] != losses[0][0]
    with pytest.raises(ConfigError, match="buffer_count: got 3"):
        dsrun.initialize(model=_model(), config=_config(3, {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 3}))
    with pytest.raises(ConfigError, match="NVMe optimizer offload needs ZeRO stage 3"):
        dsrun.initialize(model=_model(), config=_config(2, {"device": "nvme", "nvme_path": "/tmp"}))
    with pytest.raises(ConfigError, match="ratio"):
        dsrun.initialize(model=_model(), config=_config(2, {"device": "cpu", "ratio": 0.5}))


def test_swap_pipeline_overlaps_reads_and_writes_with_compute():
    for depth in (1, 2, 3):
        log: list[str] = []
        in_flight = {"r": [], "w": []}

        def issue_read(i): in_flight["r"].append(i); log.append(f"R{i}")
        def wait_reads(): log.append(f"wr{in_flight['r']}"); in_flight["r"].clear()
        def compute(i): log.append(f"C{i}|r{in_flight['r']}|w{in_flight['w']}")
        def issue_write(i): in_flight["w"].append(i); log.append(f"W{i}")
        def wait_writes(): in_flight["w"].clear()

        times = run_swap_pipeline(4, depth, issue_read, wait_reads, compute, issue_write, wait_writes)
        # the waits split into reads and writes: the same positive terms summed in two groupings, equal within
        # one rounding per term (at most 2 per unit + 2)
        split = times.extra["waiting_reads"] + times.extra["waiting_writes"]
        assert abs(split - times.waiting) <= (2 * 4 + 2) * sys.float_info.epsilon * times.waiting
        computes = [e for e in log if e.startswith("C")]
        assert len(computes) == 4
        if depth == 3:  # read of i+1 and write of i-1 in flight during compute(i)
            assert computes[1] == "C1|r[2]|w[0]" and computes[2] == "C2|r[3]|w[1]"
        elif depth == 2:
            assert computes[1] == "C1|r[2]|w[]"
        else:
            assert all(c.endswith("|r[]|w[]") for c in computes)


def test_step_pipeline_runs_fetch_ahead_and_store_behind():
    import threading

    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    release = threading.Event()

    def fetch(i):
        with lock:
            events.append(("fetch", i))
        if i == 1:
            release.set()

    def compute(i):
        if i == 0:
            assert release.wait(10)  # fetch(1) ran on the worker while compute(0) was running
        with lock:
            events.append(("compute", i))

    def store(i):
        with lock:
            events.append(("store", i))

    times = StepPipeline().run(3, fetch, compute, store)
    assert times.units == 3 and events.index(("fetch", 1)) < events.index(("compute", 0))
    assert sorted(events) == sorted([(k, i) for k in ("fetch", "compute", "store") for i in range(3)])


def test_nvme_with_bf16_states_and_partial_offload_match_in_memory(tmp_path: Path):
    """``fp32_optimizer_states: false`` keeps Adam's moments in bf16 in the swap files; ``ratio`` 0.5 swaps
    half of the sub-groups and steps the rest in memory: both step like the in-memory run."""
    def config(offload: dict) -> dict:
        cfg = _config(3, offload, bf16={"enabled": True})
        cfg["optimizer"]["params"]["fp32_optimizer_states"] = False
        return cfg

    reference = _train(dsrun.initialize(model=_model(), config=config({"device": "none"}))[0])
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 8}
    engine = dsrun.initialize(model=_model(), config=config(nvme))[0]
    assert _train(engine) == reference
    swapped = engine.strategy.placement.offloaded.swapped
    assert swapped.depth == 2 and swapped.store.entry("exp_avg.0").dtype == torch.bfloat16
    engine = dsrun.initialize(model=_model(), config=config({**nvme, "ratio": 0.5}))[0]
    placements = [sg.placement for sg in engine.strategy.sub_groups]
    assert "nvme" in placements and "device" in placements
    assert _train(engine) == reference


def test_gathered_parameters_changes_reach_swapped_masters(tmp_path: Path):
    """What GatheredParameters(modifier_rank=...) does on exit (write_full_value) reaches the swapped master."""
    from dsrun.zero.partition_params import write_full_value
    from dsrun.zero import GatheredParameters

    cfg = _config(3, {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4})
    engine = dsrun.initialize(model=_model(), config=cfg)[0]
    weight = engine.module[2].weight
    write_full_value(weight, torch.full(tuple(weight.ds_shape), 0.5))
    _train(engine, 1)  # the step starts from the modified master, not from the old one
    with GatheredParameters([weight]):
        value = weight.detach().clone()
    assert (value - 0.5).abs().max() < 0.05  # one Adam step of lr 0.01 away from 0.5


@pytest.mark.parametrize("n", [0, 1, 4, 5, 9, 33, 1000])
def test_narrow_and_widen_in_place_round_trip_exactly(monkeypatch, n: int):
    from dsrun.offload import nvme

    monkeypatch.setattr(nvme, "CONVERT_CHUNK", 4)  # many chunks, and a short last one
    for dtype in (torch.bfloat16, torch.float16):
        values = torch.randn(n).to(dtype)
        buffer = torch.full((n + 3,), float("nan"))
        buffer[:n] = values.float()
        narrow = nvme.narrow_in_place(buffer, n, dtype)
        assert narrow.dtype == dtype and torch.equal(narrow, values)
        if n:
            assert narrow.data_ptr() == buffer.data_ptr()  # packed at the start of the same memory
        assert torch.equal(nvme.widen_in_place(buffer, n, dtype), values.float())


def _gradient_file_dtypes(engine) -> set[torch.dtype]:
    store = engine.strategy.placement.offloaded.swapped.store
    return {store.entry(k).dtype for k in store.keys() if k.startswith("grad.")}


@pytest.mark.parametrize("gas", [1, 2])
def test_bf16_gradient_files_are_16_bit_when_exact_and_the_step_is_unchanged(tmp_path: Path, gas: int):
    """One micro-step per step and a bf16 reduction: each gradient element is one bf16 value, so ``grad.i``
    is written in bf16 (half the bytes) and the update equals CPU offload's (fp32 gradients in memory). With
    gradient accumulation the sums are not bf16-exact and the files stay fp32."""
    def run(offload: dict) -> tuple[list[float], list[torch.Tensor], set[torch.dtype]]:
        cfg = _config(3, offload, bf16={"enabled": True}, gradient_accumulation_steps=gas)
        cfg["train_batch_size"] = 4 * gas
        engine = dsrun.initialize(model=_model(), config=cfg)[0]
        gen, losses, dtypes = torch.Generator().manual_seed(1), [], set()
        for _ in range(3 * gas):
            x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
            loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
            engine.backward(loss)
            if getattr(engine.strategy.placement.offloaded, "swapped", None) is not None and engine.is_gradient_accumulation_boundary():
                dtypes |= _gradient_file_dtypes(engine)
            engine.step()
            losses.append(loss.item())
        with dsrun.zero.GatheredParameters(list(engine.module.parameters())):
            params = [p.detach().float().clone() for p in engine.module.parameters()]
        engine.destroy()
        return losses, params, dtypes

    nvme = run({"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 12})
    cpu = run({"device": "cpu"})
    assert nvme[2] == ({torch.bfloat16} if gas == 1 else {torch.float32})
    assert nvme[0] == cpu[0]
    for a, b in zip(nvme[1], cpu[1]):
        assert torch.equal(a, b)


def test_fp32_partial_offload_writes_the_nvme_parameter_shards_of_the_sub_groups_kept_in_memory(tmp_path: Path):
    """fp32 with ``offload_param`` on NVMe: no shard can alias its master, so the step writes every shard,
    the sub-groups that ``ratio`` keeps on the device included (and so does loading a checkpoint)."""
    def config(offload: dict) -> dict:
        cfg = _config(3, offload)
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "params"),
                                                     "buffer_count": 4, "max_in_cpu": 0}
        return cfg

    reference = _train(dsrun.initialize(model=_model(), config=config({"device": "none"}))[0])
    engine = dsrun.initialize(model=_model(), config=config({"device": "cpu", "ratio": 0.5}))[0]
    assert {sg.placement for sg in engine.strategy.sub_groups} == {"cpu", "device"}
    assert _train(engine) == reference


@pytest.mark.parametrize("n", [1, 7, 8, 29])
def test_gradient_stats_reuse_one_chunk_buffer_and_equal_the_float64_sum_of_squares(monkeypatch, n: int):
    from dsrun.offload import nvme

    monkeypatch.setattr(nvme, "NORM_CHUNK", 8)  # several chunks, and a short last one
    grad = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e3
    expected = sum(float(c.double().pow(2).sum()) for c in grad.split(8))
    assert nvme.grad_stats(grad) == (expected, True)
    grad[n // 2] = float("nan")
    assert nvme.grad_stats(grad)[1] is False
