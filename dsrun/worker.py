"""The rank entry point: a run directory's RunSpec → model and data → ``dsrun.initialize`` → training loop.

``dsrun train`` writes the run directory and launches ``python -m dsrun.worker --run-dir RUN_DIR`` once per
rank. The loop reads top to bottom: build, then for each optimizer step run ``gradient_accumulation_steps``
micro-steps of forward / backward and one ``engine.step()``, evaluate now and then, and at the end write
``metrics.json`` (rank 0). SIGTERM or SIGINT stops the loop at the next step boundary; the metrics gathered
so far are still written.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from dsrun.config import load_resolved
from dsrun.estimate.measure import current_rss, record_rank_peak
from dsrun.launcher.protocol import debug_requested, exit_without_teardown, report_user_error
from dsrun.monitor.run_defaults import PARENT_ENV, apply_run_defaults, flatten, mlflow_parent_key
from dsrun.run_book import RunBook
from dsrun.rundir import RESOLVED_YAML
from dsrun.workloads.data_efficiency_run import DataEfficiencyRun
from dsrun.workloads.pipe_training import build_pipeline_model, pipeline_stages
from dsrun.workloads.pipe_training import evaluate as pipeline_evaluate
from dsrun.utils.seeding import set_random_seed
from dsrun.sequence import shard_sequence
from dsrun.utils.errors import EXIT_USAGE, UserError, find_user_error


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checks it between optimizer steps."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum

    def __bool__(self) -> bool:
        return self.signal is not None


def _collective_device() -> torch.device:
    """Where a rank's small control tensors live: NCCL reduces only device tensors."""
    from dsrun.accelerator import get_accelerator

    return get_accelerator().device()


def mean_across_ranks(value: float) -> float:
    from dsrun import comm

    tensor = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    comm.all_reduce(tensor)
    return tensor.item() / comm.get_world_size()


def stop_agreed(stop: StopFlag) -> bool:
    """True on every rank when any rank was asked to stop, so no rank is left waiting in a collective."""
    from dsrun import comm

    flag = torch.tensor([1.0 if stop else 0.0], device=_collective_device())
    comm.all_reduce(flag)
    return flag.item() > 0


@torch.no_grad()
def evaluate(engine: Any, corpus: Any, batch_size: int, rank: int, world_size: int, iters: int) -> float:
    """Mean eval loss (nats per token) over the same ``iters`` global batches every time."""
    engine.eval()
    losses = [engine(inputs.to(engine.device), targets.to(engine.device)).item()
              for inputs, targets in corpus.eval_loader(batch_size, rank, world_size, max_batches=iters)]
    engine.train()
    return mean_across_ranks(sum(losses) / max(1, len(losses)))


def _train_step_flops(model: Any, batch_size: int, seq_len: int) -> int | None:
    """Analytic forward+backward FLOPs of one optimizer step (dsrun's GPT only), for the TFLOPs metric."""
    from dsrun.models.accounting import train_step_flops

    try:
        return train_step_flops(model, batch_size, seq_len)
    except TypeError:
        return None


def report_throughput(engine: Any, steps: int, elapsed: float, tokens_per_step: int,
                      step_flops: int | None) -> tuple[float, float]:
    """Samples/s and tokens/s over the ``steps`` run so far; also sent to the monitors (with TFLOPs)."""
    samples_s, tokens_s = steps * engine.train_batch_size() / elapsed, steps * tokens_per_step / elapsed
    events = [("Train/Samples/samples_per_second", samples_s, engine.global_samples),
              ("Train/Samples/tokens_per_second", tokens_s, engine.global_samples)]
    if step_flops:
        events.append(("Train/Samples/tflops", steps * step_flops / elapsed / 1e12, engine.global_samples))
    engine.monitor.write_events(events)
    return samples_s, tokens_s


def step_timer_ms(engine: Any, before: dict[str, float] | None) -> dict[str, float] | None:
    """The engine's forward/backward/step timer totals (``wall_clock_breakdown``) now, minus ``before``;
    None when the timers are off, or when the engine reset them at the end of this step (every
    ``steps_per_print`` steps), which loses the step's figures."""
    if not engine.timers.enabled:
        return None
    now = {name: engine.timers.elapsed_ms(name) for name in ("forward", "backward", "step")}
    if before is None:
        return now
    every = engine.steps_per_print() or 1  # None: the observer reports (and resets) every step
    return None if engine.global_steps % every == 0 else {k: v - before[k] for k, v in now.items()}


