"""Variable batch size and learning rate: batches packed by token count, the LR scaled to each batch's size.

DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr`` (added after 0.14; the
``data_efficiency.data_sampling.dynamic_batching`` config section), with its names, arguments and results:

* :func:`batch_by_seqlens` packs samples, in the chosen order (``"dataloader"``, ``"random"`` with ``seed``,
  ``"seqlen"`` ascending), into micro-batches of at most ``max_tokens`` summed sequence length (and between
  ``min_batch_size`` and ``max_batch_size`` samples), greedily: each batch of ``k`` micro-batches is the longest
  run of the next samples that still fits, dealt out round-robin to its ``k`` micro-batches (``k`` is the
  effective batch size when every micro-batch of a batch must hold the same number of samples, as a pipeline
  needs, else 1). A sample longer than ``max_tokens`` is left out with a warning. The micro-batches are cut to a
  multiple of ``effective_batch_size`` and grouped, ``effective_batch_size`` at a time, into batches; each batch's
  sample count is the batch size its learning rate is scaled for. As DeepSpeed's, packing ends at the first
  sample from which no batch fits (e.g. fewer than ``min_batch_size`` samples fit in ``max_tokens``), and the
  search for a batch's end stops before the last sample of the ordered list, so that sample is never trained on;
  dsrun keeps both, so the
  same dataset and seed give DeepSpeed's batches exactly (``tests/unit/runtime/test_variable_batch.py``
  checks the packing against a direct transcription of DeepSpeed's search). DeepSpeed tries every end position
  for every batch; here one forward scan per batch finds the same end, since every constraint but the minimum
  size only tightens as a batch grows.
* :func:`dataloader_for_variable_batch_size`: a ``DataLoader`` over the micro-batches, dealt to the
  data-parallel ranks as ``DistributedSampler`` deals (rank ``r`` takes ``r, r + R, ...``), ``dataloader_batch_size``
  micro-batches per loader batch, their samples fetched, optionally padded to the batch's longest sequence
  (``sample_padding_fn``) and collated.
* :class:`VariableBatchSizeLR`: wraps a scheduler (or a constant LR) and scales each step's LR by the batch's
  size against ``base_batch_size``: ``"linear"`` (``lr * b / base``), ``"sqrt"`` (``lr * sqrt(b / base)``) or
  ``"none"``.
* :func:`get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed` reads the engine's
  ``dynamic_batching`` section (its sequence lengths given, or read from the Data Analyzer's ``seqlen`` metric
  under ``metrics_path``, or computed there first with ``batch_seqlens_fn``) and returns the loader, the
  scheduler and the keyword arguments of ``engine.deepspeed_io`` for the same loader.

The engine's own scheduler keeps stepping inside ``engine.step()`` as DeepSpeed's does; the returned
scheduler wraps it, and the script steps the wrapper as DeepSpeed's example does. Where DeepSpeed, handed the
ZeRO optimizer wrapper instead of a scheduler, would use the wrapper as a scheduler, dsrun keeps the LR
constant at the optimizer's (the only meaning that runs).
"""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dsrun.utils import logger
from dsrun.utils.errors import Problem, UserError

PICKING_ORDERS = ("dataloader", "random", "seqlen")
SCALING_METHODS = ("linear", "sqrt", "none")
MicrobatchIds = list[tuple[int, list[int]]]  # (batch id, the sample ids of one micro-batch)


