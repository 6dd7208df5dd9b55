"""``DataAnalyzer``: the offline map-reduce that measures every sample's difficulty and indexes it.

DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.data_analyzer.DataAnalyzer`` (same constructor and
``run_map`` / ``run_reduce`` / ``run_map_reduce``). Map: worker ``worker_id`` of ``num_workers`` (and each of
its ``num_threads`` processes) takes a contiguous slice of the dataset, computes the metric functions on
batches (a function gets a collated batch and returns one integer per sample, or for
``accumulate_value_over_samples`` an integer array summed over all samples), and writes its values. Reduce
(worker 0, after every worker is done) merges them, per metric, into ``SAVE_PATH/METRIC/``:

- ``METRIC_sample_to_metric``: item ``i`` is sample ``i``'s value;
- ``METRIC_index_to_metric``: item ``j`` is the ``j``-th distinct value, ascending;
- ``METRIC_index_to_sample``: item ``j`` is the samples with that value, ascending;
- ``METRIC_index_to_sample_percentile_merged``: ``index_to_sample`` rows concatenated in about 100 groups;
- ``METRIC_metric_value`` (accumulated metrics): the sum.

Unlike DeepSpeed's, the output does not depend on the worker or thread count (byte for byte: the reduce
orders by value, then sample id; integer sums are exact), every file of one metric uses one value dtype and
one sample-id dtype (the smallest integer types that fit), the per-worker files are removed after the
reduce, and no file is ever empty.
"""
from __future__ import annotations

import multiprocessing as mp
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from dsrun.utils.errors import Problem, UserError

from dsrun.data_efficiency.data_sampling.indexed_dataset import IndexDType, MMapIndexedDataset, find_fit_int_dtype, numpy_dtype, write_items

if TYPE_CHECKING:
    import numpy.typing as npt
    from torch.distributed import ProcessGroup
    from torch.utils.data import Dataset

SINGLE_VALUE, ACCUMULATE = "single_value_per_sample", "accumulate_value_over_samples"


