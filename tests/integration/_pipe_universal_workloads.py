"""Per-rank runs for tests/integration/test_pipe_universal.py: universal checkpoints across pipeline layouts.

The model is ``_pipe_workloads``' tied language model. Its dense form (:class:`DenseLayers`) holds the same
layers in one module, named by layer index (the tied embedding once, at index 0): the names a universal
checkpoint uses (:mod:`dsrun.checkpoint.pipeline_state`). Every run trains on the same 4 micro-batches per
step, spread over the data-parallel ranks as ``_pipe_workloads.checkpoint_case`` spreads them.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from tests.integration import _pipe_workloads as w

MICRO_BATCHES, FIRST, MORE = 4, 3, 3
UNIVERSAL = {"checkpoint": {"load_universal": True}}


class DenseLayers(nn.Module):
    """The layers of ``specs`` run in order in one module, each registered under its index (a tied module
    once, at its key's first index), initialised as the pipeline's ``seed_layers`` initialises them."""

    def __init__(self, specs: list[Any]) -> None:
        from dsrun.pipe import TiedLayerSpec
        from dsrun.pipe.module import set_random_seed

        super().__init__()
        self.calls: list[Any] = []
        tied: dict[str, nn.Module] = {}
        for i, spec in enumerate(specs):
            set_random_seed(w.BASE_SEED + i)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:
                    tied[spec.key] = spec.build()
                    self.add_module(str(i), tied[spec.key])
                module = tied[spec.key]
                self.calls.append(partial(spec.forward_fn, module) if spec.forward_fn else module)
            else:
                self.add_module(str(i), spec.build())
                self.calls.append(getattr(self, str(i)))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = tokens
        for call in self.calls:
            x = call(x)
        return w.lm_loss(x, labels)


def dense_engine(zero_stage: int, gas: int, **extra: Any) -> Any:
    import dsrun

    engine, _, _, _ = dsrun.initialize(model=DenseLayers(w.lm_specs()), optimizer=w.torch_adamw,
                                       config=w.pipe_config(gas, zero_stage, **extra))
    return engine


def dense_train(engine: Any, steps: int, first_step: int) -> list[float]:
    from dsrun import comm

    rank, world, gas = comm.get_rank(), comm.get_world_size(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(first_step, first_step + steps):
        total = torch.zeros(())
        for tokens, labels in w.replica_batches(step, gas, rank):
            loss = engine(tokens, labels)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        comm.all_reduce(total)
        losses.append(float(total) / (gas * world))
    return losses


def _convert(save_dir: str, tag: str) -> None:
    from dsrun import comm
    from dsrun.checkpoint.ds_to_universal import ds_to_universal

    if comm.get_rank() == 0:
        ds_to_universal(f"{save_dir}/{tag}", f"{save_dir}/{tag}_universal", verbose=False)
    comm.barrier()


def _resume(engine: Any, save_dir: str, tag: str, dense: bool) -> dict[str, Any]:
    engine.load_checkpoint(save_dir, tag=f"{tag}_universal")
    out = {"steps": engine.global_steps}
    out["more"] = dense_train(engine, MORE, FIRST) if dense else w.train(engine, MORE, first_step=FIRST)
    engine.destroy()
    return out


def two_ranks(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """pp=2 ZeRO-1 saves and goes on (the reference); converted, it loads at pp=2 and at pp=1 x dp=2; a dense
    dp=2 ZeRO-2 run saves, converted, it loads at pp=2."""
    out: dict[str, Any] = {}
    a = w.build_engine("lm", 2, MICRO_BATCHES)
    out["first"] = w.train(a, FIRST)
    a.save_checkpoint(save_dir, tag="pp2")
    out["more"] = w.train(a, MORE, first_step=FIRST)
    a.destroy()
    _convert(save_dir, "pp2")
    out["pp2"] = _resume(w.build_engine("lm", 2, MICRO_BATCHES, **UNIVERSAL), save_dir, "pp2", dense=False)
    out["pp1xdp2"] = _resume(w.build_engine("lm", 1, MICRO_BATCHES // 2, **UNIVERSAL), save_dir, "pp2", dense=False)

    d = dense_engine(2, MICRO_BATCHES // 2)
    out["dense_first"] = dense_train(d, FIRST, 0)
    d.save_checkpoint(save_dir, tag="dense")
    d.destroy()
    _convert(save_dir, "dense")
    out["dense_to_pp2"] = _resume(w.build_engine("lm", 2, MICRO_BATCHES, **UNIVERSAL), save_dir, "dense", dense=False)
    return out


def one_rank(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """The pp=2 checkpoint's universal form at 1 rank: a pp=1 pipeline (ZeRO-1) and the dense model (ZeRO-3)."""
    return {"pp1": _resume(w.build_engine("lm", 1, MICRO_BATCHES, **UNIVERSAL), save_dir, "pp2", dense=False),
            "dense_z3": _resume(dense_engine(3, MICRO_BATCHES, **UNIVERSAL), save_dir, "pp2", dense=True)}
