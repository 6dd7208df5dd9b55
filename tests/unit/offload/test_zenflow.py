"""ZenFlow (zero_optimization.zenflow) in one process: the selective update against plain offload, the staleness
bound, selection, warm-up, exact resume, the core split, the estimate and the refusals."""
from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch

import dsrun
from dsrun.config.recent import ZenFlowConfig
from dsrun.estimate.inputs import EstimateInputs
from dsrun.estimate.model_states import model_state_bytes
from dsrun.offload.cores import PinnedWorker, process_cores, split_cores, thread_cores
from dsrun.offload.zenflow_store import ZenFlowStore
from dsrun.utils.errors import ConfigError
from tests.helpers import run_ranks

pytestmark = pytest.mark.usefixtures("world_of_one")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _config(zenflow: dict | None, stage: int = 2, **offload) -> dict:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", **offload}}
    if zenflow is not None:
        zero["zenflow"] = zenflow
    return {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "steps_per_print": 1000,
            "zero_optimization": zero}


def _batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(steps)]


def _step(engine, batch) -> float:
    x, y = batch
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _engine(zenflow: dict | None, stage: int = 2, **offload):
    return dsrun.initialize(model=_model(), config=_config(zenflow, stage, **offload))[0]


STEP_SELECT = {"select_strategy": "step", "select_interval": 1000}


