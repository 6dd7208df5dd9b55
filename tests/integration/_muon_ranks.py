"""Rank entry points and the single-process reference for the Muon tests (importable by spawned ranks).

The model has every kind of parameter DeepSpeed's split sees: an embedding and an ``lm_head`` (2-D, Adam by
name), two hidden matrices (Muon), biases and a LayerNorm (1-D, Adam). The Muon group, largest first, is
12x12 then 12x8 (240 elements): on 2 ranks the first matrix straddles the stage 1-2 partition boundary.
"""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dsrun.optim.muon import MuonFeature, newton_schulz
from dsrun.optim.muon.newton_schulz import adam_update, muon_update

VOCAB, WIDTH, HIDDEN = 16, 8, 12
MICRO, STEPS, SEED = 4, 4, 1234
LR, ADAM_LR, WEIGHT_DECAY, MOMENTUM, CLIP = 0.02, 0.01, 0.1, 0.9, 1.0
ADAM_BETAS, ADAM_EPS = (0.9, 0.95), 1e-10  # DeepSpeed's auxiliary Adam defaults
MUON_NAMES = ("h1.weight", "h2.weight")


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.h1 = nn.Linear(WIDTH, HIDDEN)
        self.h2 = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.h2(F.gelu(self.h1(self.embed(x)))))
        return F.cross_entropy(self.lm_head(self.norm(h)).float(), y)


def build(dtype: torch.dtype = torch.float32) -> TinyLM:
    torch.manual_seed(SEED)
    return TinyLM().to(dtype)


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's global batch (``MICRO`` samples per rank), the same on every rank."""
    g = torch.Generator().manual_seed(SEED + 1)
    return [(torch.randint(0, VOCAB, (MICRO * world,), generator=g), torch.randint(0, VOCAB, (MICRO * world,), generator=g))
            for _ in range(STEPS)]


def flat_params(named: list[tuple[str, torch.Tensor]]) -> np.ndarray:
    return np.concatenate([t.detach().double().reshape(-1).numpy() for _, t in sorted(named)])


def reference(dtype: torch.dtype, parts: int, reverse: bool, ns_method: str, world: int = 2) -> dict[str, Any]:
    """Single-process Muon: the global batch's mean gradient, Muon updates for the hidden matrices, the norm over
    Adam's gradients and Muon's updates, one clip coefficient for both (DeepSpeed's ZeRO semantics), in
    ``dtype`` (the Newton-Schulz iteration too). ``parts`` 1: the whole batch at once; 0: one sample at a time
    (``reverse``: last first), accumulated."""
    previous, newton_schulz.NEWTON_SCHULZ_DTYPE = newton_schulz.NEWTON_SCHULZ_DTYPE, dtype
    try:
        model = build(dtype)
        params = dict(model.named_parameters())
        momentum: dict[str, torch.Tensor] = {}
        adam: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        losses, norms = [], []
        for step, (x, y) in enumerate(batches(world), start=1):
            model.zero_grad(set_to_none=True)
            if parts == 1:
                loss = model(x, y)
                loss.backward()
                losses.append(float(loss))
            else:
                order = range(len(x) - 1, -1, -1) if reverse else range(len(x))
                total = 0.0
                for i in order:
                    part = model(x[i:i + 1], y[i:i + 1]) / len(x)
                    part.backward()
                    total += float(part)
                losses.append(total)
            with torch.no_grad():
                updates = {n: muon_update(params[n].grad.clone(), momentum.setdefault(n, torch.zeros_like(params[n])),
                                          beta=MOMENTUM, ns_method=ns_method) for n in MUON_NAMES}
                sq = sum(float(u.double().square().sum()) for u in updates.values())
                sq += sum(float(p.grad.double().square().sum()) for n, p in params.items() if n not in updates)
                norm = math.sqrt(sq)
                norms.append(norm)
                clip = min(1.0, CLIP / (norm + 1e-6))
                for n, p in params.items():
                    if n in updates:
                        p.mul_(1 - LR * WEIGHT_DECAY)
                        p.add_(updates[n] * clip, alpha=-LR)
                    else:
                        m, v = adam.setdefault(n, (torch.zeros_like(p), torch.zeros_like(p)))
                        p.mul_(1 - ADAM_LR * WEIGHT_DECAY)
                        p.add_(adam_update(p.grad * clip, m, v, step, ADAM_BETAS, ADAM_EPS), alpha=-ADAM_LR)
        return {"losses": losses, "norms": norms, "params": flat_params(list(params.items()))}
    finally:
        newton_schulz.NEWTON_SCHULZ_DTYPE = previous


