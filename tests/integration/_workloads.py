"""Models, data and per-rank training loops shared by the engine's multi-process tests.

Everything here is importable by spawned rank processes (``tests.helpers.run_ranks``). The reference for
every engine run is single-process PyTorch on the same global batch: the mean loss over all ranks'
micro-batches equals the loss of the whole global batch, and the averaged gradient equals its gradient.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 64, 8, 32, 2, 2
MLP_IN, MLP_OUT = 16, 4


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """The loss is computed in fp32 for 16-bit models, and stays float64 in the float64 reference."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)  # a key bias has an exactly-zero true gradient that Adam would amplify from rounding noise
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A two-layer GPT with tied input/output embeddings (the tie exercises parameter de-duplication)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens[:, :-1]) + self.wpe(torch.arange(tokens.shape[1] - 1))
        for block in self.blocks:
            x = block(x)
        logits = at_least_fp32(self.head(self.ln_f(x)))
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(MLP_IN, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, MLP_OUT))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = at_least_fp32(self.net(x.to(self.net[0].weight.dtype)))
        return F.mse_loss(out, y.to(out.dtype))


def build_model(name: str) -> nn.Module:
    torch.manual_seed(1234)
    return TinyGPT() if name == "gpt" else MLP()


def global_batch(name: str, step: int, size: int) -> Any:
    """The global batch of optimizer step ``step`` (the same on every rank and in the reference)."""
    gen = torch.Generator().manual_seed(1000 + step)
    if name == "gpt":
        return torch.randint(0, VOCAB, (size, SEQ), generator=gen)
    return (torch.randn(size, MLP_IN, generator=gen), torch.randn(size, MLP_OUT, generator=gen))


def loss_terms(name: str, size: int) -> int:
    """How many terms a loss of ``size`` samples averages (tokens predicted, or outputs)."""
    return size * (SEQ - 1) if name == "gpt" else size * MLP_OUT


def slice_batch(batch: Any, start: int, end: int) -> Any:
    if isinstance(batch, tuple):
        return tuple(t[start:end] for t in batch)
    return batch[start:end]


def flat_params(model: nn.Module) -> torch.Tensor:
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p.detach().double().reshape(-1))
    return torch.cat(out)


LR, WEIGHT_DECAY = 3e-3, 0.01


def cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, tuple):
        return tuple(cast_floats(t, dtype) for t in batch)
    return batch.to(dtype) if batch.is_floating_point() else batch


def reference_run(name: str, steps: int, global_size: int, clip: float = 0.0, dtype: torch.dtype = torch.float32,
                  parts: int = 1, reverse: bool = False, loss_scale: float = 1.0,
                  build: Callable[[str], nn.Module] | None = None, batch_at: Callable | None = None,
                  flat: Callable[[nn.Module], Any] | None = None,
                  schedule: Callable[[torch.optim.Optimizer], Any] | None = None) -> dict[str, Any]:
    """Single-process PyTorch: AdamW on the whole global batch, optional clip_grad_norm_.

    ``dtype``: float64 or fp32 runs the model in it; bf16 or fp16 runs it there with fp32 master weights (the
    engine's mixed precision; the loss multiplied by ``loss_scale`` before backward). ``parts`` accumulates the
    gradient over that many micro-batches (0: one sample each) and ``reverse`` reverses the samples: the same
    run rounded another way (tests/tolerance.py). ``build``, ``batch_at`` and ``flat`` default to
    this module's models, batches and flat_params; ``schedule`` builds an LR scheduler stepped after each step."""
    import copy

    build, batch_at, flat = build or build_model, batch_at or global_batch, flat or flat_params
    mixed = dtype in (torch.bfloat16, torch.float16)
    master = build(name)
    model = copy.deepcopy(master).to(dtype) if mixed else master.to(dtype)
    pairs = [(m, p) for m, p in zip(master.parameters(), model.parameters()) if m.requires_grad]
    opt = torch.optim.AdamW([m for m, _ in pairs], lr=LR, weight_decay=WEIGHT_DECAY)
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
    return {"losses": losses, "params": flat(master), "norms": norms}