def batch_by_seqlens(seqlens: Sequence[int], max_tokens: int, sequence_ids_per_mb: Sequence[int] | None = None,
                     min_batch_size: int = 1, max_batch_size: int | None = None,
                     sequence_picking_order: str = "dataloader", effective_batch_size: int = 1,
                     required_microbatches_of_same_size: bool = False, verbose: bool = False,
                     seed: int | None = None) -> tuple[MicrobatchIds, list[int], list[int]]:
    """Pack samples into micro-batches of at most ``max_tokens`` (module docstring). Returns each micro-batch's
    ``(batch id, sample ids)``, each batch's sample count and each batch's longest sequence."""
    if sequence_picking_order not in PICKING_ORDERS:
        raise UserError(Problem("sequence_picking_order", f"got {sequence_picking_order!r}",
                                f"one of {', '.join(PICKING_ORDERS)}"))
    ids = range(len(seqlens)) if sequence_ids_per_mb is None else [int(i) for i in sequence_ids_per_mb]
    items = [(seqlens[i], i) for i in ids]  # (length, sample id)
    if sequence_picking_order == "random":
        random.Random(seed).shuffle(items)
    elif sequence_picking_order == "seqlen":
        items.sort()
    too_long = [i for length, i in items if length > max_tokens]
    if too_long:
        logger.warning(f"Data indices {too_long} ignored as metrics exceed {max_tokens}.")
        dropped = set(too_long)
        items = [item for item in items if item[1] not in dropped]

    k = effective_batch_size if required_microbatches_of_same_size else 1
    microbatches: list[list[tuple[int, int]]] = []
    start, n = 0, len(items)
    while start < n:
        end = _longest_batch_end(items, start, k, max_tokens, max_batch_size)
        if end is None or (min_batch_size and (end - start) // k < min_batch_size):
            break  # no batch fits from here: DeepSpeed stops packing too
        batch = items[start:end]
        microbatches += [batch[b::k] for b in range(k)]
        start = end

    if len(microbatches) < effective_batch_size:
        raise UserError(Problem("dynamic_batching", f"the samples make {len(microbatches)} micro-batch(es), fewer "
                                f"than one batch of {effective_batch_size}", "lower train_batch_size or raise "
                                "max_tokens, or use more samples"))
    microbatches = microbatches[:len(microbatches) - len(microbatches) % effective_batch_size]

    microbatch_ids: MicrobatchIds = []
    batch_sizes: list[int] = []
    batch_max_seqlens: list[int] = []
    for batch_id, first in enumerate(range(0, len(microbatches), effective_batch_size)):
        group = microbatches[first:first + effective_batch_size]
        batch_sizes.append(sum(len(mb) for mb in group))
        batch_max_seqlens.append(max(length for mb in group for length, _ in mb))
        microbatch_ids += [(batch_id, [i for _, i in mb]) for mb in group]
        if verbose:
            logger.info(f"Batch id {batch_id} contains in total {len(group)} microbatches or {batch_sizes[-1]} "
                        f"sequences. n_sequences per microbatch {[len(mb) for mb in group]}. n_tokens per "
                        f"microbatch {[sum(length for length, _ in mb) for mb in group]}.")
    return microbatch_ids, batch_sizes, batch_max_seqlens


def _longest_batch_end(items: list[tuple[int, int]], start: int, k: int, max_tokens: int,
                       max_batch_size: int | None) -> int | None:
    """The largest ``end`` (``start + k``, ``start + 2k``, ... and below ``len(items)``, as DeepSpeed searches) whose
    run ``items[start:end]``, dealt round-robin into ``k`` micro-batches, keeps every micro-batch within
    ``max_tokens`` and ``max_batch_size``; None when not even ``start + k`` does. Both limits only tighten as the
    run grows, so the first end that breaks one ends the scan."""
    sums = [0] * k
    best = None
    end = start + k
    while end < len(items):
        for b in range(k):
            sums[b] += items[end - k + b][0]
        count = (end - start) // k
        if (max_batch_size and count > max_batch_size) or max(sums) > max_tokens:
            break
        best = end
        end += k
    return best


def scale_lr(base_batch_size: int, batch_size: int, base_lr: float = 1, method: str | None = "linear") -> float:
    """``base_lr`` for a batch of ``batch_size`` samples, given it suits ``base_batch_size``: ``linear`` scales by
    the ratio (Goyal et al.), ``sqrt`` by its square root (Krizhevsky), ``none`` (or None) keeps it."""
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    if method is None or method.lower() == "none":
        return base_lr
    raise UserError(Problem("lr_scaling_method", f"got {method!r}", "linear, sqrt or none"))


def dataloader_for_variable_batch_size(dataset: Dataset, microbatch_ids: MicrobatchIds,
                                       batch_max_seqlens: Sequence[int], dataloader_rank: int = 0,
                                       dataloader_batch_size: int = 1, dataloader_num_replicas: int = 1,
                                       dataloader_collate_fn: Callable | None = None,
                                       dataloader_num_workers: int = 2, dataloader_pin_memory: bool = False,
                                       required_microbatches_of_same_seqlen: bool = False,
                                       sample_padding_fn: Callable | None = None) -> tuple[DataLoader, dict[str, Any]]:
    """This rank's loader over the micro-batches, and the same loader as ``engine.deepspeed_io`` keyword
    arguments."""
    if required_microbatches_of_same_seqlen and sample_padding_fn is None:
        raise UserError(Problem("sample_padding_fn", "is required when micro-batches must share a sequence length "
                                "(a pipeline engine)", "pass sample_padding_fn(sample, length)"))
    sampler = DistributedSampler(microbatch_ids, num_replicas=dataloader_num_replicas, rank=dataloader_rank,
                                 shuffle=False, drop_last=False)

    def collate(entries: list[tuple[int, list[int]]]) -> Any:
        samples = []
        for batch_id, ids in entries:
            fetched = [dataset[i] for i in ids]
            if required_microbatches_of_same_seqlen:
                fetched = [sample_padding_fn(sample, batch_max_seqlens[batch_id]) for sample in fetched]
            samples += fetched
        return dataloader_collate_fn(samples) if dataloader_collate_fn else samples

    loader = DataLoader(microbatch_ids, batch_size=dataloader_batch_size, sampler=sampler,
                        num_workers=dataloader_num_workers, collate_fn=collate, pin_memory=dataloader_pin_memory)
    io_kwargs = dict(dataset=microbatch_ids, batch_size=dataloader_batch_size, pin_memory=dataloader_pin_memory,
                     data_sampler=sampler, collate_fn=collate, num_local_io_workers=dataloader_num_workers)
    return loader, io_kwargs


class _ConstantLR(LRScheduler):
    """The optimizer's LR, unchanged, as a scheduler (what is scaled when no scheduler is given)."""

    def get_lr(self) -> list[float]:
        return list(self.base_lrs)

    def step(self, epoch: int | None = None) -> None:
        """Nothing changes but the count (torch's step would warn about the epoch argument and the order)."""
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        self._last_lr = list(self.base_lrs)


class VariableBatchSizeLR(LRScheduler):
    """``lr_scheduler``'s LR scaled, at every step, for the size of the batch it applies to (``batch_sizes``, in
    loader order, cycled). ``step(0)`` starts over at the first batch with the base scheduler reset to its
    initial LRs (DeepSpeed's example calls it once per epoch)."""

    def __init__(self, lr_scheduler: Any, base_batch_size: int, batch_sizes: Sequence[int], dataloader: Any,
                 lr_scaling_method: str = "linear", last_epoch: int = -1, verbose: bool = False):
        # LRScheduler.__init__ is not run: the wrapped scheduler owns the optimizer's step counting
        self.base_lr_scheduler = lr_scheduler
        self.base_batch_size = base_batch_size
        self.batch_sizes = list(batch_sizes)
        self.dataloader = dataloader
        self.lr_scaling_method = lr_scaling_method
        self.base_lrs = list(lr_scheduler.get_lr())
        self.last_epoch = last_epoch
        self.verbose = verbose
        self.step(0)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.base_lr_scheduler.optimizer

    def state_dict(self) -> dict[str, Any]:
        return {"base_lr_scheduler": self.base_lr_scheduler.state_dict(), "base_batch_size": self.base_batch_size,
                "lr_scaling_method": self.lr_scaling_method, "batch_sizes": self.batch_sizes,
                "base_lrs": self.base_lrs, "last_epoch": self.last_epoch, "verbose": self.verbose}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base_lr_scheduler.load_state_dict(state_dict["base_lr_scheduler"])
        for key in ("base_batch_size", "lr_scaling_method", "batch_sizes", "base_lrs", "last_epoch", "verbose"):
            setattr(self, key, state_dict[key])

    def get_last_lr(self) -> list[float]:
        """The wrapped scheduler's last, unscaled LRs."""
        return self.base_lr_scheduler._last_lr

    def get_lr(self) -> list[float]:
        """The LRs the optimizer holds now (scaled)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:
        """Advance the wrapped scheduler (from its unscaled LRs), then scale for the next batch's size."""
        unscaled = self.base_lrs if epoch == 0 else self.get_last_lr()
        for group, lr in zip(self.optimizer.param_groups, unscaled):
            group["lr"] = lr
        self.base_lr_scheduler.step(epoch)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        size = self.batch_sizes[self.last_epoch % len(self.batch_sizes)]
        for group in self.optimizer.param_groups:
            group["lr"] = scale_lr(self.base_batch_size, size, group["lr"], self.lr_scaling_method)
        if self.verbose:
            logger.info(f"Next batch id {self.last_epoch}. Reference batch_size {self.base_batch_size} and lr "
                        f"{unscaled}. Scaled batch_size {size} and lr {self.get_lr()}.")


def lr_scheduler_for_variable_batch_size(base_batch_size: int, batch_sizes: Sequence[int], dataloader: Any,
                                         lr_scheduler_or_optimizer: Any, lr_scaling_method: str = "linear",
                                         verbose: bool = False) -> VariableBatchSizeLR:
    """A :class:`VariableBatchSizeLR` over a scheduler, or over an optimizer's constant LR."""
    target = lr_scheduler_or_optimizer
    if hasattr(target, "get_lr") and hasattr(target, "optimizer"):  # torch's or DeepSpeed's schedulers
        scheduler = target
    elif hasattr(target, "param_groups"):  # an optimizer: torch's, or dsrun's ZeRO wrapper of one
        scheduler = _ConstantLR(target)
    else:
        raise UserError(Problem("lr_scheduler_or_optimizer", f"is a {type(target).__name__}, neither an LR "
                                "scheduler nor an optimizer", "pass the engine's lr_scheduler or optimizer"))
    return VariableBatchSizeLR(scheduler, base_batch_size, batch_sizes, dataloader, lr_scaling_method,
                               verbose=verbose)


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset: Dataset, dataset_seqlens: Sequence[int], max_tokens: int, effective_batch_size: int,
        dataset_filter_ids: Sequence[int] | None = None, lr_scaling_method: str = "linear",
        min_batch_size: int = 1, max_batch_size: int | None = None, sequence_picking_order: str = "dataloader",
        dataloader_batch_size: int = 1, dataloader_rank: int = 0, dataloader_num_replicas: int = 1,
        dataloader_num_workers: int = 0, dataloader_collate_fn: Callable | None = None,
        dataloader_pin_memory: bool = False, lr_scheduler_or_optimizer: Any = None,
        required_microbatches_of_same_size: bool = False, required_microbatches_of_same_seqlen: bool = False,
        sample_padding_fn: Callable | None = None, verbose: bool = False,
        seed: int | None = None) -> tuple[DataLoader, VariableBatchSizeLR, dict[str, Any]]:
    """Pack, load and schedule (module docstring): the loader, the LR scheduler, ``deepspeed_io`` kwargs."""
    microbatch_ids, batch_sizes, batch_max_seqlens = batch_by_seqlens(
        dataset_seqlens, max_tokens, dataset_filter_ids, min_batch_size, max_batch_size, sequence_picking_order,
        effective_batch_size, required_microbatches_of_same_size, verbose, seed)
    loader, io_kwargs = dataloader_for_variable_batch_size(
        dataset, microbatch_ids, batch_max_seqlens, dataloader_rank, dataloader_batch_size,
        dataloader_num_replicas, dataloader_collate_fn, dataloader_num_workers, dataloader_pin_memory,
        required_microbatches_of_same_seqlen, sample_padding_fn)
    scheduler = lr_scheduler_for_variable_batch_size(effective_batch_size, batch_sizes, loader,
                                                     lr_scheduler_or_optimizer, lr_scaling_method, verbose)
    return loader, scheduler, io_kwargs


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset: Dataset, engine: Any, dataset_seqlens: Sequence[int] | None = None,
        dataset_filter_ids: Sequence[int] | None = None, dataloader_collate_fn: Callable | None = None,
        sample_padding_fn: Callable | None = None,
        batch_seqlens_fn: Callable | None = None) -> tuple[DataLoader, VariableBatchSizeLR, dict[str, Any]]:
    """The same for an engine, from its ``data_efficiency.data_sampling.dynamic_batching`` section."""
    from dsrun import comm

    config = engine._config
    sampling = config.data_efficiency.data_sampling
    batching = sampling.dynamic_batching
    if not batching.enabled:
        raise UserError(Problem("data_efficiency.data_sampling.dynamic_batching.enabled", "is false, but the "
                                "script asks for a dynamic-batching loader", "set it to true (with max_tokens)"))
    if dataset_seqlens is None:
        dataset_seqlens = _seqlens_from_analyzer(dataset, engine, batching.metrics_path, batch_seqlens_fn,
                                                 dataloader_collate_fn)
    group = engine.data_parallel_group
    pipelined = bool(getattr(engine, "pipeline_parallelism", False))
    engine.data_efficiency.dynamic_batching_loader_built = True
    return get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset=dataset, dataset_seqlens=dataset_seqlens, max_tokens=batching.max_tokens,
        effective_batch_size=engine.train_batch_size(), dataset_filter_ids=dataset_filter_ids,
        lr_scaling_method=batching.lr_scaling_method, min_batch_size=batching.min_batch_size,
        max_batch_size=batching.max_batch_size, sequence_picking_order=batching.sequence_picking_order,
        dataloader_batch_size=engine.train_micro_batch_size_per_gpu(),
        dataloader_rank=comm.get_rank(group) if comm.is_initialized() else 0,
        dataloader_num_replicas=comm.get_world_size(group) if comm.is_initialized() else 1,
        dataloader_num_workers=sampling.num_workers, dataloader_collate_fn=dataloader_collate_fn,
        dataloader_pin_memory=sampling.pin_memory, sample_padding_fn=sample_padding_fn,
        lr_scheduler_or_optimizer=engine.lr_scheduler or engine.optimizer,
        required_microbatches_of_same_size=pipelined, required_microbatches_of_same_seqlen=pipelined,
        verbose=batching.verbose, seed=config.data_efficiency.seed)


