"""The runs every multi-rank test compares: the DeepSpeed config, the single-process PyTorch reference, a dsrun
engine's training on one rank, and the cases one launch makes, declared as records (``Case``).

The reference for every engine run is single-process PyTorch on the same global batch: the mean loss over all
ranks' micro-batches equals the loss of the whole global batch, and the averaged gradient equals its gradient.
Everything here is importable by the rank processes ``tests.helpers.run_ranks`` starts (forked from a server
that imported torch; they import the test module and this one by name).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from tests.harness.models import MODELS, build_model, cast_floats, flat_named, flat_params, flatten, global_batch
from tests.harness.models import global_expert_name, slice_batch

LR, WEIGHT_DECAY, STEPS = 3e-3, 0.01, 20
# stage 3 partitions everything (no persistent parameters) and prefetches a few layers ahead
STAGE3_TUNING = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 2000,
                 "stage3_max_reuse_distance": 0}


def ds_config(stage: int, micro: int, gas: int, bucket: int = 3000, zero: dict | None = None,
              optimizer: dict | None = None, client_optimizer: bool = False, **extra: Any) -> dict[str, Any]:
    """AdamW (``LR``, ``WEIGHT_DECAY``), small buckets (so a bucket crosses parameter and partition boundaries:
    all-gather 4/3 of ``bucket`` unless ``zero`` says), no clipping (the references are unclipped PyTorch runs).
    ``zero`` and a dict in ``extra`` merge into the section of that name; a ``None`` in ``extra`` or ``zero``
    drops the key (DeepSpeed's default applies). ``client_optimizer``: no optimizer section (the run hands
    ``initialize`` an optimizer of its own)."""
    section = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": 4 * bucket // 3, **(zero or {})}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": optimizer or {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {key: value for key, value in section.items() if value is not None},
        "steps_per_print": 1000,
        "gradient_clipping": 0.0,
    }
    if client_optimizer:
        del cfg["optimizer"]
    for key, value in extra.items():
        if value is None:
            cfg.pop(key, None)
        elif isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def zero3_config(stage: int, micro: int, gas: int, zero: dict | None = None, **extra: Any) -> dict[str, Any]:
    """``ds_config`` with the ZeRO-3 tests' buckets (reduce 700, all-gather 900) and, at stage 3,
    ``STAGE3_TUNING``."""
    tuned = {"allgather_bucket_size": 900, **(STAGE3_TUNING if stage == 3 else {}), **(zero or {})}
    return ds_config(stage, micro, gas, bucket=700, zero=tuned, **extra)


def checkpoint_config(stage: int, precision: str, micro: int, extra: dict | None = None,
                      zero: dict | None = None) -> dict[str, Any]:
    """The checkpoint tests' config: a WarmupLR schedule, clipping at 1.0, buckets of 2000, ``precision``
    (fp32, bf16, fp16); at stage 3 nothing persistent and the 16-bit weights gathered on save. ``extra``
    replaces whole sections; ``zero`` merges into ``zero_optimization`` (offload, sub-group size)."""
    section: dict[str, Any] = {"allgather_bucket_size": 2000}
    if stage == 3:
        section.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)
    zero = {**section, **(zero or {})}
    cfg = ds_config(stage, micro, 1, bucket=2000, zero=zero, gradient_clipping=1.0,
                    scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                              "warmup_num_steps": 5}},
                    **({precision: {"enabled": True}} if precision in ("bf16", "fp16") else {}))
    cfg.update(extra or {})
    return cfg


def reference_run(name: str, steps: int, global_size: int, clip: float = 0.0, dtype: torch.dtype = torch.float32,
                  parts: int = 1, reverse: bool = False, loss_scale: float = 1.0,
                  build: Callable[[str], nn.Module] | None = None, batch_at: Callable | None = None,
                  flat: Callable[[nn.Module], Any] | None = None,
                  schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
                  optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
                  evaluate: bool = False) -> dict[str, Any]:
    """Single-process PyTorch: AdamW on the whole global batch, optional clip_grad_norm_.

    ``dtype``: float64 or fp32 runs the model in it; bf16 or fp16 runs it there with fp32 master weights (the
    engine's mixed precision; the loss multiplied by ``loss_scale`` before backward). ``parts`` accumulates the
    gradient over that many micro-batches (0: one sample each) and ``reverse`` reverses the samples: the same
    run rounded another way (tests/tolerance.py). ``build``, ``batch_at`` and ``flat`` default to the model
    registry's (``tests.harness.models``); ``schedule`` builds an LR scheduler stepped after each step;
    ``optimizer`` builds another optimizer than that AdamW. ``evaluate``: the result's ``eval`` is the loss of
    the next step's global batch in eval mode (no gradient)."""
    build, batch_at = build or build_model, batch_at or global_batch
    flat = flat or (lambda model: flatten(name, model))
    mixed = dtype in (torch.bfloat16, torch.float16)
    master = build(name)
    model = copy.deepcopy(master).to(dtype) if mixed else master.to(dtype)
    pairs = [(m, p) for m, p in zip(master.parameters(), model.parameters()) if m.requires_grad]
    trained = [m for m, _ in pairs]
    opt = optimizer(trained) if optimizer else torch.optim.AdamW(trained, lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = schedule(opt) if schedule else None
    micro = global_size // parts if parts else 1
    losses, norms = [], []
    for step in range(steps):
        batch = batch_at(name, step, global_size)
        batch = batch if mixed else cast_floats(batch, dtype)
        if reverse:
            batch = tuple(t.flip(0) for t in batch) if isinstance(batch, tuple) else batch.flip(0)
        opt.zero_grad()
        if mixed:
            with torch.no_grad():
                for m, p in pairs:
                    p.copy_(m)
        total = 0.0
        for start in range(0, global_size, micro):
            loss = model(slice_batch(batch, start, start + micro)) * (micro / global_size)
            (loss.float() * loss_scale if mixed else loss).backward()
            total += loss.item()
        if mixed:
            for m, p in pairs:
                m.grad, p.grad = p.grad.float() / loss_scale, None
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_([m for m, _ in pairs], clip)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    result = {"losses": losses, "params": flat(master), "norms": norms}
    if evaluate:
        if mixed:
            with torch.no_grad():
                for m, p in pairs:
                    p.copy_(m)
        model.eval()
        with torch.no_grad():
            batch = batch_at(name, steps, global_size)
            result["eval"] = model(batch if mixed else cast_floats(batch, dtype)).item()
    return result


def train_steps(engine: Any, batch_at: Callable[[int, int], Any], steps: int, rank: int,
                world: int, rows: list[dict[str, Any]] | None = None) -> tuple[list[float], list[Any]]:
    """Run ``steps`` optimizer steps on this rank's slices of the shared global batches (``batch_at(step,
    size)``); returns the global mean loss per step (the mean over every rank's micro-batches) and the grad
    norms. Given ``rows``, appends one per step: whether backward reduces at the next step (``reduced_next``:
    the 1-bit optimizers stop it once compression starts) and the step's collectives (``comm``); the losses
    are then averaged over the ranks once at the end, so each step's window holds only the engine's own."""
    from dsrun import comm

    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    global_size = micro * gas * world
    losses, norms, totals = [], [], []
    for step in range(steps):
        batch = batch_at(step, global_size)
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(gas):
            start = (m * world + rank) * micro  # any fixed split of the global batch works
            loss = engine(slice_batch(batch, start, start + micro))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        if rows is None:
            comm.all_reduce(total)
            losses.append(total.item() / (world * gas))
        else:
            totals.append(total)
            rows.append({"reduced_next": engine.enable_backward_allreduce,
                         "comm": {op: dict(v) for op, v in engine.comm_stats_last_step().items()}})
        norms.append(engine.get_global_grad_norm())
    if rows is not None and totals:
        summed = torch.cat(totals)
        comm.all_reduce(summed)
        losses = [total / (world * gas) for total in summed.tolist()]
        for row, loss in zip(rows[len(rows) - steps:], losses):
            row["loss"] = loss
    return losses, norms


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every trainable tensor of the engine's model by name, whole (gathered at ZeRO stage 3)."""
    import dsrun

    full = dsrun.zero.full_state_dict(engine.module) if engine.zero_optimization_stage() == 3 else \
        engine.module.state_dict()
    names = {n for n, _ in engine.module.named_parameters()}
    return {k: v for k, v in full.items() if k in names}


def full_state(engine: Any) -> dict[str, torch.Tensor]:
    """The engine model's whole state by ``state_dict`` name (each tied name, buffers too) as fp32 copies,
    gathered at ZeRO stage 3: what a checkpoint's consolidated state holds."""
    if engine.zero_optimization_stage() == 3:
        from dsrun.zero.stage3 import full_state_dict

        return {k: v.float().clone() for k, v in full_state_dict(engine.module).items()}
    return {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}


def full_moe_params(engine: Any, layer_name: str = "moe") -> dict[str, torch.Tensor]:
    """The parameters of the engine's model by global name (the MoE layer ``layer_name``'s experts under their
    global ids), whole (gathered at ZeRO stage 3), as fp32 copies."""
    import dsrun

    module = engine.module
    ids = getattr(module, layer_name).global_expert_ids()
    params = dict(module.named_parameters())
    with dsrun.zero.GatheredParameters(list(params.values())):
        return {global_expert_name(name, ids): p.detach().clone().float() for name, p in params.items()}


def engine_run(name: str, config: dict[str, Any], steps: int, rank: int, world: int,
               zero_init: bool = False, destroy: bool = False, per_step: bool = False,
               evaluate: bool = False) -> dict[str, Any]:
    """Train ``steps`` optimizer steps with dsrun on this rank (the model built under ``zero.Init`` if
    ``zero_init``); returns the global mean loss per step, the final parameters (whole), the grad norms, the
    memory breakdown, the last step's collectives, the engine's counters and, at stage 3, where the parameter
    shards live (``device``: ``offload_param``'s device, None in memory; ``stats``: the offload's counters,
    None without). A ``named`` model's run also says whether its frozen parameters (some, at least) kept their
    initial values (``frozen_unchanged``) and every trainable one moved (``trained``). ``destroy`` releases the
    engine afterwards (its swap files, hooks and groups). ``per_step`` adds ``rows``: each step's loss,
    collectives and next-step reduction flag (``train_steps``). ``evaluate`` adds ``eval``: the global mean loss
    of the next step's batch in eval mode, without gradients (one micro-batch per rank)."""
    import dsrun
    from dsrun import comm

    named = MODELS[name].named
    if zero_init:
        # the initial values from a whole copy (the seeded build draws the same numbers again)
        initial = {n: p.detach() for n, p in build_model(name).named_parameters()} if named else {}
        comm.init_distributed(verbose=False)
        with dsrun.zero.Init(config_dict_or_path=config):
            model = build_model(name)
    else:
        model = build_model(name)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()} if named else {}
    engine, _, _, _ = dsrun.initialize(model=model, config=config)
    rows: list[dict[str, Any]] | None = [] if per_step else None
    losses, norms = train_steps(engine, lambda step, size: global_batch(name, step, size), steps, rank, world,
                                rows=rows)
    evaluated: dict[str, float] = {}
    if evaluate:
        size = engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps() * world
        evaluated["eval"] = evaluate_loss(engine, global_batch(name, steps, size), rank, world)
    moved: dict[str, bool] = {}
    if named:
        params = full_params(engine)
        flat, numel = flat_named(params), sum(v.numel() for v in params.values())
        frozen = [n for n, p in engine.module.named_parameters() if not p.requires_grad]
        # the model's own parameters (a feature's wrap may add some: compression's mask scores)
        same = {n: torch.equal(params[n].double(), initial[n].double()) for n in params if n in initial}
        moved = {"frozen_unchanged": bool(frozen) and all(same.get(n, False) for n in frozen),
                 "trained": all(not unchanged for n, unchanged in same.items() if n not in frozen)}
    else:
        flat = flat_params(engine.module)
        numel = sum(p.numel() for p in {id(p): p for p in engine.module.parameters()}.values())
    offload = getattr(engine.strategy, "param_offload", None)
    # numpy, not torch: tensors sent through a multiprocessing queue need the sender alive
    result = {"losses": losses, "params": flat.numpy(), "norms": norms,
              "memory": engine.memory_breakdown().as_dict(), "comm": engine.comm_stats_last_step(),
              "numel": numel, "skipped": engine.skipped_steps, "global_steps": engine.global_steps,
              "global_samples": engine.global_samples, "micro_steps": engine.micro_steps,
              "device": offload.device if offload is not None else None,
              "stats": offload.stats() if hasattr(offload, "stats") else None, **moved, **evaluated,
              **({"rows": rows} if per_step else {})}
    if destroy:
        engine.destroy()
    return result


def evaluate_loss(engine: Any, batch: Any, rank: int, world: int) -> float:
    """The global mean loss of one micro-batch per rank (this rank's: the ``rank``-th of ``batch``), the engine
    in eval mode, no gradients."""
    from dsrun import comm

    micro = engine.train_micro_batch_size_per_gpu()
    engine.eval()
    with torch.no_grad():
        total = engine(slice_batch(batch, rank * micro, (rank + 1) * micro)).double().reshape(1)
    comm.all_reduce(total)
    return total.item() / world


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def max_rel_param_diff(a: Any, b: Any) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).abs().max() / b.abs().max())


