"""Rank workloads and the plain-torch reference for the 1-bit optimizers' engine tests (tests/integration/
test_onebit.py). One 2-rank launch runs every case (process start-up is the slow part on a small machine)."""
from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.harness.models import build_model, flat_params, global_batch, slice_batch
from tests.harness.runs import train_steps
from tests.unit.comm.test_compressed import simulate

LR, WEIGHT_DECAY, BETAS, EPS = 2e-3, 0.01, (0.9, 0.999), 1e-8


def config(optimizer: str, stage: int = 0, micro: int = 2, gas: int = 1, **params: Any) -> dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
           "optimizer": {"type": optimizer, "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, **params}},
           "zero_optimization": {"stage": stage}}
    return cfg


def with_(cfg: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {**copy.deepcopy(cfg), **top}


# --- the reference: 1-bit Adam at ZeRO stage 0 in plain torch, every rank simulated in one process ---------
def reference_onebit_adam(steps: int, world: int, micro: int, gas: int, freeze: int, clip: float) -> dict[str, Any]:
    """The same fp32 operations in the same order as the engine (ranks' gradients, warm-up average, per-rank
    clipping in the compressed phase, the compressed all-reduce of tests/unit/comm/test_compressed.py)."""
    from dsrun.comm.compressed import CompressedLayout

    model = build_model("mlp")
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    numel = flat.numel()
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    layout = CompressedLayout.of(numel, world)
    worker = [torch.zeros(numel) for _ in range(world)]
    server = [torch.zeros(layout.chunk) for _ in range(world)]
    beta1, beta2 = BETAS
    losses = []

    def clipped(g: torch.Tensor) -> torch.Tensor:
        if clip:
            norm = float(torch.dot(g, g).double()) ** 0.5
            if clip / (norm + 1e-6) < 1.0:
                return g.mul_(clip / (norm + 1e-6))
        return g

    for step in range(steps):
        t = step + 1
        batch = global_batch("mlp", step, micro * gas * world)
        local, totals = [], []
        for r in range(world):
            g, total = None, torch.zeros(1, dtype=torch.float64)
            for k in range(gas):
                offset = 0
                with torch.no_grad():
                    for p in params:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
                model.zero_grad()
                start = (k * world + r) * micro
                loss = model(slice_batch(batch, start, start + micro))
                (loss.float() / gas if gas > 1 else loss).backward()
                grads = torch.cat([p.grad.reshape(-1) for p in params])
                g = grads if g is None else g.add_(grads)
                total += loss.item()
            local.append(g)
            totals.append(total)
        losses.append((sum(totals[1:], totals[0])).item() / (world * gas))
        if t <= freeze:
            average = local[0].div(world)
            for g in local[1:]:
                average.add_(g.div(world))
            g = clipped(average)
            exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        else:
            inputs = [exp_avg.clone().mul_(beta1).add_(clipped(g), alpha=1 - beta1) for g in local]
            exp_avg, _, worker, server = simulate(inputs, worker, server, layout)
        bias1, bias2 = 1 - beta1 ** t, 1 - beta2 ** min(t, freeze)
        flat.mul_(1 - LR * WEIGHT_DECAY)
        denom = (exp_avg_sq.sqrt() / bias2 ** 0.5).add_(EPS)
        flat.addcdiv_(exp_avg, denom, value=-LR / bias1)
    return {"losses": losses, "params": flat.numpy()}


# --- engine runs ----------------------------------------------------------------------------------------
def _batch(step: int, size: int) -> Any:
    return global_batch("mlp", step, size)


def run(cfg: dict[str, Any], steps: int, rank: int, world: int, model: torch.nn.Module | None = None,
        model_parameters: Any = None, after_step: Any = None) -> dict[str, Any]:
    """Train with ``cfg``; per step the global mean loss, the switch for the next step and the engine's comm
    traffic (the losses are averaged over ranks once at the end, so the step windows hold only the engine's
    collectives), and the final weights."""
    import dsrun
    from dsrun import comm

    engine, optimizer, _, _ = dsrun.initialize(model=model or build_model("mlp"), config=cfg,
                                               model_parameters=model_parameters)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    rows, totals = [], torch.zeros(steps, dtype=torch.float64)
    for step in range(steps):
        batch = _batch(step, micro * gas * world)
        for k in range(gas):
            start = (k * world + rank) * micro
            loss = engine(slice_batch(batch, start, start + micro))
            engine.backward(loss)
            engine.step()
            totals[step] += loss.item()
        if after_step is not None:
            after_step(step, engine)
        rows.append({"reduced_next": engine.enable_backward_allreduce,
                     "comm": {op: dict(v) for op, v in engine.comm_stats_last_step().items()}})
    comm.all_reduce(totals)
    for row, total in zip(rows, totals.tolist()):
        row["loss"] = total / (world * gas)
    return {"rows": rows, "params": flat_params(engine.module).numpy(), "engine": engine, "optimizer": optimizer}


def _strip(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in ("engine", "optimizer")}


def accuracy_cases(rank: int, world: int) -> dict[str, Any]:
    out = {}
    sim = config("OneBitAdam", micro=1, gas=2, freeze_step=3)
    out["sim"] = _strip(run(with_(sim, gradient_clipping=0.05), 8, rank, world))
    for name, params in (("OneBitAdam", {"freeze_step": 3}), ("OneBitLamb", {"freeze_step": 10, "max_coeff": 0.5})):
        for precision in ("fp32", "bf16"):
            extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
            steps = params["freeze_step"] + 4
            for stage in (0, 1):
                out[f"stage{stage}/{name}/{precision}"] = _strip(run(with_(config(name, stage, **params), **extra),
                                                                      steps, rank, world))
    fp16 = with_(config("OneBitAdam", micro=1, gas=2, freeze_step=3), fp16={"enabled": True, "initial_scale_power": 8},
                 gradient_clipping=1.0)
    out["fp16"] = _strip(run(fp16, 8, rank, world))
    return out


def traffic_cases(rank: int, world: int) -> dict[str, Any]:
    out = {"adam": _strip(run(config("Adam"), 20, rank, world)),
           "onebit": _strip(run(config("OneBitAdam", freeze_step=3), 20, rank, world)),
           "lamb": _strip(run(config("OneBitLamb", freeze_step=10), 20, rank, world)),
           "zero_one": _strip(run(config("ZeroOneAdam", var_freeze_step=3, var_update_scaler=1, local_step_scaler=2,
                                         local_step_clipper=8), 20, rank, world))}
    return out


def mask_cases(rank: int, world: int) -> dict[str, Any]:
    """The first layer frozen; the last layer's first two rows masked (exp_avg_mask), no weight decay."""
    out = {}
    for name, params in (("OneBitAdam", {"freeze_step": 3}), ("ZeroOneAdam", {"var_freeze_step": 4,
                         "var_update_scaler": 1, "local_step_scaler": 2}), ("OneBitLamb", {"freeze_step": 10})):
        for stage in ((0, 1) if name != "ZeroOneAdam" else (0,)):
            model = build_model("mlp")
            model.net[0].requires_grad_(False)
            last = model.net[4].weight
            mask = torch.ones_like(last)
            mask[:2] = 0.0
            groups = [{"params": [last], "exp_avg_mask": mask},
                      {"params": [p for n, p in model.named_parameters() if p.requires_grad and p is not last]}]
            frozen = model.net[0].weight.detach().clone()
            cfg = config(name, stage, **params)
            cfg["optimizer"]["params"]["weight_decay"] = 0.0
            warmup = params.get("freeze_step", params.get("var_freeze_step"))
            at_freeze = {}

            def snapshot(step: int, engine: Any, warmup: int = warmup, at_freeze: dict = at_freeze) -> None:
                if step + 1 == warmup:
                    at_freeze["rows"] = engine.module.net[4].weight.detach()[:2].clone()

            result = run(cfg, warmup + 5, rank, world, model=model, model_parameters=groups, after_step=snapshot)
            engine, optimizer = result["engine"], result["optimizer"]
            master = optimizer.param_groups[0]["params"][0]
            own_mask = optimizer._masks[0]
            out[f"{name}/{stage}"] = {
                "masked_momentum": optimizer.state[master]["exp_avg"].masked_fill(own_mask != 0, 0).abs().max().item(),
                "masked_weights_moved": (engine.module.net[4].weight.detach()[:2] - at_freeze["rows"]).abs().max().item(),
                "frozen_unchanged": torch.equal(engine.module.net[0].weight.detach(), frozen)}
    return out


def resume_cases(rank: int, world: int) -> dict[str, Any]:
    """Save at step 6 (inside the compressed phase), then a fresh engine loads it and trains on: its losses
    must equal the uninterrupted run's bitwise."""
    import dsrun
    from dsrun import comm

    out = {}
    cases = {"OneBitAdam/0": config("OneBitAdam", 0, freeze_step=3),
             "OneBitAdam/1": config("OneBitAdam", 1, freeze_step=3),
             "OneBitLamb/0": config("OneBitLamb", 0, freeze_step=10),
             "ZeroOneAdam/0": config("ZeroOneAdam", 0, var_freeze_step=3, var_update_scaler=1, local_step_scaler=2)}
    save_at = {"OneBitLamb/0": 12}
    for key, cfg in cases.items():
        at = save_at.get(key, 6)
        folder = [tempfile.mkdtemp(prefix="dsrun-onebit-") if rank == 0 else None]
        comm.broadcast_object_list(folder, src=0)
        engine, _, _, _ = dsrun.initialize(model=build_model("mlp"), config=cfg)
        full = []
        for step in range(at + 4):
            if step == at:
                engine.save_checkpoint(folder[0])
            losses, _ = train_steps(engine, lambda s, size, step=step: _batch(step, size), 1, rank, world)
            full += losses
        engine.destroy()
        resumed_engine, _, _, _ = dsrun.initialize(model=build_model("mlp"), config=cfg)
        resumed_engine.load_checkpoint(folder[0])
        resumed = []
        for step in range(at, at + 4):
            losses, _ = train_steps(resumed_engine, lambda s, size, step=step: _batch(step, size), 1, rank, world)
            resumed += losses
        out[key] = {"full": full[at:], "resumed": resumed}
        resumed_engine.destroy()
    return out


def all_cases(rank: int, world: int, reshard_folder: str) -> dict[str, Any]:
    from dsrun import comm

    comm.init_distributed(verbose=False)
    out = {"accuracy": accuracy_cases(rank, world), "traffic": traffic_cases(rank, world),
           "mask": mask_cases(rank, world), "resume": resume_cases(rank, world)}
    save_for_resharding(rank, world, reshard_folder)
    comm.barrier()
    return out


def save_for_resharding(rank: int, world: int, folder: str) -> None:
    """2 ranks, stage 0: a checkpoint after 5 steps (two of them compressed)."""
    import dsrun

    engine, _, _, _ = dsrun.initialize(model=build_model("mlp"), config=config("OneBitAdam", 0, freeze_step=3))
    train_steps(engine, _batch, 5, rank, world)
    engine.save_checkpoint(folder)


def load_resharded(rank: int, world: int, folder: str) -> dict[int, dict[str, Any]]:
    """Another world size, at stages 0 and 1: the errors as loaded, then two more steps."""
    import dsrun

    out = {}
    for stage in (0, 1):
        engine, optimizer, _, _ = dsrun.initialize(model=build_model("mlp"),
                                                   config=config("OneBitAdam", stage, freeze_step=3))
        engine.load_checkpoint(folder)
        loaded = {"worker": optimizer.worker_errors[0].tolist(), "server": optimizer.server_errors[0].tolist(),
                  "reduces": engine.enable_backward_allreduce}
        losses, _ = train_steps(engine, lambda step, size: _batch(5 + step, size), 2, rank, world)
        out[stage] = {**loaded, "losses": losses}
        engine.destroy()
    from dsrun import comm
    from dsrun.checkpoint.ds_to_universal import ds_to_universal

    if rank == 0:  # the same checkpoint through its universal form, at stage 1
        tag = (Path(folder) / "latest").read_text()
        ds_to_universal(f"{folder}/{tag}", f"{folder}/{tag}_universal", verbose=False)
    comm.barrier()
    engine, optimizer, _, _ = dsrun.initialize(model=build_model("mlp"), config=config("OneBitAdam", 1, freeze_step=3))
    engine.load_checkpoint(folder, tag=f"{(Path(folder) / 'latest').read_text()}_universal")
    out["universal"] = {"worker": optimizer.worker_errors[0].tolist(), "server": optimizer.server_errors[0].tolist(),
                        "reduces": engine.enable_backward_allreduce, "losses": [0.0]}
    engine.destroy()
    return out