def _seqlens_from_analyzer(dataset: Dataset, engine: Any, metrics_path: str | None,
                           batch_seqlens_fn: Callable | None, collate_fn: Callable | None) -> np.ndarray:
    """Every sample's length from the Data Analyzer's ``seqlen`` metric under ``metrics_path`` (computed there
    first, on every data-parallel rank, when the files are missing)."""
    from dsrun import comm
    from dsrun.data_efficiency.data_sampling.data_analyzer import DataAnalyzer
    from dsrun.data_efficiency.data_sampling.indexed_dataset import MMapIndexedDataset

    key = "data_efficiency.data_sampling.dynamic_batching.metrics_path"
    if metrics_path is None:
        raise UserError(Problem(key, "is not set and no dataset_seqlens were passed",
                                "pass dataset_seqlens, or set metrics_path (with batch_seqlens_fn to compute it)"))
    prefix = Path(metrics_path) / "seqlen" / "seqlen_sample_to_metric"
    if not MMapIndexedDataset.exists(prefix):
        if batch_seqlens_fn is None:
            raise UserError(Problem(key, f"has no seqlen metric ({prefix}.idx/.bin) and no batch_seqlens_fn was "
                                    "passed to compute it", "pass batch_seqlens_fn or dataset_seqlens"))
        logger.warning(f"Cannot find metric files for sequence length in {prefix}.idx or *.bin. We will run data "
                       "analyzer to generate them...")
        group = engine.data_parallel_group
        world = comm.get_world_size(group) if comm.is_initialized() else 1
        rank = comm.get_rank(group) if comm.is_initialized() else 0
        DataAnalyzer(dataset, num_workers=world, worker_id=rank, batch_size=2 ** 10, metric_names=["seqlen"],
                     metric_functions=[batch_seqlens_fn], metric_types=["single_value_per_sample"],
                     save_path=str(metrics_path), collate_fn=collate_fn).run_map_reduce(group)
    seqlens = np.asarray(MMapIndexedDataset(prefix).all_elements(), dtype=np.int64).reshape(-1)
    if len(seqlens) != len(dataset):
        raise UserError(Problem(key, f"holds {len(seqlens)} sequence lengths for a dataset of {len(dataset)}",
                                "delete the metrics folder if the dataset changed"))
    return seqlens