# --- cases as records: one launch per world size runs every case of that size ----------------------------------
@dataclass(frozen=True)
class Case:
    """One engine run: ``model`` (a name of ``tests.harness.models.MODELS``) trained with ``config`` for
    ``steps`` optimizer steps on each world size of ``worlds``; its results are keyed by ``key``. ``destroy``:
    the engine is destroyed after the run (a case whose swap files must be gone before the next one);
    ``per_step``: the run also records each step's row (``train_steps``); ``evaluate``: and the loss of the
    next step's batch in eval mode."""

    key: str
    model: str
    config: dict
    worlds: tuple[int, ...] = (2,)
    zero_init: bool = False
    steps: int = STEPS
    destroy: bool = False
    per_step: bool = False
    evaluate: bool = False

    def global_size(self, world: int) -> int:
        return self.config["train_micro_batch_size_per_gpu"] * self.config["gradient_accumulation_steps"] * world


def cases_at(cases: Iterable[Case], world: int) -> dict[str, Case]:
    """The cases one launch of ``world`` ranks runs, by key."""
    return {case.key: case for case in cases if world in case.worlds}


def world_suite(rank: int, world: int, cases: Sequence[Case]) -> dict[str, dict[str, Any]]:
    """Rank entry point: every case of this world size, one after another, in one process."""
    return {key: engine_run(case.model, case.config, case.steps, rank, world, zero_init=case.zero_init,
                            destroy=case.destroy, per_step=case.per_step, evaluate=case.evaluate)
            for key, case in cases_at(cases, world).items()}
