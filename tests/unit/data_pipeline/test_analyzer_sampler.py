"""DataAnalyzer (identical output for any worker count, correct indexes, no empty files) and the curriculum
data sampler (only admitted samples, equal per-rank micro-batches, exact state round trips)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from dsrun.data_efficiency.data_sampling import (CurriculumDataLoader, DataAnalyzer, DeepSpeedDataSampler,
                                                       MMapIndexedDataset)
from dsrun.data_efficiency.data_sampling.data_analyzer import load_metric_index
from dsrun.utils.errors import UserError

N, T, V = 1003, 12, 50


class Windows(torch.utils.data.Dataset):
    """``N`` deterministic token windows; window i holds tokens below ``i % V + 1``."""

    def __init__(self, n: int = N):
        rng = np.random.default_rng(0)
        self.tokens = np.stack([rng.integers(0, i % V + 1, T) for i in range(n)]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.tokens[i])


def max_token(batch: torch.Tensor) -> torch.Tensor:
    return batch.max(dim=1).values


def first_token(batch: torch.Tensor) -> torch.Tensor:
    return batch[:, 0]


def token_counts(batch: torch.Tensor) -> torch.Tensor:
    return torch.bincount(batch.reshape(-1), minlength=V)


METRICS = dict(metric_names=["maxtoken", "firsttoken", "counts"], metric_functions=[max_token, first_token, token_counts],
               metric_types=["single_value_per_sample", "single_value_per_sample", "accumulate_value_over_samples"])


def analyse(root: Path, workers: int, batch_size: int = 37) -> Path:
    data = Windows()
    for worker in range(workers):  # each worker's map (on its own host in real use), then worker 0 reduces
        DataAnalyzer(data, num_workers=workers, worker_id=worker, batch_size=batch_size,
                     metric_dtypes=[torch.int64] * 3, save_path=str(root), **METRICS).run_map()
    DataAnalyzer(data, num_workers=workers, save_path=str(root), **METRICS).run_reduce()
    return root


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_analyzer_output_is_byte_identical_for_1_2_and_4_workers(tmp_path):
    outputs = [digest(analyse(tmp_path / f"w{w}", w, batch_size=b)) for w, b in ((1, 37), (2, 5), (4, 200))]
    assert outputs[0] == outputs[1] == outputs[2]
    files = sorted((tmp_path / "w4").rglob("*"))
    assert not [p for p in files if p.is_dir() and "worker" in p.name]  # per-worker parts removed
    assert all(p.stat().st_size > 0 for p in files if p.is_file())        # no empty file
    assert len([p for p in files if p.is_file()]) == 18                     # 2 metrics x 4 indexes x 2 + metric_value


def test_analyzer_indexes_are_correct(tmp_path):
    data = Windows()
    index = load_metric_index(analyse(tmp_path, 2), "maxtoken")
    truth = data.tokens.max(axis=1)
    assert [int(index["sample_to_metric"][i][0]) for i in range(N)] == truth.tolist()
    values = [int(index["index_to_metric"][j][0]) for j in range(len(index["index_to_metric"]))]
    assert values == sorted(set(truth.tolist()))
    for j, value in enumerate(values):
        assert index["index_to_sample"][j].tolist() == np.flatnonzero(truth == value).tolist()
    merged = np.concatenate(index["index_to_sample_percentile_merged"][:])
    assert merged.tolist() == np.concatenate(index["index_to_sample"][:]).tolist()
    # one dtype per role: the smallest that fits (values <= 49: uint8; sample ids <= 1002: uint16)
    assert index["sample_to_metric"].dtype is np.uint8 and index["index_to_metric"].dtype is np.uint8
    assert index["index_to_sample"].dtype is np.uint16
    counts = load_metric_index(tmp_path, "counts")["metric_value"][0]
    assert counts.tolist() == np.bincount(data.tokens.reshape(-1), minlength=V).tolist()


def test_index_files_use_the_megatron_layout(tmp_path):
    analyse(tmp_path, 1)
    head = (tmp_path / "maxtoken" / "maxtoken_index_to_sample.idx").read_bytes()
    assert head[:9] == b"MMIDIDX\x00\x00" and head[9:17] == (1).to_bytes(8, "little") and head[17] == 6  # uint16


def test_analyzer_refuses_float_metrics(tmp_path):
    with pytest.raises(UserError, match="integers"):
        DataAnalyzer(Windows(), metric_names=["m"], metric_functions=[lambda b: b.float().mean(dim=1)],
                     metric_types=["single_value_per_sample"], save_path=str(tmp_path)).run_map()


def sampling_config(root: Path, **metric_overrides) -> dict:
    metric = {"index_to_sample_path": str(root / "maxtoken" / "maxtoken_index_to_sample"),
              "index_to_metric_path": str(root / "maxtoken" / "maxtoken_index_to_metric"),
              "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 5,
              "max_difficulty": 49, "schedule_type": "fixed_linear",
              "schedule_config": {"total_curriculum_step": 40, "difficulty_step": 1}}
    metric.update(metric_overrides)
    return {"enabled": True, "seed": 7, "data_sampling": {"enabled": True, "num_epochs": 100, "curriculum_learning": {
        "enabled": True, "data_cluster_path": str(root / "clusters"), "curriculum_metrics": {"maxtoken": metric}}}}


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    return analyse(tmp_path_factory.mktemp("index"), 1)


def draw(config, world: int, micro: int, gas: int, steps: int) -> list[list[list[int]]]:
    """Per rank, the micro-batches of ``steps`` global batches."""
    samplers = [DeepSpeedDataSampler(config, N, micro, r, world, gradient_accumulation_steps=gas) for r in range(world)]
    return [[s.next_indices() for _ in range(steps * gas)] for s in samplers]


@pytest.mark.parametrize("world,micro,gas", [(1, 8, 1), (2, 3, 2), (3, 5, 1), (4, 2, 3)])
def test_sampler_serves_only_admitted_samples_in_equal_micro_batches(indexed, world, micro, gas):
    truth = Windows().tokens.max(axis=1)
    per_rank = draw(sampling_config(indexed), world, micro, gas, steps=60)
    for step in range(60):
        threshold = min(49, int(np.floor((step + 1) / 40 * 44 + 5)))  # fixed_linear at curriculum step + 1
        batch = [i for r in range(world) for m in per_rank[r][step * gas:(step + 1) * gas] for i in m]
        assert all(truth[i] <= threshold for i in batch), step   # 100% under the current difficulty
        assert len(batch) == world * micro * gas
        sizes = {len(m) for r in range(world) for m in per_rank[r][step * gas:(step + 1) * gas]}
        assert sizes == {micro}                                   # every rank, every micro-batch: full


def test_sampler_percentile_and_a_second_metric(indexed):
    truth = Windows().tokens.max(axis=1)
    order = np.concatenate(MMapIndexedDataset(indexed / "maxtoken" / "maxtoken_index_to_sample")[:])
    config = sampling_config(indexed, difficulty_type="percentile", min_difficulty=10, max_difficulty=100,
                             index_to_sample_path=str(indexed / "maxtoken" / "maxtoken_index_to_sample_percentile_merged"),
                             schedule_config={"total_curriculum_step": 20, "difficulty_step": 10})
    sampler = DeepSpeedDataSampler(config, N, 16, 0, 1)
    for _ in range(30):
        batch = sampler.next_indices()
        pct = sampler.current_difficulties["maxtoken"]
        allowed = set(order[: (N // 100) * pct].tolist()) if pct < 100 else set(range(N))
        assert set(batch) <= allowed
    # a second metric (single_cluster: it admits everything, its difficulty only reaches the post-processing)
    config = sampling_config(indexed)
    config["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["seqlen"] = {
        "difficulty_type": "value", "clustering_type": "single_cluster", "min_difficulty": 4, "max_difficulty": T,
        "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 4}}
    sampler = DeepSpeedDataSampler(config, N, 8, 0, 1)
    seen = []
    for _ in range(12):
        batch = sampler.next_indices()
        assert all(truth[i] <= sampler.current_difficulties["maxtoken"] for i in batch)
        seen.append(sampler.current_difficulties["seqlen"])
    assert seen[0] == 4 and seen[-1] == T


def test_two_schedule_based_metrics_admit_only_samples_both_allow(indexed):
    data = Windows().tokens
    config = sampling_config(indexed)
    config["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["firsttoken"] = {
        "index_to_sample_path": str(indexed / "firsttoken" / "firsttoken_index_to_sample"),
        "index_to_metric_path": str(indexed / "firsttoken" / "firsttoken_index_to_metric"),
        "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 2, "max_difficulty": 49,
        "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [2, 10, 49], "max_step": [10, 20]}}
    sampler = DeepSpeedDataSampler(config, N, 8, 0, 1)
    for _ in range(40):
        batch = sampler.next_indices()
        limits = sampler.current_difficulties
        assert all(data[i].max() <= limits["maxtoken"] and data[i][0] <= limits["firsttoken"] for i in batch)
    assert len(sampler.clusters) > 3


def test_custom_schedule_that_lowers_the_difficulty_never_serves_above_it(indexed):
    truth = Windows().tokens.max(axis=1)
    config = sampling_config(indexed, schedule_type="custom")
    del config["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["maxtoken"]["schedule_config"]
    sampler = DeepSpeedDataSampler(config, N, 8, 0, 1)
    pacing = [10, 30, 49, 20, 8, 40]
    sampler.set_custom_curriculum_learning_schedule({"maxtoken": lambda step: pacing[(step - 1) % len(pacing)]})
    for _ in range(24):
        batch = sampler.next_indices()
        assert all(truth[i] <= sampler.current_difficulties["maxtoken"] for i in batch)


def test_sampler_state_round_trip_resumes_exactly(indexed, tmp_path):
    config = sampling_config(indexed)
    full = DeepSpeedDataSampler(config, N, 4, 1, 2, gradient_accumulation_steps=2)
    expected = [full.next_indices() for _ in range(300)]  # passes through small clusters many times
    first = DeepSpeedDataSampler(config, N, 4, 1, 2, gradient_accumulation_steps=2)
    head = [first.next_indices() for _ in range(117)]     # mid global batch
    state = torch.load(_saved(first.state_dict(), tmp_path), weights_only=True)
    second = DeepSpeedDataSampler(config, N, 4, 1, 2, gradient_accumulation_steps=2)
    second.load_state_dict(state)
    assert head + [second.next_indices() for _ in range(183)] == expected
    assert sorted(p.name for p in (indexed / "clusters").iterdir())[0].startswith("cluster_maxtoken")


def _saved(state, tmp_path) -> Path:
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path


def test_loader_state_is_that_after_the_last_delivered_batch_even_with_workers(indexed):
    config = sampling_config(indexed)
    plain = CurriculumDataLoader(Windows(), DeepSpeedDataSampler(config, N, 4, 0, 1))
    expected = [next(plain) for _ in range(12)]
    ahead = CurriculumDataLoader(Windows(), DeepSpeedDataSampler(config, N, 4, 0, 1), num_workers=1)
    got = [next(ahead) for _ in range(5)]
    state = ahead.state_dict()
    resumed = CurriculumDataLoader(Windows(), DeepSpeedDataSampler(config, N, 4, 0, 1))
    resumed.load_state_dict(state)
    got += [next(resumed) for _ in range(7)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_sampler_names_a_missing_index(tmp_path):
    with pytest.raises(UserError, match="index_to_sample_path"):
        DeepSpeedDataSampler(sampling_config(tmp_path / "nowhere"), N, 4, 0, 1)


def test_num_epochs_bounds_what_the_sampler_serves(indexed):
    config = sampling_config(indexed)
    config["data_sampling"]["num_epochs"] = 1
    served = list(DeepSpeedDataSampler(config, N, 10, 0, 1))
    assert len(served) == 101 and all(len(b) == 10 for b in served)  # one epoch: 1003 samples, in full batches of 10


def test_seed_workers_pinning_and_clusters_reach_the_sampler_and_loader(indexed, tmp_path):
    """``data_efficiency.seed`` reorders what is served, ``data_sampling.num_workers``/``pin_memory`` reach the
    loader, and ``curriculum_learning.data_cluster_path`` receives the cluster files (the support ledger's proof)."""
    from dsrun.config import load_ds_config
    from dsrun.data_efficiency.data_sampling.data_loader import build_curriculum_loader

    def loaded(seed: int, workers: int, pin: bool, clusters: Path):
        de = sampling_config(indexed)
        de["seed"] = seed
        de["data_sampling"].update(num_workers=workers, pin_memory=pin)
        de["data_sampling"]["curriculum_learning"]["data_cluster_path"] = str(clusters)
        cfg = load_ds_config({"train_micro_batch_size_per_gpu": 4, "data_efficiency": de})
        return build_curriculum_loader(cfg, Windows(), 4, 0, 1, 1)

    plain = loaded(7, 0, False, tmp_path / "a")
    other = loaded(8, 1, True, tmp_path / "b")
    assert (plain.num_workers, plain.pin_memory, other.num_workers, other.pin_memory) == (0, False, 1, True)
    served = [plain.data_sampler.next_indices() for _ in range(20)]
    assert served != [other.data_sampler.next_indices() for _ in range(20)]  # another seed, another order
    again = loaded(7, 0, False, tmp_path / "c").data_sampler
    assert served == [again.next_indices() for _ in range(20)]  # the same seed, the same order
    assert any(p.name.startswith("cluster_maxtoken") for p in (tmp_path / "a").iterdir())