def ds_config(stage: int, micro: int, gas: int, bucket: int = 3000, **extra: Any) -> dict[str, Any]:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        # small buckets so a bucket crosses parameter and partition boundaries
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": 4 * bucket // 3},
        "steps_per_print": 1000,
        # the references are unclipped PyTorch runs; the clipping cases pass gradient_clipping themselves
        "gradient_clipping": 0.0,
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def train_steps(engine: Any, batch_at: Callable[[int, int], Any], steps: int, rank: int,
                world: int) -> tuple[list[float], list[Any]]:
    """Run ``steps`` optimizer steps on this rank's slices of the shared global batches (``batch_at(step,
    size)``); returns the global mean loss per step (the mean over every rank's micro-batches) and the grad
    norms."""
    from dsrun import comm

    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    global_size = micro * gas * world
    losses, norms = [], []
    for step in range(steps):
        batch = batch_at(step, global_size)
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(gas):
            start = (m * world + rank) * micro  # any fixed split of the global batch works
            loss = engine(slice_batch(batch, start, start + micro))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        comm.all_reduce(total)
        losses.append(total.item() / (world * gas))
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def engine_run(name: str, config: dict[str, Any], steps: int, rank: int, world: int) -> dict[str, Any]:
    """Train ``steps`` optimizer steps with dsrun on this rank; returns the global mean loss per step (the
    mean over every rank's micro-batches), the final parameters, and the grad norms."""
    import dsrun

    engine, _, _, _ = dsrun.initialize(model=build_model(name), config=config)
    losses, norms = train_steps(engine, lambda step, size: global_batch(name, step, size), steps, rank, world)
    # numpy, not torch: tensors sent through a multiprocessing queue need the sender alive
    return {"losses": losses, "params": flat_params(engine.module).numpy(), "norms": norms,
            "memory": engine.memory_breakdown().as_dict(), "comm": engine.comm_stats_last_step(),
            "numel": sum(p.numel() for p in {id(p): p for p in engine.module.parameters()}.values()),
            "skipped": engine.skipped_steps, "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "micro_steps": engine.micro_steps}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def max_rel_param_diff(a: Any, b: Any) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).abs().max() / b.abs().max())


# --- rank entry points ----------------------------------------------------------------------------------
STEPS = 20


def suite_cases(world: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every engine run one multi-rank launch makes for world size ``world`` (one launch per world size
    keeps process start-up, the slow part on a small machine, to a minimum)."""
    cases: dict[str, tuple[str, dict[str, Any]]] = {}
    for name in ("mlp", "gpt"):
        for stage in (0, 1, 2):
            # alternate overlap_comm so both reduction paths of every stage run at some world size
            overlap = (stage + world) % 2 == 0
            cases[f"parity/{name}/{stage}"] = (name, ds_config(stage, 2, 1, bucket=3000 if name == "gpt" else 300,
                                                               zero_optimization={"overlap_comm": overlap}))
    if world == 2:
        for stage in (0, 1, 2):
            cases[f"gas4/{stage}"] = ("mlp", ds_config(stage, 1, 4, bucket=300))
            cases[f"gas1/{stage}"] = ("mlp", ds_config(stage, 4, 1, bucket=300))
        for stage in (1, 2):
            cases[f"clip/{stage}"] = ("gpt", ds_config(stage, 2, 1, gradient_clipping=0.05))
        for stage in (0, 2):
            cases[f"bf16/{stage}"] = ("gpt", ds_config(stage, 2, 1, bf16={"enabled": True}))
        for stage in (0, 2):
            cases[f"comm_bf16/{stage}"] = ("gpt", ds_config(stage, 2, 1, communication_data_type="bf16"))
        cases["allreduce/1"] = ("gpt", ds_config(1, 2, 1, zero_optimization={"reduce_scatter": False}))
        cases["prescale/1"] = ("gpt", ds_config(1, 2, 1, prescale_gradients=True, gradient_predivide_factor=2.0))
        for stage in (1, 2):
            cases[f"fp16/{stage}"] = ("gpt", ds_config(stage, 2, 1, fp16={"enabled": True, "initial_scale_power": 10}))
    return cases


def world_suite(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {key: engine_run(name, cfg, STEPS, rank, world)
                               for key, (name, cfg) in suite_cases(world).items()}
    if world == 2:
        results["fp16_overflow/2"] = fp16_overflow_ranks(rank, world, 2)
        results["loader"] = loader_indices(rank, world)
    return results


def loader_indices(rank: int, world: int) -> list[list[int]]:
    """The sample indices this rank's ``training_data`` loader yields over two epochs."""
    import dsrun

    data = torch.utils.data.TensorDataset(torch.arange(12))
    _, _, loader, _ = dsrun.initialize(model=build_model("mlp"), config=ds_config(0, 3, 1), training_data=data)
    return [[int(i) for (batch,) in loader for i in batch] for _ in range(2)]


def fp16_overflow_ranks(rank: int, world: int, stage: int) -> list[dict[str, Any]]:
    """fp16 with an inf injected into one gradient on the last rank only, at optimizer step 2."""
    import dsrun

    cfg = ds_config(stage, 2, 1, fp16={"enabled": True, "initial_scale_power": 10, "loss_scale_window": 3,
                                       "hysteresis": 1},
                    scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                              "warmup_num_steps": 10, "warmup_type": "linear"}})
    model = build_model("gpt")
    engine, _, _, scheduler = dsrun.initialize(model=model, config=cfg)
    inject = {"on": False}
    # wte is at the start of the flat buffer, so at stages 1-2 rank 0 owns it: the overflow happens in
    # rank 0's partition while the last rank (which injected it) holds finite gradients
    engine.module.wte.weight.register_hook(lambda g: g * float("inf") if inject["on"] else g)
    records = []
    for step in range(7):
        inject["on"] = step == 2 and rank == world - 1
        batch = global_batch("gpt", step, 2 * world)
        before = flat_params(engine.module)
        loss = engine(slice_batch(batch, 2 * rank, 2 * rank + 2))
        engine.backward(loss)
        engine.step()
        records.append({"scale": engine.cur_scale, "skipped": engine.skipped_steps,
                        "changed": bool((flat_params(engine.module) != before).any()),
                        "sched_iter": scheduler.last_batch_iteration, "lr": engine.get_lr()[0],
                        "global_steps": engine.global_steps})
    return records


def hang_ranks(rank: int, world: int) -> None:
    """The last rank never reaches its first optimizer step; the others wait in a collective."""
    import time
    from datetime import timedelta

    import dsrun

    dsrun.init_distributed(timeout=timedelta(seconds=5), verbose=False)
    engine, _, _, _ = dsrun.initialize(model=build_model("mlp"), config=ds_config(1, 2, 1, bucket=300))
    loss = engine(slice_batch(global_batch("mlp", 0, 2 * world), 2 * rank, 2 * rank + 2))
    if rank == world - 1:
        time.sleep(120)  # stuck: never joins the reduce-scatter
    engine.backward(loss)
    engine.step()
