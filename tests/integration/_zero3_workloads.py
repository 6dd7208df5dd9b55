"""Models, data and rank entry points for the ZeRO-3 multi-process tests (importable by spawned ranks).

The reference for every run is single-process PyTorch (AdamW) on the whole global batch: the mean of the
ranks' micro-batch losses equals the global batch's loss and the averaged gradient equals its gradient.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.integration import _workloads
from tests.integration._workloads import max_rel_param_diff, rel_diff  # noqa: F401 (used by the tests)
from tests.integration._workloads import at_least_fp32, train_steps

LR, WEIGHT_DECAY, STEPS = 3e-3, 0.01, 20
GPT_KW = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
SEQ = 16


class TwiceMLP(nn.Module):
    """An MLP whose middle layer is applied twice in one forward, with an optional frozen first layer."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 20)
        self.mid = nn.Linear(20, 20)
        self.out = nn.Linear(20, 3)
        if frozen:
            self.inp.requires_grad_(False)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        h = torch.tanh(self.inp(x.to(self.out.weight.dtype)))
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.mid(h))  # the same module (and parameters) again
        out = at_least_fp32(self.out(h))
        return F.mse_loss(out, y.to(out.dtype))


def build_model(name: str) -> nn.Module:
    torch.manual_seed(1234)
    if name.startswith("gpt"):
        from dsrun.models.gpt import GPT

        model = GPT(**GPT_KW)
        if name == "gpt_frozen":  # freeze the first block and the position table
            model.transformer["h"][0].requires_grad_(False)
            model.transformer["wpe"].requires_grad_(False)
        return model
    return TwiceMLP(frozen=name == "mlp_frozen")


def global_batch(name: str, step: int, size: int) -> Any:
    gen = torch.Generator().manual_seed(1000 + step)
    if name.startswith("gpt"):
        tokens = torch.randint(0, GPT_KW["vocab_size"], (size, SEQ + 1), generator=gen)
        return (tokens[:, :-1], tokens[:, 1:])
    return (torch.randn(size, 12, generator=gen), torch.randn(size, 3, generator=gen))


def loss_terms(name: str, size: int) -> int:
    """How many terms a loss of ``size`` samples averages (tokens predicted, or outputs)."""
    return size * SEQ if name.startswith("gpt") else size * 3


def slice_batch(batch: Any, start: int, end: int) -> Any:
    return tuple(t[start:end] for t in batch)


def flat_params(named: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.detach().double().reshape(-1) for _, v in sorted(named.items())])


def reference_run(name: str, steps: int, global_size: int, clip: float = 0.0, dtype: torch.dtype = torch.float32,
                  parts: int = 1, reverse: bool = False) -> dict[str, Any]:
    """Single-process PyTorch on this module's models and batches (see _workloads.reference_run)."""
    return _workloads.reference_run(name, steps, global_size, clip, dtype, parts, reverse, 1.0, build_model,
                                    global_batch, _named_flat)


def _named_flat(model: nn.Module) -> Any:
    return flat_params(dict(model.named_parameters())).numpy()


def ds_config(stage: int, micro: int, gas: int, zero: dict | None = None, **extra: Any) -> dict[str, Any]:
    zero_cfg = {"stage": stage, "reduce_bucket_size": 700, "allgather_bucket_size": 900}
    if stage == 3:
        # partition everything (no persistent parameters) and prefetch a few layers ahead
        zero_cfg.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2000,
                        stage3_max_reuse_distance=0)
    zero_cfg.update(zero or {})
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
           "zero_optimization": zero_cfg, "steps_per_print": 1000,
           # the references are unclipped PyTorch runs; the clipping cases pass gradient_clipping themselves
           "gradient_clipping": 0.0}
    cfg.update(extra)
    return cfg


def engine_run(name: str, config: dict[str, Any], steps: int, rank: int, world: int,
               zero_init: bool = False) -> dict[str, Any]:
    """Train with dsrun on this rank; returns global mean losses, the full final parameters (gathered),
    grad norms, memory breakdown and the last step's collectives."""
    import dsrun
    from dsrun import comm
    from dsrun.engine.initialize import initialize

    if zero_init:
        comm.init_distributed(verbose=False)
        with dsrun.zero.Init(config_dict_or_path=config):
            model = build_model(name)
    else:
        model = build_model(name)
    engine, _, _, _ = initialize(model=model, config=config)
    losses, norms = train_steps(engine, lambda step, size: global_batch(name, step, size), steps, rank, world)
    full = dsrun.zero.full_state_dict(engine.module) if engine.zero_optimization_stage() == 3 else \
        {k: v for k, v in engine.module.state_dict().items()}
    names = {n for n, _ in engine.module.named_parameters()}
    params = {k: v for k, v in full.items() if k in names}
    return {"losses": losses, "params": flat_params(params).numpy(), "norms": norms,
            "memory": engine.memory_breakdown().as_dict(), "comm": engine.comm_stats_last_step(),
            "numel": sum(v.numel() for v in params.values()), "skipped": engine.skipped_steps}


# --- one launch per world size runs every case --------------------------------------------------------------
def suite_cases(world: int) -> dict[str, tuple[str, dict[str, Any], bool]]:
    """case -> (model, ds config, build under zero.Init)."""
    cases: dict[str, tuple[str, dict[str, Any], bool]] = {}
    for name in ("mlp", "gpt"):
        overlap = world % 2 == 0  # both reduction paths run across the world sizes
        cases[f"parity/{name}"] = (name, ds_config(3, 2, 1, zero={"overlap_comm": overlap}), False)
    if world in (2, 3):
        cases["frozen/gpt"] = ("gpt_frozen", ds_config(3, 2, 1), False)
        cases["frozen/mlp"] = ("mlp_frozen", ds_config(3, 2, 1), False)
        cases["init/gpt"] = ("gpt", ds_config(3, 2, 1), True)
        for stage in (0, 3):  # memory and traffic of stage 3 against stage 0
            cases[f"account/{stage}"] = ("gpt", ds_config(stage, 2, 1), False)
    if world == 2:
        cases["gas4"] = ("mlp", ds_config(3, 1, 4), False)
        cases["clip"] = ("gpt", ds_config(3, 2, 1, gradient_clipping=0.05), False)
        cases["bf16/3"] = ("gpt", ds_config(3, 2, 1, bf16={"enabled": True}), False)
        cases["bf16/0"] = ("gpt", ds_config(0, 2, 1, bf16={"enabled": True}), False)
        cases["no_prefetch"] = ("gpt", ds_config(3, 2, 1, zero={"stage3_prefetch_bucket_size": 0}), False)
        # DeepSpeed's defaults: every tiny parameter persistent, large prefetch and reuse distance
        cases["defaults"] = ("gpt", ds_config(3, 2, 1, zero={"stage3_param_persistence_threshold": 100_000,
                                                              "stage3_prefetch_bucket_size": 50_000_000,
                                                              "stage3_max_reuse_distance": 1_000_000_000}), False)
        cases["sub_groups"] = ("gpt", ds_config(3, 2, 1, zero={"sub_group_size": 3000}), False)
    return cases


def world_suite(rank: int, world: int) -> dict[str, dict]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return {key: engine_run(name, cfg, STEPS, rank, world, zero_init=init)
            for key, (name, cfg, init) in suite_cases(world).items()}