def ds_config(stage: int, ns_method: str, nvme_path: str | None = None,
              momentum_in_memory: bool = False) -> dict[str, Any]:
    """``nvme_path``: ZeRO-3 with the optimizer offloaded to NVMe swap files there (``momentum_in_memory``:
    ``save_muon_momentum_buffer_in_memory``)."""
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 100}
    if nvme_path is not None:
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": nvme_path},
                    save_muon_momentum_buffer_in_memory=momentum_in_memory)
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "optimizer": {"type": "Muon", "params": {"lr": LR, "adam_lr": ADAM_LR, "weight_decay": WEIGHT_DECAY,
                                                     "momentum": MOMENTUM, "ns_method": ns_method}},
            "zero_optimization": zero}


def _full_params(engine: Any) -> np.ndarray:
    return flat_params([(n, engine.strategy.full_param_value(p)) for n, p in engine.module.named_parameters()])


def _train(engine: Any, steps: list[tuple[torch.Tensor, torch.Tensor]], rank: int) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for x, y in steps:
        lo = rank * MICRO
        loss = engine(x[lo:lo + MICRO], y[lo:lo + MICRO])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def _swap_bytes(engine: Any) -> dict[str, int]:
    """What the NVMe run holds where: its swap files (bytes, keys; Muon's momentum files' bytes), and the momentum
    bytes in memory."""
    from dsrun.optim.muon.zero import MOMENTUM_FILE
    from dsrun.zero.swap_traffic import swap_stores

    stores = swap_stores(engine.strategy)
    prefix = MOMENTUM_FILE.format(name="")
    return {"files": sum(s.nbytes() for s in stores), "keys": sorted(k for s in stores for k in s.keys()),
            "momentum_files": sum(s.nbytes(k) for s in stores for k in s.keys() if k.startswith(prefix)),
            "momentum_memory": engine.features.get(MuonFeature).binding.momentum_bytes()}


def stages_and_resume(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """ZeRO 0-3 with Muon over the same batches (fp32 Newton-Schulz, as the reference); ZeRO-3 with NVMe
    optimizer offload, the momentum kept in memory, then swapped, with a checkpoint after 2 steps (saving changes
    nothing); that checkpoint resumed by a new engine at ZeRO-3 in memory and by one with NVMe offload (the
    momentum is per-rank state by matrix name at every stage: one stage is enough)."""
    import dsrun

    newton_schulz.NEWTON_SCHULZ_DTYPE = torch.float32
    out: dict[str, Any] = {}
    data = batches(world)
    for stage, ns_method in ((0, "gram"), (1, "standard"), (2, "gram"), (3, "standard")):
        engine, *_ = dsrun.initialize(model=build(), config=ds_config(stage, ns_method))
        losses, norms = _train(engine, data, rank)
        out[f"stage{stage}"] = {"losses": losses, "norms": norms, "params": _full_params(engine),
                                "groups": [(g["name"], len(g["params"])) for g in engine.optimizer.param_groups],
                                "owned": sorted(engine.features.get(MuonFeature).binding.momentum)}
        engine.destroy()
    path = os.path.join(save_dir, "ckpt")
    nvme = {key: ds_config(3, "standard", os.path.join(save_dir, f"nvme-{key}"), key) for key in (True, False)}
    for in_memory in (True, False):
        engine, *_ = dsrun.initialize(model=build(), config=nvme[in_memory])
        first = _train(engine, data[:2], rank)
        if not in_memory:
            engine.save_checkpoint(path, tag="t")
        rest = _train(engine, data[2:], rank)
        out[f"nvme_in_memory={in_memory}"] = {"losses": first[0] + rest[0], "norms": first[1] + rest[1],
                                              "params": _full_params(engine), "bytes": _swap_bytes(engine)}
        engine.destroy()
    went_on = out["nvme_in_memory=False"]
    out["resume"] = {"went_on": (went_on["losses"][2:], went_on["params"]),
                     "files": sorted(f for f in os.listdir(os.path.join(path, "t")) if "rank_states" in f)}
    for name, config in (("memory", ds_config(3, "standard")), ("nvme", nvme[False])):
        engine, *_ = dsrun.initialize(model=build(), config=config)
        engine.load_checkpoint(path, tag="t")
        out["resume"][name] = _train(engine, data[2:], rank)[0], _full_params(engine)
        engine.destroy()
    return out
