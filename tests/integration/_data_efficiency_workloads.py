"""Per-rank jobs for the data-efficiency resume test: each feature on a tiny GPT, trained straight through or
saved and resumed in a new launch (importable by ``tests.helpers.run_ranks`` ranks)."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

VOCAB, SEQ, LAYERS, SAMPLES = 64, 16, 4, 240


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


def run_jobs(rank: int, world: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from dsrun import comm

    try:
        return [run_job(rank, world, job) for job in jobs]
    finally:
        if comm.is_initialized():
            comm.destroy_process_group()


def run_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import dsrun
    from dsrun import comm
    from dsrun.models.gpt import GPT
    from dsrun.models.layers import Block
    from dsrun.data_efficiency import convert_to_random_ltd

    random.seed(11 + rank)
    np.random.seed(11 + rank)
    torch.manual_seed(1234)
    model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=2, n_embd=32, dropout=0.1)
    torch.manual_seed(11 + rank)  # per-rank dropout and token-drop streams
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 2},
              "steps_per_print": 1000, **feature_config(job["feature"], job["index_dir"])}
    data = Windows()
    engine, _, loader, _ = dsrun.initialize(model=model, config=config,
                                            training_data=data if job["feature"] in ("sampling", "all") else None)
    if engine.random_ltd_enabled():
        convert_to_random_ltd(engine, Block)
    if loader is None:  # a fixed stream: batch k of this rank is window (k·world + rank) mod SAMPLES, etc.
        loader = _Stream(data, rank, world)
    result: dict[str, Any] = {"losses": []}
    if job.get("load"):
        _, client = engine.load_checkpoint(job["load"])
        if isinstance(loader, _Stream):
            loader.position = client["position"]
    for _ in range(job["steps"]):
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
        if engine.global_steps == job.get("save_at"):
            engine.save_checkpoint(job["save_dir"], client_state={"position": getattr(loader, "position", 0)})
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