def zero_init_context(ds_config: dict[str, Any]) -> Any:
    """``dsrun.zero.Init`` for ZeRO stage 3 (so the whole model never exists in one process, and with
    ``offload_param`` its shards go straight to host memory or NVMe), else a no-op."""
    import dsrun
    from dsrun.config import ds_section

    if ds_section(ds_config, "zero_optimization").stage != 3:
        return contextlib.nullcontext()
    return dsrun.zero.Init(config_dict_or_path=ds_config)


def teach(model: Any, ds_config: dict[str, Any], cfg: Any) -> Any:
    """``train.teacher``: initialise ``model`` from the teacher run's model (``compression_training`` with
    its layer reduction) and return the distillation loss (docs/compression.md)."""
    from dsrun.compression.compress import init_compression
    from dsrun.compression.layer_reduction import Distiller, load_teacher

    teacher = load_teacher(cfg.teacher)
    init_compression(model, ds_config, teacher_model=teacher)
    return Distiller(teacher, cfg.kd_weight, cfg.kd_temperature)


def train(spec: DictConfig, run_dir: Path) -> dict[str, Any]:
    import hydra.utils

    import dsrun
    from dsrun import comm

    stop = StopFlag()
    dsrun.init_distributed()
    rank, world_size = comm.get_rank(), comm.get_world_size()
    cfg = spec.train
    set_random_seed(cfg.seed)
    baseline_rss = current_rss()  # for `dsrun estimate-memory --measure`: this rank's peak above start-up

    # --- model, data, engine ---
    ds_config = apply_run_defaults(OmegaConf.to_container(spec.ds, resolve=True), run_dir)  # monitors → run dir
    pipelined = pipeline_stages(spec.model) > 1  # a PipelineModule of the GPT: docs/pipeline.md
    # this rank's one parse of the config; what it hands on carries the typed config (dsrun.config)
    ds_config = load_resolved(ds_config, world_size // pipeline_stages(spec.model))
    with zero_init_context(ds_config) if not cfg.teacher else contextlib.nullcontext():  # ZeRO-3: partitioned
        model = (build_pipeline_model(OmegaConf.to_container(spec.model, resolve=True), ds_config, world_size)
                 if pipelined else hydra.utils.instantiate(spec.model, _convert_="all"))  # as each part is built
    distiller = teach(model, ds_config, cfg) if cfg.teacher else None  # layer reduction + distillation
    corpus = hydra.utils.instantiate(spec.data, _convert_="all")
    corpus.check_vocab(model.config.vocab_size)
    if mlflow_parent_key(run_dir):  # the jobs of a multirun become MLflow child runs of one parent
        os.environ[PARENT_ENV] = mlflow_parent_key(run_dir)
    data_eff = DataEfficiencyRun.prepare(ds_config, corpus.train, corpus.vocab_size, run_dir)  # curriculum indexes
    if data_eff.ds_config is not ds_config:  # the curriculum's paths filled in: the typed config takes them too
        data_eff.ds_config = ds_config.with_sections(data_eff.ds_config)
    engine, _, _, _ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=data_eff.ds_config,
                                       training_data=data_eff.training_data)
    data_eff.attach(engine)  # random-LTD layers, seqlen truncation, token and layer-token counts
    engine.monitor.log_params(flatten(OmegaConf.to_container(spec, resolve=True)))
    micro_batch, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    sp = engine.sequence_parallel_size  # Ulysses: a sequence group reads the same samples (docs/sequence_parallel.md)
    if sp > 1 and not getattr(getattr(model, "config", None), "sequence_parallel", False):
        raise UserError(f"ds.sequence_parallel_size={sp} needs a model that shards the sequence: set "
                        "model.sequence_parallel=true (or +recipe=gpt_ulysses)")
    data_rank, data_world = ((engine.grid.get_data_parallel_rank(), engine.dp_world_size) if pipelined
                             else (rank // sp, world_size // sp))
    # Ulysses: each rank keeps only its slice of the batch's sequences (the seqlen curriculum and the teacher
    # need whole ones; the GPT then slices them itself)
    shard = sp > 1 and distiller is None and engine.data_efficiency.curriculum_seqlen() is None
    loader = data_eff.train_loader() or corpus.train_loader(batch_size=micro_batch, rank=data_rank,
                                                            world_size=data_world, seed=cfg.seed)  # the curriculum
    # sampler's loader if it is on

    # --- the run's budget and its bookkeeping (metrics, progress, evaluation, checkpoints: dsrun/run_book.py) ---
    tokens_per_step = engine.train_batch_size() * corpus.seq_len
    max_steps = cfg.max_steps
    if cfg.max_tokens:
        max_steps = min(max_steps, math.ceil(cfg.max_tokens / tokens_per_step))
    book = RunBook(engine, loader, run_dir, cfg, max_steps, tokens_per_step,
                   num_params=(model.config.num_parameters() if pipelined  # the whole model, not one stage
                               else sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())),  # ZeRO-3: full
                   step_flops=_train_step_flops(model, engine.train_batch_size(), corpus.seq_len),
                   evaluate=(lambda: pipeline_evaluate(engine, corpus, micro_batch, cfg.eval_iters)) if pipelined
                   else lambda: evaluate(engine, corpus, micro_batch, data_rank, data_world, cfg.eval_iters),
                   report_throughput=report_throughput, step_timers=step_timer_ms,
                   mean_across_ranks=mean_across_ranks, stop_agreed=lambda: stop_agreed(stop), world_size=world_size,
                   eval_counts=data_eff.counts)  # tokens and layer-tokens seen at each evaluation
    book.announce(type(model).__name__, corpus.seq_len)
    first_step = book.resume()
    book.evaluate_first()

    # --- the training loop ---
    stopped = False
    for step in range(first_step, max_steps + 1):
        book.step_begins()
        step_loss = 0.0
        if pipelined:  # the schedule runs the micro-batches through the stages, then the optimizer steps
            step_loss = float(engine.train_batch(loader))
        for _ in range(0 if pipelined else accumulation):
            inputs, targets = next(loader)
            if shard:
                inputs, targets = shard_sequence(inputs), shard_sequence(targets)
            inputs, targets = inputs.to(engine.device, non_blocking=True), targets.to(engine.device, non_blocking=True)
            if distiller is not None:
                loss = distiller.loss(engine, inputs, targets)
            else:
                loss = engine(inputs, targets, sequence_sharded=True) if shard else engine(inputs, targets)
            engine.backward(loss)
            engine.step()  # steps the optimizer only at the accumulation boundary
            step_loss += loss.item() / accumulation
        stopped = book.step_ends(step, step_loss)  # metrics, eval, progress, checkpoint; all ranks agree to stop
        if stopped:
            break

    metrics = book.finish((stop.signal or "another rank") if stopped else None,
                          record_peak=lambda: record_rank_peak(run_dir, rank, baseline_rss),
                          extra_metrics=data_eff.summary())
    comm.barrier()
    comm.destroy_process_group()
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsrun.worker", description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path, help="the run directory dsrun train wrote")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the launcher (also LOCAL_RANK)")
    args = parser.parse_args(argv)
    spec = OmegaConf.load(args.run_dir / RESOLVED_YAML)
    # dsrun train said it once before the launch (dsrun.cli.preflight.warmup_note), not once per rank
    warnings.filterwarnings("ignore", message=r"total_num_steps \d+ is less than warmup_num_steps")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    try:
        metrics = train(spec, args.run_dir)
    except Exception as err:  # the user's mistake: one line through the launcher, exit code 2, no traceback
        user = find_user_error(err)
        if user is None:
            raise
        if debug_requested():
            import traceback

            traceback.print_exc()
        report_user_error([str(problem) for problem in user.problems])
        return EXIT_USAGE
    return 143 if metrics.get("stopped_by_signal") else 0


if __name__ == "__main__":
    exit_without_teardown(main())
