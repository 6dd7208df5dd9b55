"""The support ledger's proof, key by key: for every key it marks implemented with
``tests/unit/runtime/test_config_effects.py::test_key_changes_behaviour[KEY]``, the case below changes the key
and sees what dsrun does change (a one-rank world, in this process): batch, optimizer, scheduler, precision,
ZeRO, offload. Logging, monitors and profilers are in test_config_effects_reporting.py, keys whose effect only
shows between ranks in tests/integration/test_config_effects.py, config-layer keys in tests/unit/config.

Each case asserts the outcome for two values of the key (usually the default and one other), so a key that
stopped acting fails here. Register a new key with ``@effect("section.key")``.
"""
from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dsrun.config import load_ds_config
from dsrun.utils.errors import ConfigError
from tests.unit.runtime._effects import BASE, engine, files, first_weight, merged, registry, step

pytestmark = pytest.mark.usefixtures("world_of_one")

EFFECTS, effect = registry()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ == "test_key_changes_behaviour":  # every case registered below
        metafunc.parametrize("key", sorted(EFFECTS))


def test_key_changes_behaviour(key: str, tmp_path, monkeypatch, capsys) -> None:
    EFFECTS[key](key=key, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)


# --- batch, optimizer, scheduler, clipping -----------------------------------------------------------------------
@effect("train_batch_size", "gradient_accumulation_steps")
def _accumulation(key, **_):
    changed = {"train_batch_size": 4} if key == "train_batch_size" else {"gradient_accumulation_steps": 2}
    plain, accumulating = engine(), engine(changed)
    step(plain, 2), step(accumulating, 2)
    assert (plain.global_steps, accumulating.global_steps) == (2, 1)  # two micro-steps per optimizer step


@effect("train_micro_batch_size_per_gpu")
def _micro_batch(**_):
    data = torch.utils.data.TensorDataset(torch.randn(6, 4), torch.randn(6, 1))
    sizes = [len(next(iter(engine({"train_micro_batch_size_per_gpu": m}, training_data=data).training_dataloader))[0])
             for m in (2, 3)]
    assert sizes == [2, 3]


@effect("optimizer.type", "optimizer.params")
def _optimizer(key, **_):
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if key == "optimizer.type":
        assert type(engine(sgd).optimizer).__name__ == "SGD"
        assert type(engine().optimizer).__name__ in ("AdamW", "DeepSpeedCPUAdam")
        return
    deltas = []
    for lr in (0.1, 0.2):  # plain SGD: the update is lr times the gradient
        e = engine({"optimizer": {"type": "SGD", "params": {"lr": lr}}})
        before = first_weight(e)
        step(e)
        deltas.append(first_weight(e) - before)
    torch.testing.assert_close(deltas[1], 2 * deltas[0])


@effect("scheduler.type", "scheduler.params")
def _scheduler(key, **_):
    warmup = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}}}
    other = {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.02}}} if key == "scheduler.params" \
        else {}
    lrs = []
    for extra in (warmup, merged(warmup, other)):
        e = engine(extra)
        step(e, 2)
        lrs.append(e.get_lr()[0])
    assert 0 < lrs[0] < 0.01  # warming up linearly towards warmup_max_lr
    assert lrs[1] == pytest.approx(2 * lrs[0] if key == "scheduler.params" else lrs[0])
    if key == "scheduler.type":
        none = engine()
        step(none, 2)
        assert none.get_lr()[0] == 0.01 and none.lr_scheduler is None


