"""``PipelineEngine``: trains a :class:`~dsrun.pipe.module.PipelineModule` by running a schedule.

``dsrun.initialize(model=PipelineModule(...), config=...)`` builds it. Each call of :meth:`train_batch` runs
``gradient_accumulation_steps`` micro-batches through this rank's stage as the schedule's instructions say
(:mod:`.schedule`, :mod:`.timed`; ``pipeline.schedule`` picks one): load, forward, send and receive
activations and gradients (:mod:`.p2p`), backward, then sum the gradients of weights tied across stages,
reduce the gradients over the stage's data-parallel group and step the optimizer. As in DeepSpeed,
``training_data`` is read in order (an unshuffled ``DistributedSampler`` over the data-parallel ranks) and
every ``steps_per_print`` batches global rank 0 prints ``steps: N loss: L iter time (s): T samples/sec: S``.

What the engine inherits stays the same: the precision strategy scales the loss on the last stage and
checks overflow on every stage; the ZeRO strategy (stage 0, 1, or 2 without cross-stage ties) holds this
stage's parameters, reduces over ``groups.data`` and sums the squared norm over ``groups.pipe``; schedulers,
counters and monitors work as with :class:`~dsrun.engine.engine.DeepSpeedEngine`.

Tied weights: every stage sharing a ``TiedLayerSpec`` key keeps a copy, but only the first of them (the
owner) gives it to the optimizer. After backward the copies' gradients are all-reduced over the tie group;
after the step the owner's new weights are broadcast to the others, so the copies stay bit-identical.

The engine is DeepSpeed's facade (its class, ``train_batch``, ``eval_batch``, ``is_first_stage`` ...) over two
parts: the schedule executor (:mod:`.executor`), which runs the instructions, and the pipeline's feature
(:mod:`.feature`, ``engine.pipeline``), which attaches to the engine as every feature does (the module's grid as
the run's topology, the stage layout in checkpoints, the batch timing in the monitors). Checkpoints keep the
per-layer layout of :mod:`.checkpoint`.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch.utils.data.distributed import DistributedSampler

from dsrun import comm
from dsrun.config import DSConfig
from dsrun.engine.engine import DeepSpeedEngine
from dsrun.features import Features
from dsrun.optim.onebit import OneBitOptimizer
from dsrun.utils.errors import ConfigError, Problem
from dsrun.utils.repeating_loader import RepeatingLoader
from dsrun.zero.strategies import StrategyContext

from dsrun.pipe import p2p, settings
from dsrun.pipe.feature import BatchTiming, PipelineFeature
from dsrun.pipe.executor import PipelineError, ScheduleExecutor
from dsrun.pipe.schedule import PipeSchedule

if TYPE_CHECKING:
    from dsrun.checkpoint.engine_io import Tag


class PipelineEngine(DeepSpeedEngine):
    """A training engine for hybrid pipeline, data (and model) parallelism; see the module docstring."""

    pipeline_parallelism = True  # DeepSpeed's flag (False on the plain engine)

    def __init__(self, has_bool_tensors: bool = False, *super_args: Any, **super_kwargs: Any):
        model = super_kwargs.get("model", super_args[0] if super_args else None)
        if not hasattr(model, "mpu") or not hasattr(model, "chunk_range"):
            raise TypeError(f"PipelineEngine trains a PipelineModule, got {type(model).__name__}")
        self.has_bool_tensors = has_bool_tensors  # accepted for DeepSpeed's signature: bools always travel as bytes
        config = super_kwargs.get("config", super_args[1] if len(super_args) > 1 else None)
        # the pipeline's own feature (dsrun/pipe/feature.py) goes first: it takes the topology before the others
        self.pipeline = PipelineFeature(model, config)
        features = super_kwargs.get("features")
        features = Features.build(config) if features is None else features
        super_kwargs["features"] = Features([self.pipeline, *features])
        super().__init__(*super_args, **super_kwargs)
        if not self._config.managed_gradient_accumulation:  # train_batch() owns the boundaries, as in DeepSpeed
            raise ConfigError(Problem("managed_gradient_accumulation", "false is not supported with pipeline "
                                      "parallelism: train_batch() runs the whole accumulation", "set it true"))
        if self._config.checkpoint.use_node_local_storage:  # its layer files go where parallel_write puts them
            raise ConfigError(Problem("checkpoint.use_node_local_storage", "is not supported with pipeline "
                                      "parallelism: each stage's layer files are written by its own ranks",
                                      "save to a shared file system"))
        settings.check_module(self.module, self._config)
        self.grid = self.module.mpu()
        self.num_stages = self.grid.get_pipe_parallel_world_size()
        self.stage_id = self.grid.get_stage_id()
        self.prev_stage, self.next_stage = self.stage_id - 1, self.stage_id + 1
        self.virtual_stages = self.module.virtual_stages
        self.micro_batches = self.gradient_accumulation_steps()
        self.module._synchronize_tied_weights()
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        training_data = super_kwargs.get("training_data", super_args[4] if len(super_args) > 4 else None)
        if training_data is not None:
            # DeepSpeed's pipeline reads training_data in order, each data-parallel rank every dp-th sample
            # (an unshuffled DistributedSampler), not through the shuffled loader of the plain engine
            sampler = DistributedSampler(training_data, num_replicas=self.dp_world_size,
                                         rank=self.grid.get_data_parallel_rank(), shuffle=False)
            collate_fn = super_kwargs.get("collate_fn", super_args[5] if len(super_args) > 5 else None)
            self.set_dataloader(self.deepspeed_io(training_data, data_sampler=sampler, collate_fn=collate_fn))
        self.agg_train_loss: torch.Tensor | None = None
        self._train_seconds = 0.0  # train_batch time since the last progress line (DeepSpeed's batch timer)
        self.last_batch_timing: dict[str, float] = {}
        self._schedules: dict[tuple[str, int], PipeSchedule] = {}
        self._force_boundary = False
        self._split = self._model_parallel_split()
        self._executor = ScheduleExecutor(self, self._split)  # dsrun/pipe/executor.py runs the instructions

    # --- construction (DeepSpeedEngine's seams) --------------------------------------------------------------
    @classmethod
    def prepare_model(cls, model: torch.nn.Module, config: DSConfig) -> None:
        """Cut the module into ``stages x virtual_stages`` chunks for the interleaved schedule, before the
        optimizer is built over its parameters (:meth:`PipelineFeature.prepare_module`)."""
        PipelineFeature.prepare_module(model, config)

    def _strategy_context(self, optimizer: torch.optim.Optimizer) -> StrategyContext:
        """The ZeRO strategy steps this stage's parameters, tied copies owned elsewhere left out."""
        if isinstance(optimizer, OneBitOptimizer):  # not built for it: say so rather than lose its error buffers
            raise ConfigError(Problem("optimizer.type", f"{type(optimizer).__name__} does not run under the pipeline "
                                      "engine yet (its per-rank error buffers are not in a pipeline checkpoint)",
                                      "train with Adam/AdamW/Lamb, or without pipeline stages"))
        own = {id(p) for p in self.module.parameters()}
        copies = {id(p) for p in self.module.tied_parameters(owned=False)}
        for group in optimizer.param_groups:
            if any(id(p) not in own for p in group["params"]):
                raise ConfigError(Problem("initialize(optimizer=...)", "the optimizer holds parameters this "
                                          "pipeline stage does not have (built before the module was re-cut "
                                          "for virtual stages?)", "pass model_parameters=model.parameters() "
                                          "or an optimizer callable, or let the config build the optimizer"))
            group["params"] = [p for p in group["params"] if id(p) not in copies]
        return super()._strategy_context(optimizer)

    # --- DeepSpeed's pipeline API ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the engine runs a ReduceGrads or OptimizerStep instruction."""
        return self._force_boundary

    def set_dataloader(self, loader: Iterable[Any]) -> None:
        """Train from ``loader``, restarted whenever it runs out."""
        self.training_dataloader = loader
        self.data_iterator = iter(RepeatingLoader(loader))

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """Take training micro-batches ``(inputs, labels)`` from ``iterator`` (first and last stages read it)."""
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Run ``fn`` on every micro-batch read from the data iterator."""
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """DeepSpeed's call for a changed sequence length. Nothing to reset here: every message carries its
        own shapes and dtypes."""

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the number of micro-batches; ``ValueError`` when it is not
        a multiple of ``train_micro_batch_size_per_gpu x data-parallel size``."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per_step:
            raise ValueError(f"train_batch_size {train_batch_size} is not divisible by micro batch size x data "
                             f"parallel size ({per_step})")
        self._config.gradient_accumulation_steps = train_batch_size // per_step
        self._config.train_batch_size = train_batch_size
        self.micro_batches = self.gradient_accumulation_steps()
        self._schedules.clear()

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on the next batch: ``gradient_accumulation_steps()`` micro-batches per pipeline, read from
        ``data_iter`` (or the iterator set before), then one optimizer step. Returns the batch's mean loss
        (over micro-batches and data-parallel ranks) on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        began = time.perf_counter()
        self.module.train()
        self._run(self._schedule("train", self.micro_batches))
        self.agg_train_loss = self._aggregate(self._executor.losses, broadcast=True)
        self._train_seconds += time.perf_counter() - began
        self._report_batch()
        if self.monitor.enabled:
            self.monitor.write_events([("Train/Samples/train_loss", float(self.agg_train_loss), self.global_samples)])
        return self.agg_train_loss

    def _report_batch(self) -> None:
        """DeepSpeed's progress line of a pipeline, every ``steps_per_print`` batches on global rank 0
        (``steps: N loss: L iter time (s): T samples/sec: S``, T the mean batch time since the last line): what
        DeepSpeedExamples' pipeline example shows of its training. Off with ``print_step_lines`` (dsrun's worker
        reports its own progress)."""
        every = self.steps_per_print()
        if not (self.print_step_lines and every) or self.global_steps % every:
            return
        iter_time, self._train_seconds = self._train_seconds / every, 0.0
        if self.global_rank == 0:
            rate = self.train_batch_size() / iter_time if iter_time > 0 else float("inf")
            print(f"steps: {self.global_steps} loss: {float(self.agg_train_loss):0.4f} iter time (s): {iter_time:0.3f} "
                  f"samples/sec: {rate:0.3f}", flush=True)

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward ``num_micro_batches`` (default: gradient accumulation steps) micro-batches without
        gradients. Returns the mean loss (``reduce_output='avg'``; ``None``: one per micro-batch), or the
        last stage's outputs when ``compute_loss`` is False; with ``return_logits`` also the last stage's
        outputs per micro-batch (None on other stages)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output must be 'avg' or None, got {reduce_output!r}")
        train_iterator, was_training = self.data_iterator, self.module.training
        self.set_dataiterator(data_iter)
        self.module.eval()
        try:
            with torch.no_grad():
                self._run(self._schedule("eval", int(num_micro_batches or self.micro_batches)), compute_loss)
        finally:
            self.data_iterator = train_iterator
            self.module.train(was_training)
        losses = self._executor.losses
        outputs = self._executor.outputs if self.is_last_stage() else None
        if compute_loss:
            result = (self._aggregate(losses, broadcast=bcast_loss) if reduce_output == "avg" else list(losses))
        else:
            result = outputs
            if reduce_output == "avg" and outputs:
                result = torch.stack([o.float() for o in outputs]).mean(dim=0)
        return (result, outputs) if return_logits else result

    def _model_parallel_split(self) -> dict[int, p2p.Split]:
        """``pipeline.pipe_partitioned`` / ``grad_partitioned``: with a model axis, each model-parallel rank
        sends a slice of the activations / gradients and the receivers all-gather them."""
        size = self.grid.get_model_parallel_world_size()
        if size == 1:
            return {}
        cut = p2p.Split(self.grid.get_model_parallel_group(), size, self.grid.get_model_parallel_rank())
        pipe = self._config.pipeline
        return {kind: cut for kind, on in ((p2p.ACTIVATION, pipe.pipe_partitioned), (p2p.GRAD, pipe.grad_partitioned))
                if on}

    # --- running a schedule -------------------------------------------------------------------------------------
    def _schedule(self, kind: str, micro_batches: int) -> PipeSchedule:
        key = (kind, micro_batches)
        if key not in self._schedules:
            make = settings.train_schedule if kind == "train" else settings.eval_schedule
            self._schedules[key] = make(self._config, micro_batches, self.num_stages, self.stage_id)
        return self._schedules[key]

    def _run(self, schedule: PipeSchedule, compute_loss: bool = True) -> None:
        timing = self.pipeline.timing = BatchTiming()  # the feature's metrics read it at the optimizer step
        self._executor.run(schedule, timing, compute_loss)
        self.last_batch_timing = timing.summary()

    # --- the boundary instructions (the executor calls them) --------------------------------------------------
    def _reduce_boundary_gradients(self) -> None:
        """ReduceGrads: the boundary's reduction (every micro-batch's backward ran)."""
        self._force_boundary = True
        strategy = self.strategy
        if strategy is not None and not getattr(strategy, "reduce_every_micro_step", False):
            strategy.before_backward(True)  # no backward follows: the flush reduces every bucket now
            strategy.after_backward(True)

    def _step_at_boundary(self) -> None:
        """OptimizerStep: the inherited step (counters, scheduler, features, monitors), then the tied copies
        take their owners' new weights."""
        self._force_boundary = True
        self.micro_steps += self.micro_batches - 1  # the inherited step counts the last one
        DeepSpeedEngine.step(self)
        self.module._synchronize_tied_weights()
        self._force_boundary = False

    def _aggregate(self, losses: list[torch.Tensor], broadcast: bool) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses, averaged over its data-parallel group and, with
        ``broadcast``, sent to every stage."""
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.is_last_stage():
            if losses:
                value = torch.stack([loss.double() for loss in losses]).mean()
            if self.dp_world_size > 1:
                comm.all_reduce(value, group=self.dp_group)
                value /= self.dp_world_size
        if broadcast and self.num_stages > 1:
            comm.broadcast(value, src=self.grid.stage_to_global(self.num_stages - 1),  # the last stage
                           group=self.grid.get_pipe_parallel_group())
        return value.float()

    # --- checkpoints: per layer (dsrun.pipe.checkpoint) --------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Tag = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save in DeepSpeed's pipeline layout: one ``layer_XX-model_states.pt`` per layer, the engine's state
        per stage in ``mp_rank_XX_model_states.pt``, ZeRO optimizer states per stage and data-parallel rank."""
        from dsrun.pipe.checkpoint import save_pipeline_checkpoint

        return save_pipeline_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                        exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Tag = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """Load a pipeline checkpoint saved at any number of stages (and data-parallel ranks)."""
        from dsrun.pipe.checkpoint import load_pipeline_checkpoint

        return load_pipeline_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                                        load_optimizer_states=load_optimizer_states,
                                        load_lr_scheduler_states=load_lr_scheduler_states,
                                        load_module_only=load_module_only)
