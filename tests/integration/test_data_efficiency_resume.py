"""Exact resume with each data-efficiency feature on (2 ranks, ZeRO-2, gradient accumulation 2, dropout on):
8 uninterrupted steps equal 4 steps, a checkpoint, and 4 more in a new launch, bit for bit. The schedules'
states (curriculum, θ, random-LTD's kept length and layer-token count, the sampler's clusters and positions)
travel in the checkpoint. And PLD under ZeRO-3, where every rank must skip the same blocks: it trains when the
ranks are seeded alike and is refused, not hung, when they are not.

The runs are ``ResumeJob`` records of the harness's ``data_efficiency_gpt`` (tests/harness/models.py), each
trained straight through or saved or resumed; the rank entry points are this module's."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness.launch import Launch, Runs
from tests.harness.models import build_model
from tests.harness.runs import ds_config
from tests.helpers import run_ranks

FEATURES = ("legacy", "pld", "ltd", "sampling", "all")
VOCAB, SEQ, LAYERS, SAMPLES = 64, 16, 4, 240  # data_efficiency_gpt's vocabulary, block and layers
MODEL = "data_efficiency_gpt"


@dataclass(frozen=True)
class ResumeJob:
    """One run of ``feature`` (the data analyzer's index in ``index_dir``): ``steps`` optimizer steps, saving
    into ``save_dir`` after step ``save_at``, or first loading ``load``."""

    feature: str
    index_dir: str
    steps: int
    save_at: int | None = None
    save_dir: str | None = None
    load: str | None = None


class Windows(torch.utils.data.Dataset):
    """Deterministic windows; window i draws its tokens below ``8 + i % 56`` (so its max token varies)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(3)
        self.tokens = np.stack([rng.integers(0, 8 + i % 56, SEQ + 1) for i in range(SAMPLES)]).astype(np.int64)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(self.tokens[i])
        return window[:-1], window[1:]


def analyse(save_path: str) -> None:
    """The max-token index of :class:`Windows` (run once, in the parent)."""
    from dsrun.data_efficiency import DataAnalyzer

    DataAnalyzer(Windows(), batch_size=50, metric_names=["maxtoken"],
                 metric_functions=[lambda batch: batch[0].max(dim=1).values],
                 metric_types=["single_value_per_sample"], save_path=save_path).run_map_reduce()


def feature_config(feature: str, index_dir: str) -> dict[str, Any]:
    """The sections that turn ``feature`` on (``all``: PLD, random-LTD and the curriculum sampler at once)."""
    legacy = {"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4,
                                      "max_difficulty": SEQ, "schedule_type": "fixed_linear",
                                      "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 4}}}
    pld = {"progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.2}}
    ltd = {"enabled": True, "total_layer_num": LAYERS, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
           "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
           "random_ltd_schedule": {"min_value": 4, "max_value": SEQ, "schedule_type": "fixed_linear",
                                   "schedule_config": {"require_steps": 10, "seq_per_step": 4}}}
    sampling = {"enabled": True, "num_epochs": 100, "curriculum_learning": {
        "enabled": True, "data_cluster_path": f"{index_dir}/clusters", "curriculum_metrics": {"maxtoken": {
            "index_to_sample_path": f"{index_dir}/maxtoken/maxtoken_index_to_sample",
            "index_to_metric_path": f"{index_dir}/maxtoken/maxtoken_index_to_metric",
            "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 12,
            "max_difficulty": 63, "schedule_type": "fixed_root",
            "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 1, "root_degree": 2}}}}}
    de = {"data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd}}}
    by_name = {"legacy": legacy, "pld": pld, "ltd": de,
               "sampling": {"data_efficiency": {"enabled": True, "data_sampling": sampling}}}
    if feature == "all":
        return {**pld, "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd},
                                           "data_sampling": sampling}}
    return by_name[feature]


def run_jobs(rank: int, world: int, jobs: list[ResumeJob]) -> list[dict[str, Any]]:
    """Rank entry point: the jobs one after another."""
    from dsrun import comm

    try:
        return [run_job(rank, world, job) for job in jobs]
    finally:
        if comm.is_initialized():
            comm.destroy_process_group()


def run_job(rank: int, world: int, job: ResumeJob) -> dict[str, Any]:
    import dsrun
    from dsrun import comm
    from dsrun.models.layers import Block
    from dsrun.data_efficiency import convert_to_random_ltd

    random.seed(11 + rank)
    np.random.seed(11 + rank)
    model = build_model(MODEL)
    torch.manual_seed(11 + rank)  # per-rank dropout and token-drop streams
    # DeepSpeed's default buckets and clipping; AdamW at 3e-3 with its default weight decay
    config = ds_config(2, 4, 2, zero={"reduce_bucket_size": None, "allgather_bucket_size": None},
                       optimizer={"type": "AdamW", "params": {"lr": 3e-3}}, gradient_clipping=None,
                       **feature_config(job.feature, job.index_dir))
    data = Windows()
    engine, _, loader, _ = dsrun.initialize(model=model, config=config,
                                            training_data=data if job.feature in ("sampling", "all") else None)
    if engine.random_ltd_enabled():
        convert_to_random_ltd(engine, Block)
    if loader is None:  # a fixed stream: batch k of this rank is window (k·world + rank) mod SAMPLES, etc.
        loader = _Stream(data, rank, world)
    result: dict[str, Any] = {"losses": []}
    if job.load:
        _, client = engine.load_checkpoint(job.load)
        if isinstance(loader, _Stream):
            loader.position = client["position"]
    for _ in range(job.steps):
        total = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, targets = next(loader)
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        mean = torch.tensor([total], dtype=torch.float64)
        comm.all_reduce(mean)
        result["losses"].append(mean.item())
        if engine.global_steps == job.save_at:
            engine.save_checkpoint(job.save_dir, client_state={"position": getattr(loader, "position", 0)})
    result["theta"] = engine.get_pld_theta()
    scheduler = engine.data_efficiency.random_ltd_scheduler
    result["layer_tokens"] = scheduler.state["consumed_layer_tokens"] if scheduler is not None else None
    result["params"] = {k: v.detach().float().numpy().copy() for k, v in engine.module.state_dict().items()}
    comm.barrier()
    return result


class _Stream:
    def __init__(self, data: Windows, rank: int, world: int):
        self.data, self.rank, self.world, self.position = data, rank, world, 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = (self.position * self.world + self.rank) * 4
        self.position += 1
        items = [self.data[(first + i) % SAMPLES] for i in range(4)]
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def pld_zero3(rank: int, world: int) -> dict[str, Any]:
    """PLD under ZeRO-3: ranks seeded alike train; ranks seeded apart are refused (instead of hanging when they
    skip different blocks)."""
    from dsrun import comm

    try:
        return {"same": _pld_zero3_run(rank, same_seed=True), "apart": _pld_zero3_run(rank, same_seed=False)}
    finally:
        comm.destroy_process_group()


def _pld_zero3_run(rank: int, same_seed: bool) -> list[float] | str:
    import dsrun
    from dsrun.models.gpt import GPT
    from dsrun.utils.errors import ConfigError

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}, "steps_per_print": 1000,
              "progressive_layer_drop": {"enabled": True, "theta": 0.3, "gamma": 0.5}}
    torch.manual_seed(0)
    with dsrun.zero.Init(config_dict_or_path=config):
        model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=2, n_embd=16)
    engine, *_ = dsrun.initialize(model=model, config=config)
    torch.manual_seed(0 if same_seed else rank)
    losses = []
    try:
        for _ in range(6):
            batch = torch.randint(0, VOCAB, (2, SEQ + 1))
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    except ConfigError as exc:
        return str(exc)
    return losses


def collect(launch: Runs):
    """Straight runs and the saves halfway in one launch, then the resumed runs."""
    root = launch.root
    analyse(str(root / "index"))
    index = str(root / "index")
    first = [ResumeJob(f, index, steps=8) for f in FEATURES]
    first += [ResumeJob(f, index, steps=4, save_at=4, save_dir=str(root / f)) for f in FEATURES]
    straight_and_saved = launch(Launch(run_jobs, 2, (first,), timeout=600, rank=0))
    resumed = launch(Launch(run_jobs, 2, ([ResumeJob(f, index, steps=4, load=str(root / f)) for f in FEATURES],),
                            timeout=600, rank=0))
    return {f: (straight_and_saved[i], straight_and_saved[len(FEATURES) + i], resumed[i])
            for i, f in enumerate(FEATURES)}


@pytest.mark.parametrize("feature", FEATURES)
def test_resume_is_exact_with_each_feature(runs, feature):
    straight, first_half, second_half = runs[feature]
    assert first_half["losses"] == straight["losses"][:4]
    assert second_half["losses"] == straight["losses"][4:]          # exact float equality
    assert second_half["theta"] == straight["theta"]
    assert second_half["layer_tokens"] == straight["layer_tokens"]
    for key, value in straight["params"].items():
        assert np.array_equal(second_half["params"][key], value), key


def test_pld_under_zero3_trains_or_refuses_but_never_hangs():
    outcomes = run_ranks(pld_zero3, 2, timeout=300)
    assert all(isinstance(o["same"], list) and len(o["same"]) == 6 for o in outcomes)
    assert all("every rank must skip the same layers" in o["apart"] for o in outcomes)