@pytest.mark.parametrize("stage", [1, 2])
def test_topk_one_and_update_interval_one_equal_plain_offload(stage: int):
    batches = _batches(5)
    plain = _engine(None, stage)
    zen = _engine({"topk_ratio": 1.0, "update_interval": 1, **STEP_SELECT}, stage)
    assert isinstance(zen.strategy.store, ZenFlowStore)
    for batch in batches:
        assert _step(zen, batch) == _step(plain, batch)
    # every element is selected: the same compiled Adam on the same values, so equal to the bit
    for a, b in zip(_params(zen), _params(plain)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert zen.strategy.store.everything_selected and zen.strategy.store.cpu_updates == 0


def test_a_padded_partition_counts_as_everything_selected():
    torch.manual_seed(0)
    odd = torch.nn.Linear(5, 3, bias=False)  # 15 elements: the flat partition is padded to 16
    engine = dsrun.initialize(model=odd, config=_config({"topk_ratio": 1.0, "update_interval": 1, **STEP_SELECT}))[0]
    assert engine.strategy.groups[0].padding == 1
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    assert engine.strategy.store.everything_selected and engine.strategy.store.cpu_updates == 0


def test_topk_ratio_picks_the_heaviest_columns():
    batch = _batches(1)[0]
    reference = _model()
    torch.nn.functional.mse_loss(reference(batch[0]), batch[1]).backward()
    heaviest = set(torch.topk(reference[0].weight.grad.abs().sum(0), 4).indices.tolist())  # 16 columns x 0.25
    engine = _engine({"topk_ratio": 0.25, "update_interval": 2, **STEP_SELECT})
    _step(engine, batch)
    idx = engine.strategy.store.selection[0].idx
    first = idx[idx < 32 * 16]  # the first weight's elements lead the flat partition
    assert set((first % 16).tolist()) == heaviest and first.numel() == 4 * 32
    biases = idx[(idx >= 512) & (idx < 544)]
    assert biases.numel() == 32  # 1-D parameters are always selected


@pytest.mark.parametrize("overlap", [False, True])
def test_no_update_is_staler_than_update_interval(overlap: bool):
    interval, steps = 3, 10
    engine = _engine({"topk_ratio": 0.25, "update_interval": interval, "overlap_step": overlap, **STEP_SELECT})
    store = engine.strategy.store
    weight = engine.module[0].weight
    before = weight.detach().clone()
    changed_at = []
    for t, batch in enumerate(_batches(steps)):
        _step(engine, batch)
        assert store.pending < interval  # never more than update_interval steps of gradients wait
        cols = torch.ones(16, dtype=torch.bool)
        cols[store.selection[0].idx[store.selection[0].idx < 512] % 16] = False  # the unselected columns
        if not torch.equal(weight.detach()[:, cols], before[:, cols]):
            changed_at.append(t)
        before = weight.detach().clone()
    # the unselected columns move only when a window's CPU update is published: at its last step, or (overlap)
    # at the step after, while the next forward/backward ran
    expected = [t for t in range(steps) if (t + 1) % interval == 0] if not overlap else \
        [t for t in range(1, steps) if t % interval == 0]
    assert changed_at == expected
    assert store.max_staleness == (interval if overlap else interval - 1)
    assert engine.features.metrics()["ZenFlowFeature/zenflow_max_staleness"] == store.max_staleness
    engine.destroy()


def test_select_interval_and_epochs_reselect_the_columns():
    def selections(zenflow: dict, steps: int = 7) -> list[int]:
        engine = _engine({"topk_ratio": 0.25, "update_interval": 1, **zenflow})
        seen = []
        for batch in _batches(steps):
            _step(engine, batch)
            if not seen or seen[-1] != engine.strategy.store.last_selection:
                seen.append(engine.strategy.store.last_selection)
        return seen

    assert selections({"select_strategy": "step", "select_interval": 2}) == [0, 2, 4, 6]
    assert selections({"select_strategy": "epoch", "select_interval": 1, "steps_per_epoch": 3}) == [0, 3, 6]
    assert selections({"select_strategy": "epoch", "select_interval": 2, "steps_per_epoch": 2}) == [0, 4]
    assert selections({"select_strategy": "auto"}) == [0]  # no epoch length known: selected once


def test_warm_up_rounds_step_like_plain_offload():
    batches = _batches(3)
    plain = _engine(None)
    zen = _engine({"topk_ratio": 0.25, "update_interval": 2, "full_warm_up_rounds": 2, **STEP_SELECT})
    for batch in batches[:2]:
        _step(zen, batch), _step(plain, batch)
    assert all(torch.equal(a, b) for a, b in zip(_params(zen), _params(plain)))
    _step(zen, batches[2]), _step(plain, batches[2])
    assert not all(torch.equal(a, b) for a, b in zip(_params(zen), _params(plain)))  # selective from now on
    assert zen.strategy.store.last_selection == 2


def test_auto_update_interval_closes_windows_by_the_ratio():
    def cpu_updates(ratio: float) -> int:
        engine = _engine({"topk_ratio": 0.25, "update_interval": "auto", "auto_ratio": ratio, **STEP_SELECT})
        for batch in _batches(6):
            _step(engine, batch)
        return engine.strategy.store.cpu_updates

    assert cpu_updates(0.0) == 6  # nothing has to catch up: a CPU update every step
    assert cpu_updates(1.0) < 6  # every matrix must catch up first: longer windows


@pytest.mark.parametrize("overlap", [False, True])
def test_zenflow_resumes_exactly(tmp_path: Path, overlap: bool):
    zenflow = {"topk_ratio": 0.25, "update_interval": 3, "overlap_step": overlap, "select_strategy": "step",
               "select_interval": 3}
    batches = _batches(9)
    first = _engine(zenflow)
    for batch in batches[:6]:  # step 5 closes a window: with overlap its update is still unpublished
        _step(first, batch)
    assert first.strategy.store.pending == 0
    first.save_checkpoint(str(tmp_path), tag="t6")
    losses = [_step(first, batch) for batch in batches[6:8]]  # inside the next window: pending gradients
    first.save_checkpoint(str(tmp_path), tag="t8")
    losses.append(_step(first, batches[8]))
    for tag, start in (("t6", 6), ("t8", 8)):
        resumed = _engine(zenflow)
        resumed.load_checkpoint(str(tmp_path), tag=tag)
        assert [_step(resumed, b) for b in batches[start:]] == losses[start - 6:]
        assert all(torch.equal(a, b) for a, b in zip(_params(resumed), _params(first)))
        resumed.destroy()
    first.destroy()


@pytest.mark.parametrize("keys", [{"zenflow": {"pt_reserved_cores_perc": 0.5}},
                                  {"zenflow": {"pt_reserved_cores_perc": 0.9}, "cpuadam_cores_perc": 0.5}])
def test_the_optimizer_thread_runs_on_its_share_of_the_cores(keys: dict):
    cores = process_cores()
    main = threading.get_native_id()
    zenflow = {"topk_ratio": 0.25, "update_interval": 1, "overlap_step": True, **STEP_SELECT, **keys["zenflow"]}
    offload = {k: v for k, v in keys.items() if k != "zenflow"}
    engine = _engine(zenflow, **offload)
    split = split_cores(cores, 0.5)  # either key gives half of the cores to the optimizer
    try:
        for batch in _batches(3):
            _step(engine, batch)
        worker = engine.strategy.store.worker
        assert thread_cores(worker.native_id) == set(split.optimizer)
        assert thread_cores(main) == set(split.training)
        if split.isolated:
            assert torch.get_num_threads() <= len(split.training)
    finally:
        engine.destroy()
    assert thread_cores(main) == set(cores)  # everything back as it was


def test_a_worker_dropped_without_close_gives_the_cores_back_when_collected():
    """An engine a script forgets to destroy must not leave the process pinned to the training share."""
    cores, main, threads = process_cores(), threading.get_native_id(), torch.get_num_threads()
    split = split_cores(cores, 0.5)
    worker = PinnedWorker(split)
    assert worker.submit(threading.get_native_id).result(timeout=30) == worker.native_id
    assert thread_cores(main) == set(split.training)
    del worker
    gc.collect()
    assert thread_cores(main) == set(cores)
    assert torch.get_num_threads() == threads


def test_the_estimate_counts_zenflow_state_where_offload_puts_it():
    base = dict(total_params=1_000_000, largest_layer_params=250_000, zero_stage=2, offload_optimizer="cpu",
                device="cpu")
    plain = model_state_bytes(EstimateInputs(**base))
    on_device = model_state_bytes(EstimateInputs(**base, zenflow=ZenFlowConfig(topk_ratio=0.1)))
    on_host = model_state_bytes(EstimateInputs(**base, zenflow=ZenFlowConfig(topk_ratio=0.1, offload=True,
                                                                             overlap_step=True)))
    selected = 100_000 * (3 * 4 + 8)
    assert on_device.device_optimizer_states - plain.device_optimizer_states == selected
    assert on_device.host - plain.host == 1_000_000 * 4  # the window's accumulator
    assert on_host.device_optimizer_states == plain.device_optimizer_states
    assert on_host.host - plain.host == selected + 2 * 1_000_000 * 4  # two windows with overlap_step


@pytest.mark.parametrize("zero, problem", [
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "zenflow": {}}, "zero_optimization.zenflow: ZenFlow runs"),
    ({"stage": 2, "zenflow": {}}, "device none"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"select_strategy": "often"}},
     "zero_optimization.zenflow.select_strategy"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"update_interval": "sometimes"}},
     "zero_optimization.zenflow.update_interval"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 1.5}},
     "zero_optimization.zenflow.topk_ratio"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"select_strategy": "step"}},
     "needs a number of steps"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"},
      "zenflow": {"select_strategy": "step", "select_interval": 2, "update_interval": 4}}, "below update_interval"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True}}, "super_offload"),
])
def test_bad_zenflow_keys_are_refused_with_one_line(zero: dict, problem: str):
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": zero}
    with pytest.raises(ConfigError) as err:
        dsrun.initialize(model=_model(), config=cfg)
    lines = [line for line in str(err.value).splitlines() if problem in line]
    assert len(lines) == 1, str(err.value)


