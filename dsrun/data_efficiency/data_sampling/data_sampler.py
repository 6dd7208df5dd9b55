"""``DeepSpeedDataSampler``: batches drawn only from samples under the current curriculum difficulty.

DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.data_sampler.DeepSpeedDataSampler`` (same
constructor; it yields this rank's micro-batch indices). At every global batch (``micro_batch × data-parallel
size × gradient_accumulation_steps`` samples) the curriculum step advances and each metric's scheduler gives
its difficulty. A metric with ``clustering_type: schedule_based`` admits the samples whose value is at most the
difficulty (``difficulty_type: value``, read from ``index_to_metric``/``index_to_sample``) or that lie in the
lowest ``difficulty`` percent (``percentile``, on the scale ``max_difficulty``); a ``single_cluster`` metric
admits everything (its difficulty only reaches the data post-processing, e.g. a seqlen truncation). When the
difficulties change, the samples newly admitted by every metric become a new cluster. A global batch picks each
slot's cluster with probability proportional to cluster size (so every admitted sample is equally likely),
takes the clusters' samples in a shuffled order (reshuffled at the end of each pass) and shuffles the batch.

What differs from DeepSpeed's, on purpose:

- every rank computes the same batches from the seed (no broadcast, no rank-0 cluster files needed to read);
- global batches are always full, so every rank's micro-batch has exactly ``micro_batch_size`` samples
  (DeepSpeed's can hand a rank an empty or short micro-batch when a small cluster runs out);
- a cluster is used only while the current difficulties admit it, so a ``custom`` schedule that lowers the
  difficulty never serves a sample above it;
- the state is a few counters (the shuffles are seeded by ``(seed, cluster, pass)`` and ``(seed, step)``):
  it round-trips through checkpoints and a resumed run draws the very batches the uninterrupted one would.

With ``data_cluster_path`` set, rank 0 also writes each cluster (its sample ids, ascending) there as
``cluster_<metric><difficulty>...`` index files, DeepSpeed's names, for inspection.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np

from dsrun.config.data_efficiency import DataEfficiencyConfig
from dsrun.config.sections import ds_section
from dsrun.utils.errors import ConfigError, Problem, UserError

from dsrun.data_efficiency.curriculum_scheduler import CurriculumScheduler
from dsrun.data_efficiency.data_sampling.indexed_dataset import MMapIndexedDataset, find_fit_int_dtype, write_items

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from dsrun.config.data_efficiency import CurriculumMetricConfig

PATH = "data_efficiency.data_sampling.curriculum_learning"
_SHUFFLE, _BATCH = 1, 2  # seed streams


class MetricFilter:
    """One curriculum metric: its scheduler and, for ``schedule_based``, the samples in difficulty order."""

    def __init__(self, name: str, config: CurriculumMetricConfig, num_samples: int):
        self.name = name
        self.scheduler = CurriculumScheduler(config, f"{PATH}.curriculum_metrics.{name}")
        self.difficulty_type = config.difficulty_type or "value"  # the schema leaves both unset (None)
        self.clustering_type = config.clustering_type or "schedule_based"
        self.max_difficulty = config.max_difficulty
        self.num_samples = num_samples
        if self.clustering_type == "single_cluster":
            return
        base = f"{PATH}.curriculum_metrics.{name}"
        sample_path = config.index_to_sample_path
        if not sample_path or not MMapIndexedDataset.exists(sample_path):
            raise UserError(Problem(f"{base}.index_to_sample_path", f"no index at {sample_path!r}",
                                    "run the DataAnalyzer over the training data and point here at its "
                                    f"{name}_index_to_sample files"))
        rows = MMapIndexedDataset(sample_path)
        self.order = rows.all_elements().astype(np.int64)  # samples, ascending difficulty
        self.row_ends = np.cumsum(rows.sizes.astype(np.int64))
        if len(self.order) != num_samples:
            raise UserError(Problem(f"{base}.index_to_sample_path", f"indexes {len(self.order)} samples but the "
                                    f"dataset has {num_samples}", "analyse this dataset (DataAnalyzer)"))
        if self.difficulty_type == "value":
            metric_path = config.index_to_metric_path
            if not metric_path or not MMapIndexedDataset.exists(metric_path):
                raise UserError(Problem(f"{base}.index_to_metric_path", f"no index at {metric_path!r}",
                                        "difficulty_type value needs the analyzer's index_to_metric file"))
            values = MMapIndexedDataset(metric_path).all_elements().astype(np.int64)
            if len(values) != len(rows):
                raise UserError(Problem(f"{base}.index_to_sample_path", f"has {len(rows)} rows but index_to_metric "
                                        f"has {len(values)}", "use the plain index_to_sample file with "
                                        "difficulty_type value (the percentile_merged one only with percentile)"))
            self.row_values = values

    def admitted_count(self, difficulty: int) -> int:
        """How many samples (a prefix of ``order``) this metric admits at ``difficulty``."""
        if self.difficulty_type == "value":
            rows = int(np.searchsorted(self.row_values, difficulty, side="right"))
            return int(self.row_ends[rows - 1]) if rows else 0
        if difficulty >= self.max_difficulty:
            return self.num_samples
        return (self.num_samples // self.max_difficulty) * max(0, int(difficulty))

    def admitted(self, difficulty: int) -> np.ndarray | None:
        """A boolean mask of admitted samples (None: all of them)."""
        if self.clustering_type == "single_cluster":
            return None
        mask = np.zeros(self.num_samples, dtype=bool)
        mask[self.order[: self.admitted_count(difficulty)]] = True
        return mask


class DeepSpeedDataSampler:
    """Yields this data-parallel rank's micro-batch sample indices; see the module docstring."""

    def __init__(self, data_efficiency_config: Mapping[str, Any] | DataEfficiencyConfig,
                 one_epoch_total_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, data_parallel_group: ProcessGroup | None = None,
                 gradient_accumulation_steps: int = 1, global_rank: int = 0, drop_last: bool = True):
        config = data_efficiency_config
        if not isinstance(config, DataEfficiencyConfig):  # DeepSpeed passes the section as a dict
            config = ds_section({"data_efficiency": dict(config)}, "data_efficiency")
        sampling = config.data_sampling
        curriculum = sampling.curriculum_learning
        if one_epoch_total_samples < 1 or micro_batch_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data sampler: {one_epoch_total_samples} samples, micro batch {micro_batch_size}, "
                             f"rank {data_parallel_rank} of {data_parallel_size}")
        self.seed = int(config.seed)
        self.one_epoch_total_samples = int(one_epoch_total_samples)
        self.total_samples = self.one_epoch_total_samples * int(sampling.num_epochs)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank, self.data_parallel_size = int(data_parallel_rank), int(data_parallel_size)
        self.data_parallel_group = data_parallel_group
        self.micro_batch_times_data_parallel_size = self.micro_batch_size * self.data_parallel_size
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        self.global_batch_size = self.micro_batch_times_data_parallel_size * self.gradient_accumulation_steps
        self.global_rank = global_rank
        self.drop_last = drop_last
        self.cluster_path = curriculum.data_cluster_path
        metrics = curriculum.curriculum_metrics or {}
        if not curriculum.enabled or not metrics:
            raise ConfigError(Problem(f"{PATH}.curriculum_metrics", "the data sampler needs an enabled curriculum "
                                      "with at least one metric"))
        self.metrics = {name: MetricFilter(name, m, self.one_epoch_total_samples)
                        for name, m in metrics.items()}
        self.curriculum_schedulers = {name: m.scheduler for name, m in self.metrics.items()}
        self._reset()

    def _reset(self) -> None:
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, int] = {}
        self.clusters: list[np.ndarray] = []
        self.cluster_difficulties: list[dict[str, int]] = []
        self.data_cluster_paths: list[str] = []
        self.data_cluster_current_position: list[int] = []
        self.cluster_passes: list[int] = []
        self._covered = np.zeros(self.one_epoch_total_samples, dtype=bool)

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], int]]) -> None:
        for metric, scheduler in self.curriculum_schedulers.items():
            if metric in schedule_func_dict:
                scheduler.set_custom_get_difficulty(schedule_func_dict[metric])

    # --- clusters --------------------------------------------------------------------------------------
    def admitted(self, difficulties: Mapping[str, int]) -> np.ndarray:
        """A boolean mask of the samples every metric admits at ``difficulties``."""
        mask = np.ones(self.one_epoch_total_samples, dtype=bool)
        for name, metric in self.metrics.items():
            part = metric.admitted(difficulties[name])
            if part is not None:
                mask &= part
        return mask

    def _add_cluster(self, difficulties: dict[str, int], write: bool) -> None:
        new = self.admitted(difficulties) & ~self._covered
        members = np.flatnonzero(new)
        if not len(members):
            return
        self._covered |= new
        name = "cluster" + "".join(f"_{metric}{value}" for metric, value in difficulties.items())
        self.clusters.append(members)
        self.cluster_difficulties.append(dict(difficulties))
        self.data_cluster_paths.append(name)
        self.data_cluster_current_position.append(0)
        self.cluster_passes.append(0)
        if write and self.cluster_path and self.global_rank == 0:
            Path(self.cluster_path).mkdir(parents=True, exist_ok=True)
            write_items(Path(self.cluster_path) / name, find_fit_int_dtype(0, self.one_epoch_total_samples - 1),
                        members, np.array([len(members)]))

    def _pass_order(self, cidx: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, _SHUFFLE, cidx, self.cluster_passes[cidx]]))
        return self.clusters[cidx][rng.permutation(len(self.clusters[cidx]))]

    def _take(self, cidx: int, count: int) -> list[int]:
        """The next ``count`` samples of cluster ``cidx``, starting a new shuffled pass whenever one ends."""
        taken: list[int] = []
        order = self._pass_order(cidx)
        while count:
            position = self.data_cluster_current_position[cidx]
            chunk = order[position:position + count]
            taken.extend(int(i) for i in chunk)
            count -= len(chunk)
            self.data_cluster_current_position[cidx] = position + len(chunk)
            if self.data_cluster_current_position[cidx] == len(order):
                self.cluster_passes[cidx] += 1
                self.data_cluster_current_position[cidx] = 0
                order = self._pass_order(cidx)
        return taken

    def _active_clusters(self) -> list[int]:
        return [c for c, made_at in enumerate(self.cluster_difficulties)
                if all(made_at[m] <= self.current_difficulties[m] for m in made_at)]

    def get_next_global_batch(self) -> None:
        self.curriculum_step += 1
        previous = dict(self.current_difficulties)
        for name, scheduler in self.curriculum_schedulers.items():
            self.current_difficulties[name] = scheduler.update_difficulty(self.curriculum_step)
        if self.current_difficulties != previous:
            self._add_cluster(dict(self.current_difficulties), write=True)
        active = self._active_clusters()
        if not active:
            raise UserError(Problem(f"{PATH}.curriculum_metrics", f"no sample is admitted at step "
                                    f"{self.curriculum_step} (difficulties {self.current_difficulties})",
                                    "raise min_difficulty to at least the smallest value the analyzer found"))
        sizes = np.array([len(self.clusters[c]) for c in active], dtype=np.float64)
        rng = np.random.Generator(np.random.PCG64([self.seed, _BATCH, self.curriculum_step]))
        picks = np.bincount(rng.choice(len(active), self.global_batch_size, p=sizes / sizes.sum()),
                            minlength=len(active))
        batch: list[int] = []
        for slot, count in zip(active, picks):
            batch += self._take(slot, int(count))
        self.batch = [int(i) for i in rng.permutation(np.asarray(batch, dtype=np.int64))]

    def get_start_end_idx(self, batch_len: int | None = None) -> tuple[int, int]:
        """This rank's slice of a micro-batch of all ranks (``batch_len`` samples)."""
        batch_len = batch_len or self.micro_batch_times_data_parallel_size
        bound = lambda r: round(r * batch_len / self.data_parallel_size)  # noqa: E731
        return bound(self.data_parallel_rank), bound(self.data_parallel_rank + 1)

    def __iter__(self) -> Iterator[list[int]]:
        while self.consumed_samples < self.total_samples:
            yield self.next_indices()

    def next_indices(self) -> list[int]:
        """This rank's next micro-batch (every rank advances the same global position)."""
        if not self.batch:
            self.get_next_global_batch()
        current = self.batch[:self.micro_batch_times_data_parallel_size]
        self.batch = self.batch[self.micro_batch_times_data_parallel_size:]
        start, end = self.get_start_end_idx(len(current))
        self.consumed_samples += len(current)
        return current[start:end]

    # --- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"batch": list(self.batch), "consumed_samples": self.consumed_samples,
                "curriculum_step": self.curriculum_step, "current_difficulties": dict(self.current_difficulties),
                "data_cluster_paths": list(self.data_cluster_paths),
                "data_cluster_current_position": list(self.data_cluster_current_position),
                "data_cluster_difficulties": [dict(d) for d in self.cluster_difficulties],
                "data_cluster_passes": list(self.cluster_passes), "seed": self.seed,
                "curriculum_schedulers": {n: s.state_dict() for n, s in self.curriculum_schedulers.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if int(state_dict.get("seed", self.seed)) != self.seed:
            raise UserError(Problem("data_efficiency.seed", f"the checkpoint's sampler used seed {state_dict['seed']}, "
                                    f"this run {self.seed}", "resume with the same seed"))
        self._reset()
        for made_at in state_dict["data_cluster_difficulties"]:  # rebuild the same clusters, in order
            self._add_cluster(dict(made_at), write=False)
        self.batch = [int(i) for i in state_dict["batch"]]
        self.consumed_samples = int(state_dict["consumed_samples"])
        self.curriculum_step = int(state_dict["curriculum_step"])
        self.current_difficulties = dict(state_dict["current_difficulties"])
        self.data_cluster_current_position = [int(p) for p in state_dict["data_cluster_current_position"]]
        self.cluster_passes = [int(p) for p in state_dict["data_cluster_passes"]]
        for name, state in state_dict.get("curriculum_schedulers", {}).items():
            if name in self.curriculum_schedulers:
                self.curriculum_schedulers[name].load_state_dict(state)