def split_index(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[start, end)``, sizes differing by at most one (DeepSpeed's)."""
    bounds = np.linspace(start, end, num=parts + 1, dtype=int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


def _fetch(dataset: Dataset, indices: list[int], collate_fn: Callable | None) -> Any:
    """A collated batch: read at once from a dataset with a ``batch(indices)`` method (dsrun's token windows),
    else item by item through ``collate_fn`` (default: torch's ``default_collate``)."""
    if collate_fn is None and callable(getattr(dataset, "batch", None)):
        return dataset.batch(indices)
    items = [dataset[i] for i in indices]
    return (collate_fn or torch.utils.data.default_collate)(items)


def _as_array(values: torch.Tensor | npt.ArrayLike, name: str) -> np.ndarray:
    array = values.cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    if array.dtype.kind not in "iu":
        raise UserError(Problem(f"metric {name!r}", f"returned {array.dtype} values; metrics are integers",
                                "scale and round them (e.g. int(100 * value)), as the index stores integers"))
    return array


class DataAnalyzer:
    """See the module docstring; ``metric_dtypes`` declares each function's result dtype (checked)."""

    def __init__(self, dataset: Dataset, num_workers: int = 1, worker_id: int = 0, num_threads: int = 1,
                 num_threads_reduce: int = 1, specific_threads: Sequence[int] = (), batch_size: int = 1,
                 metric_names: Sequence[str] = (), metric_functions: Sequence[Callable] = (),
                 metric_types: Sequence[str] = (), metric_dtypes: Sequence[IndexDType] = (), save_path: str = "./",
                 collate_fn: Callable | None = None, custom_map_init: Callable | None = None,
                 custom_map_update: Callable | None = None, custom_map_finalize: Callable | None = None,
                 custom_reduce: Callable | None = None, sample_indices: Sequence[int] | None = None):
        if not len(metric_names) == len(metric_functions) == len(metric_types):
            raise UserError(Problem("DataAnalyzer", "metric_names, metric_functions and metric_types differ in "
                                    "length", "give one name, function and type per metric"))
        bad = [t for t in metric_types if t not in (SINGLE_VALUE, ACCUMULATE)]
        if bad:
            raise UserError(Problem("DataAnalyzer(metric_types=...)", f"got {bad[0]!r}; allowed: {SINGLE_VALUE}, "
                                    f"{ACCUMULATE}"))
        if len(dataset) < 1:
            raise UserError(Problem("DataAnalyzer(dataset=...)", "the dataset is empty"))
        if not 0 <= worker_id < num_workers:
            raise UserError(Problem("DataAnalyzer(worker_id=...)", f"{worker_id} is not in [0, {num_workers})"))
        self.dataset = dataset
        self.num_workers, self.worker_id = int(num_workers), int(worker_id)
        self.num_threads, self.num_threads_reduce = int(num_threads), int(num_threads_reduce)
        self.specific_threads = list(specific_threads)
        self.batch_size = max(1, int(batch_size))
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types = list(metric_types)
        self.metric_dtypes = [numpy_dtype(d) for d in metric_dtypes] if metric_dtypes else [None] * len(metric_names)
        self.save_path = Path(save_path)
        self.collate_fn = collate_fn
        self.custom_map_init, self.custom_map_update = custom_map_init, custom_map_update
        self.custom_map_finalize, self.custom_reduce = custom_map_finalize, custom_reduce
        self.sample_indices = None if sample_indices is None else np.asarray(sample_indices, dtype=np.int64)
        self.num_samples = len(dataset) if self.sample_indices is None else len(self.sample_indices)

    # --- map -----------------------------------------------------------------------------------------
    def _part_dir(self, metric: str, worker: int, thread: int) -> Path:
        return self.save_path / metric / f"worker{worker}_thread{thread}"

    def _check_dtype(self, m: int, array: np.ndarray) -> None:
        declared = self.metric_dtypes[m]
        if declared is not None and array.dtype.type is not declared:
            raise UserError(Problem(f"metric {self.metric_names[m]!r}", f"returned {array.dtype}, declared "
                                    f"{np.dtype(declared).name} in metric_dtypes", "make them agree"))

    def run_map_helper(self, thread_id: int) -> None:
        """Compute this worker's thread ``thread_id`` share and write it under ``METRIC/workerW_threadT/``."""
        start, end = self.thread_splits[thread_id]
        values: list[list[np.ndarray]] = [[] for _ in self.metric_names]
        totals: list[np.ndarray | None] = [None for _ in self.metric_names]
        started, done = time.perf_counter(), 0
        for first in range(start, end, self.batch_size):
            positions = list(range(first, min(end, first + self.batch_size)))
            indices = positions if self.sample_indices is None else [int(self.sample_indices[p]) for p in positions]
            batch = _fetch(self.dataset, indices, self.collate_fn)
            for m, fn in enumerate(self.metric_functions):
                array = _as_array(fn(batch), self.metric_names[m])
                self._check_dtype(m, array)
                if self.metric_types[m] == SINGLE_VALUE:
                    if array.reshape(-1).shape[0] != len(positions):
                        raise UserError(Problem(f"metric {self.metric_names[m]!r}", f"returned {array.size} values "
                                                f"for a batch of {len(positions)}", "return one value per sample"))
                    values[m].append(array.reshape(-1).astype(np.int64))
                else:
                    summed = array.astype(np.int64)
                    totals[m] = summed if totals[m] is None else totals[m] + summed
            done += len(positions)
        for m, name in enumerate(self.metric_names):
            part = self._part_dir(name, self.worker_id, thread_id)
            part.mkdir(parents=True, exist_ok=True)
            if self.metric_types[m] == SINGLE_VALUE:
                if start == end:
                    continue  # nothing assigned: no file (DeepSpeed leaves an empty one)
                data = np.concatenate(values[m])
                np.save(part / f"{name}_values.npy", data)
            elif totals[m] is not None:
                np.save(part / f"{name}_sum.npy", totals[m])
        self.map_seconds = time.perf_counter() - started

    def run_map(self) -> None:
        """This worker's map: its slice of the dataset, split over ``num_threads`` processes."""
        worker_range = split_index(0, self.num_samples, self.num_workers)[self.worker_id]
        self.thread_splits = split_index(worker_range[0], worker_range[1], self.num_threads)
        threads = self.specific_threads or list(range(self.num_threads))
        if self.custom_map_init is not None or self.custom_map_update is not None:
            raise UserError(Problem("DataAnalyzer(custom_map_*=...)", "custom map functions are not supported",
                                    "compute the value inside metric_functions"))
        if len(threads) == 1:
            self.run_map_helper(threads[0])
            return
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=self.run_map_helper, args=(t,)) for t in threads]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        failed = [t for t, p in zip(threads, procs) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"data analyzer map threads {failed} of worker {self.worker_id} failed")

    # --- reduce --------------------------------------------------------------------------------------
    def _parts(self, metric: str) -> list[Path]:
        """Every worker's and thread's part folder, in sample order."""
        return [self._part_dir(metric, w, t) for w in range(self.num_workers) for t in range(self.num_threads)]

    def merge_single_value(self, metric: str) -> None:
        chunks = [np.load(p / f"{metric}_values.npy") for p in self._parts(metric) if (p / f"{metric}_values.npy").is_file()]
        values = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        total = self.num_samples
        if len(values) != total:
            raise RuntimeError(f"metric {metric!r}: the map results hold {len(values)} of {total} samples "
                               "(did every worker finish run_map?)")
        sample_ids = (np.arange(total, dtype=np.int64) if self.sample_indices is None else self.sample_indices)
        out = self.save_path / metric
        value_dtype = find_fit_int_dtype(int(values.min()), int(values.max()))
        sample_dtype = find_fit_int_dtype(0, int(sample_ids.max()))
        order = np.lexsort((sample_ids, values))  # by value, then sample id: independent of the split
        sorted_values, sorted_samples = values[order], sample_ids[order]
        distinct, counts = np.unique(sorted_values, return_counts=True)
        write_items(out / f"{metric}_sample_to_metric", value_dtype, values[np.argsort(sample_ids, kind="stable")],
                    np.ones(total, dtype=np.int64))
        write_items(out / f"{metric}_index_to_metric", value_dtype, distinct, np.ones(len(distinct), dtype=np.int64))
        write_items(out / f"{metric}_index_to_sample", sample_dtype, sorted_samples, counts)
        step = max(1, len(distinct) // 100)
        merged = np.add.reduceat(counts, np.arange(0, len(counts), step))
        write_items(out / f"{metric}_index_to_sample_percentile_merged", sample_dtype, sorted_samples, merged)

    def merge_accumulated(self, metric: str) -> None:
        sums = [np.load(p / f"{metric}_sum.npy") for p in self._parts(metric) if (p / f"{metric}_sum.npy").is_file()]
        if not sums:
            raise RuntimeError(f"metric {metric!r}: no map results (did every worker finish run_map?)")
        total = np.sum(sums, axis=0)
        dtype = find_fit_int_dtype(int(total.min()), int(total.max()))
        write_items(self.save_path / metric / f"{metric}_metric_value", dtype, total.reshape(-1),
                    np.array([total.size]))

    def run_reduce(self) -> None:
        """Merge every worker's map results into the final indexes and remove the per-worker files."""
        if self.custom_reduce is not None:
            self.custom_reduce(self.dataset, self.metric_names, self.metric_types, str(self.save_path),
                               self.num_workers, self.num_threads, self.num_threads_reduce)
            return
        for name, kind in zip(self.metric_names, self.metric_types):
            if kind == SINGLE_VALUE:
                self.merge_single_value(name)
            else:
                self.merge_accumulated(name)
            for part in self._parts(name):
                shutil.rmtree(part, ignore_errors=True)

    def run_map_reduce(self, comm_group: ProcessGroup | None = None) -> None:
        """Map on every worker (one per rank), a barrier, the reduce on worker 0, a barrier."""
        from dsrun import comm

        self.run_map()
        if comm.is_initialized():
            comm.barrier(group=comm_group)
        if self.worker_id == 0:
            self.run_reduce()
        if comm.is_initialized():
            comm.barrier(group=comm_group)


def load_metric_index(save_path: str | Path, metric: str) -> dict[str, MMapIndexedDataset]:
    """The files the reduce wrote for ``metric``, by kind (``sample_to_metric``, ``index_to_metric``, ...)."""
    base = Path(save_path) / metric
    kinds = ("sample_to_metric", "index_to_metric", "index_to_sample", "index_to_sample_percentile_merged",
             "metric_value")
    return {k: MMapIndexedDataset(base / f"{metric}_{k}") for k in kinds if MMapIndexedDataset.exists(base / f"{metric}_{k}")}