def test_a_plain_offload_checkpoint_resumes_with_zenflow_starting_afresh(tmp_path: Path):
    plain = _engine(None)
    for batch in _batches(2):
        _step(plain, batch)
    plain.save_checkpoint(str(tmp_path), tag="plain")
    zen = _engine({"topk_ratio": 0.25, "update_interval": 2, **STEP_SELECT})
    zen.load_checkpoint(str(tmp_path), tag="plain")
    assert all(torch.equal(a, b) for a, b in zip(_params(zen), _params(plain)))
    _step(zen, _batches(3)[2])
    assert zen.strategy.store.last_selection == 0 and zen.strategy.store.pending == 1


def test_the_recipe_composes_a_zenflow_run():
    from dsrun.compose import compose_runspec
    from dsrun.runspec import resolve_run

    zero = resolve_run(compose_runspec(["+recipe=gpt_zenflow"])).ds.zero_optimization
    assert zero.stage == 2 and zero.offload_optimizer.device == "cpu"
    assert zero.zenflow.overlap_step and zero.zenflow.update_interval == 4


def _two_ranks(rank: int, world: int) -> list[float]:
    engine = dsrun.initialize(model=_model(), config=_config({"topk_ratio": 0.25, "update_interval": 2,
                                                              "overlap_step": True, **STEP_SELECT}))[0]
    for batch in _batches(4, seed=rank + 1):  # each rank its own batches: the columns come from the reduced gradient
        _step(engine, batch)
    store = engine.strategy.store
    first, idx = store.layouts[0][0], store.selection[0].idx  # the first weight's fragment on this rank
    mine = idx[(idx >= first.a) & (idx < first.b)]
    columns = sorted(set(((mine - first.a + first.param_start) % first.cols).tolist()))
    engine.destroy()
    return {"columns": columns, "sums": [p.sum().item() for p in engine.module.parameters()]}


def test_two_ranks_pick_the_same_columns_and_keep_one_model():
    ranks = run_ranks(_two_ranks, 2)
    assert len(ranks[0]["columns"]) == 4 and ranks[0]["columns"] == ranks[1]["columns"]  # rows split, columns agree
    assert ranks[0]["sums"] == ranks[1]["sums"]  # each rank's partition updated alike: one model everywhere