@effect("gradient_clipping")
def _clipping(**_):
    deltas, norms = [], []
    for clip in (0.0, 1e-3):
        e = engine({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": clip})
        before = first_weight(e)
        step(e)
        deltas.append((first_weight(e) - before).norm().item())
        norms.append(e.get_global_grad_norm())
    assert norms[0] is None and norms[1] > 1e-3
    assert deltas[1] < deltas[0] / 10  # the clipped step is the gradient scaled to norm 1e-3


def test_gradient_clipping_left_out_clips_at_one_as_deepspeed_does():
    """DeepSpeed's documented default (and 0.19's): a config without the key clips the global norm at 1.0."""
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    e = engine(sgd)
    assert e.gradient_clipping() == 1.0
    before = first_weights(e)
    x, y = torch.randn(2, 4, generator=torch.Generator().manual_seed(0)), torch.full((2, 1), 100.0)
    e.backward(F.mse_loss(e(x), y))  # a gradient whose global norm is far above 1
    e.step()
    norm = e.get_global_grad_norm()
    assert norm > 100
    # SGD moved the weights by lr * g * 1/(norm + 1e-6): a step of global norm lr * norm / (norm + 1e-6)
    after = torch.cat([w.flatten() for w in first_weights(e)])
    moved = (after - torch.cat([w.flatten() for w in before])).double().norm().item()
    # fp32 rounds the update and the difference: at most one ulp of the largest weight per element
    bound = after.numel() ** 0.5 * after.abs().max().item() * 2.0 ** -23
    assert moved == pytest.approx(0.1 * norm / (norm + 1e-6), abs=bound)
    # DeepSpeed's ZeRO-1/2 wrapper keeps the norm as optimizer._global_grad_norm; its bare fp32 optimizer does not
    assert not hasattr(e.optimizer, "_global_grad_norm")
    zero1 = engine({**sgd, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True})
    zero1.backward(F.mse_loss(zero1(x), y))
    zero1.step()
    assert zero1.optimizer._global_grad_norm == zero1.get_global_grad_norm() == pytest.approx(norm)


def first_weights(e: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in e.module.parameters()]


# --- precision ----------------------------------------------------------------------------------------------------
def fp16(**keys: Any) -> dict:
    return {"fp16": {"enabled": True, **keys}}


@effect("fp16.enabled", "bf16.enabled")
def _precision(key, **_):
    dtype = {"fp16.enabled": torch.float16, "bf16.enabled": torch.bfloat16}[key]
    e = engine({key.split(".")[0]: {"enabled": True}})
    assert e.module.layers[0].weight.dtype == dtype and engine().module.layers[0].weight.dtype == torch.float32


@effect("fp16.auto_cast")
def _auto_cast(**_):
    seen = []
    for cast in (False, True):
        e = engine(fp16(auto_cast=cast))
        step(e)
        seen.append(e.module.input_dtypes[-1])
    assert seen == [torch.float32, torch.float16]


@effect("fp16.loss_scale", "fp16.initial_scale_power")
def _initial_scale(key, **_):
    a, b = ((fp16(loss_scale=128.0), fp16()) if key == "fp16.loss_scale"
            else (fp16(initial_scale_power=4), fp16(initial_scale_power=8)))
    assert (engine(a).cur_scale, engine(b).cur_scale) == ((128.0, 2.0 ** 16) if key == "fp16.loss_scale"
                                                            else (16.0, 256.0))


@effect("bf16.check_grad_overflow")
def _bf16_overflow(**_):
    """DeepSpeed 0.19's default (true): a bf16 step whose gradients hold inf/nan is skipped at ZeRO 1-2; false,
    or stage 0 and 3 (where DeepSpeed's bf16 optimizers do not check), apply it."""
    def run(stage: int, **keys: Any) -> tuple[int, bool]:
        e = engine({"bf16": {"enabled": True, **keys}, "zero_optimization": {"stage": stage},
                    "gradient_clipping": 0.0})
        step(e, 1, overflow_at=(0,))
        return e.skipped_steps, bool(torch.isfinite(e.module.layers[0].weight).all())
    assert run(1) == run(2) == (1, True)  # skipped: the weights stay finite
    assert run(2, check_grad_overflow=False) == (0, False)
    assert run(0) == (0, False) and run(3)[0] == 0  # (a ZeRO-3 weight is an empty placeholder between steps)


def scale_after(n: int, overflow_at: tuple[int, ...], **keys: Any) -> float:
    e = engine(fp16(initial_scale_power=4, **keys))
    step(e, n, overflow_at)
    return e.cur_scale


@effect("fp16.loss_scale_window")
def _window(**_):
    assert (scale_after(2, (), loss_scale_window=2), scale_after(2, ())) == (32.0, 16.0)


@effect("fp16.hysteresis")
def _hysteresis(**_):
    assert (scale_after(1, (0,), hysteresis=1), scale_after(1, (0,), hysteresis=2)) == (8.0, 16.0)


@effect("fp16.consecutive_hysteresis")
def _consecutive(**_):
    # overflow, clean, overflow: refilled after the clean step, the second overflow is absorbed too
    assert (scale_after(3, (0, 2), consecutive_hysteresis=True), scale_after(3, (0, 2))) == (16.0, 8.0)


@effect("fp16.min_loss_scale")
def _min_scale(**_):
    assert (scale_after(4, (0, 1, 2, 3), hysteresis=1, min_loss_scale=4.0),
            scale_after(4, (0, 1, 2, 3), hysteresis=1)) == (4.0, 1.0)


# --- ZeRO ---------------------------------------------------------------------------------------------------------
def zero(stage: int, **keys: Any) -> dict:
    return {"zero_optimization": {"stage": stage, **keys}}


@effect("zero_optimization.stage")
def _stage(**_):
    # fp32 stage 0 steps the model's own flat buffer; stage 1 keeps a separate fp32 master partition
    masters = []
    for stage in (0, 1):
        e = engine(zero(stage))
        step(e)
        masters.append(e.memory_breakdown().master_weights)
    assert masters[0] == 0 and masters[1] > 0


@effect("zero_optimization.ignore_unused_parameters")
def _ignore_unused_parameters(**_):
    from tests.unit.runtime._effects import Net

    for stage in (1, 2):  # where DeepSpeed reads it
        def with_unused() -> Net:
            net = Net()
            net.spare = torch.nn.Parameter(torch.ones(3))  # trainable, never in the forward
            return net

        step(engine(zero(stage), model=with_unused()), 2)  # the default ignores it
        strict = engine(zero(stage, ignore_unused_parameters=False), model=with_unused())
        with pytest.raises(AssertionError, match=r"not used in producing loss.*\['spare'\]"):
            step(strict)
        step(engine(zero(stage, ignore_unused_parameters=False)), 2)  # every parameter used: trains


@effect("managed_gradient_accumulation")
def _managed_gradient_accumulation(**_):
    def backward(e: Any, i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        e.backward(F.mse_loss(e(torch.randn(2, 4, generator=gen)).float(), torch.randn(2, 1, generator=gen)))

    for stage in (0, 1, 2, 3):
        keys = {**zero(stage), "gradient_accumulation_steps": 3}
        managed, caller = engine(keys), engine({**keys, "managed_gradient_accumulation": False})
        for i in range(3):  # the engine's boundary: the third step() call
            backward(managed, i)
            managed.step()
        for i in range(3):  # the caller's: three backwards, then its one step()
            backward(caller, i)
            assert not caller.is_gradient_accumulation_boundary()
        caller.step()
        assert (caller.global_steps, caller.global_samples) == (managed.global_steps, managed.global_samples) == (1, 6)
        assert torch.equal(first_weight(caller), first_weight(managed)), stage
        backward(caller, 3), backward(caller, 4), caller.step()  # two micro-batches this time, and it steps
        assert (caller.global_steps, caller.global_samples) == (2, 10)
        with pytest.raises(AssertionError, match="managed_gradient_accumulation=False"):
            caller.set_gradient_accumulation_boundary(True)


@effect("zero_optimization.compute_grad_norm")
def _compute_grad_norm(**_):
    fast = zero(1, compute_grad_norm=False)
    with pytest.raises(ConfigError) as err:  # the default clipping needs the norm; stage 0 has no fast path
        load_ds_config(merged(BASE, zero(0, compute_grad_norm=False)))
    assert [p.path for p in err.value.problems] == ["zero_optimization.compute_grad_norm"] * 2
    assert "gradient_clipping to 0" in err.value.problems[1].hint
    with pytest.raises(ConfigError, match="offload_optimizer"):
        load_ds_config(merged(BASE, {**zero(1, compute_grad_norm=False, offload_optimizer={"device": "cpu"}),
                                     "gradient_clipping": 0.0}))
    e = engine({**fast, "gradient_clipping": 0.0})
    step(e, 2)
    assert e.global_steps == 2 and e.get_global_grad_norm() is None  # no norm measured


@effect("zero_optimization.sub_group_size")
def _sub_groups(**_):
    counts = [len(engine(zero(3, sub_group_size=size)).optimizer.param_groups[0]["params"]) for size in (10**9, 40)]
    assert counts[0] == 1 and counts[1] > 1  # 121 elements in sub-groups of at most ~40


def statuses(extra: dict, at: int) -> list[str]:
    """Each parameter's stage-3 status when the forward reaches layer ``at`` on the second step. A world of one
    keeps ZeRO-3 parameters whole, with nothing to gather (dsrun/zero/whole_params.py); parameter offload keeps
    them partitioned, so the gathers these keys tune run."""
    e = engine(merged(zero(3, stage3_param_persistence_threshold=0, offload_param={"device": "cpu"}), extra))
    seen: list[str] = []
    layer = e.module.layers[at]
    layer.register_forward_pre_hook(lambda *a: seen.__setitem__(slice(None), [
        p.ds_status.name for p in e.module.parameters()]))
    step(e, 2)
    return seen


@effect("zero_optimization.stage3_prefetch_bucket_size")
def _prefetch(**_):
    # at layer 1, layer 2's parameters are already being fetched, unless prefetching is off
    assert statuses({}, 1)[4:] == ["INFLIGHT"] * 2
    assert statuses(zero(3, stage3_prefetch_bucket_size=0), 1)[4:] == ["NOT_AVAILABLE"] * 2


@effect("zero_optimization.stage3_max_reuse_distance")
def _reuse(**_):
    # at layer 2, layer 0 is kept for its backward, unless the reuse distance is 0
    assert statuses(zero(3, stage3_prefetch_bucket_size=0), 2)[:2] == ["AVAILABLE"] * 2
    assert statuses(zero(3, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0), 2)[:2] == \
        ["NOT_AVAILABLE"] * 2


@effect("zero_optimization.stage3_max_live_parameters")
def _max_live(**_):
    assert statuses({}, 2) == ["AVAILABLE"] * 6
    assert "NOT_AVAILABLE" in statuses(zero(3, stage3_max_live_parameters=50), 2)


@effect("zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_model_persistence_threshold")
def _persistence(key, **_):
    def persistent(**keys: Any) -> list[bool]:
        return [p.ds_persist for p in engine(zero(3, **keys)).module.parameters()]

    assert persistent(stage3_param_persistence_threshold=0) == [False] * 6
    assert persistent(stage3_param_persistence_threshold=100) == [True] * 6  # every parameter has <= 64 elements
    if key.endswith("model_persistence_threshold"):  # a cap on the persistent elements in total
        assert 0 < sum(persistent(stage3_param_persistence_threshold=100,
                                  stage3_model_persistence_threshold=80)) < 6


@effect("zero_optimization.stage3_gather_16bit_weights_on_model_save")
def _save_16bit(tmp_path, **_):
    saved = [engine(zero(3, stage3_gather_16bit_weights_on_model_save=flag)).save_16bit_model(str(tmp_path / str(flag)))
             for flag in (False, True)]
    assert saved == [False, True] and (tmp_path / "True" / "pytorch_model.bin").is_file()


@effect("zero_optimization.memory_efficient_linear")
def _linear(monkeypatch, **_):
    from dsrun.zero import linear

    for flag in (False, True):  # stage 3 routes F.linear through its memory-saving version, or not
        monkeypatch.setattr(F, "linear", linear._original_linear)
        engine(zero(3, memory_efficient_linear=flag))
        assert (F.linear is linear.zero3_linear) is flag


@effect("zero_allow_untested_optimizer")
def _untested(**_):
    sgd = merged(zero(1), {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer"):
        engine(sgd)
    assert type(engine({**sgd, "zero_allow_untested_optimizer": True}).optimizer).__name__ == "SGD"


@effect("zero_force_ds_cpu_optimizer")
def _force_cpu_optimizer(**_):
    offload = merged(zero(1, offload_optimizer={"device": "cpu"}), {"zero_allow_untested_optimizer": True})
    client = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    from dsrun.utils.errors import ZeRORuntimeException  # DeepSpeed's class for it, a ConfigError too

    with pytest.raises(ZeRORuntimeException, match="zero_force_ds_cpu_optimizer"):
        engine(offload, optimizer=client)
    e = engine({**offload, "zero_force_ds_cpu_optimizer": False}, optimizer=client)
    step(e)
    assert type(e.optimizer).__name__ == "SGD"


# --- offload (memory_breakdown and the swap files tell where the states went) --------------------------------------
def nvme_optimizer(tmp_path, **keys: Any) -> tuple[Any, int]:
    """A stage-3 engine with its optimizer on NVMe under tmp_path/opt; the swap files after initialize."""
    e = engine(zero(3, sub_group_size=40, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path / "opt"),
                                                             **keys}))
    return e, files(tmp_path / "opt")


@effect("zero_optimization.offload_optimizer.device", "zero_optimization.offload_optimizer.nvme_path")
def _optimizer_offload(tmp_path, **_):
    e, written = nvme_optimizer(tmp_path)
    step(e)
    assert written > 0 and e.memory_breakdown().optimizer_states == 0  # the states live in the files
    kept = engine(zero(3, sub_group_size=40))
    step(kept)
    assert kept.memory_breakdown().optimizer_states > 0


@effect("zero_optimization.offload_optimizer.fast_init")
def _fast_init(tmp_path, **_):
    # without fast_init the zero Adam states are written at initialize; with it, at the first step
    assert nvme_optimizer(tmp_path / "a")[1] > nvme_optimizer(tmp_path / "b", fast_init=True)[1] > 0


@effect("zero_optimization.offload_optimizer.ratio")
def _ratio(tmp_path, **_):
    whole, half = nvme_optimizer(tmp_path / "a")[0], nvme_optimizer(tmp_path / "b", ratio=0.5)[0]
    step(whole), step(half)
    assert whole.memory_breakdown().optimizer_states == 0 < half.memory_breakdown().optimizer_states


@effect("zero_optimization.offload_optimizer.buffer_count")
def _optimizer_buffers(tmp_path, **_):
    buffers = []
    for count in (4, 8):
        e = nvme_optimizer(tmp_path / str(count), buffer_count=count)[0]
        step(e)
        buffers.append(e.memory_breakdown().buffers)
    grown = buffers[1] - buffers[0]  # the breakdown's buffers also hold ZeRO's own pools, the same in both runs
    assert grown > 0 and grown % 4 == 0  # four more swap buffers of one size


@effect("zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.pin_memory")
def _pin_memory(key, monkeypatch, **_):
    # pinning needs an accelerator: the decision is checked with one pretended present
    from dsrun import accelerator
    from dsrun.offload import param_swapper
    from dsrun.offload.settings import OffloadOptimizerSettings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(accelerator, "get_accelerator", lambda: types.SimpleNamespace(pin_memory_enabled=lambda: True))
    pinned = []
    for pin in (False, True):
        z = load_ds_config(merged(BASE, zero(3, offload_optimizer={"device": "cpu", "pin_memory": pin},
                                              offload_param={"device": "cpu", "pin_memory": pin}))).zero_optimization
        if key.endswith("offload_optimizer.pin_memory"):
            ctx = types.SimpleNamespace(zero_config=z, aio_config=None, force_ds_cpu_optimizer=True)
            pinned.append(OffloadOptimizerSettings.from_context(ctx).pinned)
        else:
            pinned.append(param_swapper.build_param_offload(z.offload_param, torch.device("cpu")).pin)
    assert pinned == [False, True]


def nvme_params(tmp_path, **keys: Any) -> Any:
    e = engine(zero(3, stage3_param_persistence_threshold=0,
                    offload_param={"device": "nvme", "nvme_path": str(tmp_path), "buffer_size": 64, **keys}))
    step(e, 2)
    return e


@effect("zero_optimization.offload_param.device", "zero_optimization.offload_param.nvme_path")
def _param_offload(tmp_path, **_):
    e = nvme_params(tmp_path / "p")
    assert e.memory_breakdown().parameters == 0 and files(tmp_path / "p") > 0
    in_memory = engine(zero(3, stage3_param_persistence_threshold=0))
    step(in_memory)
    assert in_memory.memory_breakdown().parameters > 0


@effect("zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size")
def _param_buffers(key, tmp_path, **_):
    if key.endswith("buffer_size"):  # a buffer must hold the largest shard (64 elements here)
        with pytest.raises(ConfigError, match="buffer_size"):
            nvme_params(tmp_path / "small", buffer_size=32)
    pools = [nvme_params(tmp_path / str(n), buffer_count=n, max_in_cpu=0).memory_breakdown().buffers
             for n in (2, 4)]
    assert pools[1] - pools[0] == 2 * 64 * 4  # two more buffers of 64 fp32 elements (beside ZeRO-3's own pools)


@effect("zero_optimization.offload_param.max_in_cpu")
def _max_in_cpu(tmp_path, **_):
    cached = [nvme_params(tmp_path / str(n), max_in_cpu=n).memory_breakdown().buffers for n in (0, 10**6)]
    assert cached[1] - cached[0] == 121 * 4  # with room, every shard is also kept in host memory


@effect("aio.block_size", "aio.queue_depth", "aio.thread_count", "aio.single_submit", "aio.overlap_events")
def _aio(key, tmp_path, **_):
    from dsrun.offload.swap_store import SwapStore

    name = key.split(".")[1]
    value = {"block_size": 4096, "queue_depth": 2, "thread_count": 2, "single_submit": True,
             "overlap_events": False}[name]
    getter = "get_intra_op_parallelism" if name == "thread_count" else f"get_{name}"
    seen = []
    for aio in ({}, {name: value}):
        store = SwapStore(tmp_path, aio_config=load_ds_config(merged(BASE, {"aio": aio})).aio)
        seen.append(getattr(store._read_handle, getter)())
        store.close()
    assert seen[1] == value != seen[0]


@effect("dataloader_drop_last")
def _drop_last(**_):
    data = torch.utils.data.TensorDataset(torch.randn(5, 4), torch.randn(5, 1))
    assert [len(engine({"dataloader_drop_last": drop}, training_data=data).training_dataloader)
            for drop in (False, True)] == [3, 2]
