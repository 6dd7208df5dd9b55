"""Universal checkpoints across pipeline layouts (issue 29, item 4): a pipeline-parallel ZeRO-1 run (2 stages on
2 ranks) is converted to a universal checkpoint and loaded at 2 stages, at 1 stage x 2 data-parallel ranks,
at 1 stage on 1 rank, and into the dense model at ZeRO-3; a dense ZeRO-2 run's universal checkpoint loads
at 2 stages. Training continues with the uninterrupted run's losses.

Tolerance: every run computes the same operations on the same micro-batches; the masters and Adam moments
carry over exactly (the conversion copies them), so the runs differ only in the order of fp32 sums (the tied
embedding's gradient across stages, the data-parallel average, the ZeRO flat buffers): a few units of
2^-24 ~ 6e-8 relative in a gradient, which Adam passes on to an update of lr = 3e-3 times it. Over 3 steps
that stays far inside 1e-6 relative on the losses, the bound tests/integration/test_pipe.py derives and
uses for the same model.

The model is the harness's tied language model (tests/harness/pipeline.py). Its dense form (``DenseLayers``)
holds the same layers in one module, named by layer index (the tied embedding once, at index 0): the names a
universal checkpoint uses (:mod:`dsrun.checkpoint.pipeline_state`). Every run trains on the same 4
micro-batches per step, spread over the data-parallel ranks as the pipeline runs spread them.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.harness import pipeline
from tests.harness.launch import Launch, Runs

pytestmark = pytest.mark.slow  # two launches (2 ranks, 1 rank)
TOL = 1e-6
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
            set_random_seed(pipeline.BASE_SEED + i)
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
        return pipeline.lm_loss(x, labels)


def dense_engine(zero_stage: int, gas: int, **extra: Any) -> Any:
    import dsrun

    engine, _, _, _ = dsrun.initialize(model=DenseLayers(pipeline.lm_specs()), optimizer=pipeline.torch_adamw,
                                       config=pipeline.pipe_config(gas, zero_stage, **extra))
    return engine


def dense_train(engine: Any, steps: int, first_step: int) -> list[float]:
    from dsrun import comm

    rank, world, gas = comm.get_rank(), comm.get_world_size(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(first_step, first_step + steps):
        total = torch.zeros(())
        for tokens, labels in pipeline.replica_batches(step, gas, rank):
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
    out["more"] = dense_train(engine, MORE, FIRST) if dense else pipeline.train(engine, MORE, first_step=FIRST)
    engine.destroy()
    return out


def two_ranks(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """pp=2 ZeRO-1 saves and goes on (the reference); converted, it loads at pp=2 and at pp=1 x dp=2; a dense
    dp=2 ZeRO-2 run saves, converted, it loads at pp=2."""
    out: dict[str, Any] = {}
    a = pipeline.build_engine("lm", 2, MICRO_BATCHES)
    out["first"] = pipeline.train(a, FIRST)
    a.save_checkpoint(save_dir, tag="pp2")
    out["more"] = pipeline.train(a, MORE, first_step=FIRST)
    a.destroy()
    _convert(save_dir, "pp2")
    out["pp2"] = _resume(pipeline.build_engine("lm", 2, MICRO_BATCHES, **UNIVERSAL), save_dir, "pp2", dense=False)
    out["pp1xdp2"] = _resume(pipeline.build_engine("lm", 1, MICRO_BATCHES // 2, **UNIVERSAL), save_dir, "pp2", dense=False)

    d = dense_engine(2, MICRO_BATCHES // 2)
    out["dense_first"] = dense_train(d, FIRST, 0)
    d.save_checkpoint(save_dir, tag="dense")
    d.destroy()
    _convert(save_dir, "dense")
    out["dense_to_pp2"] = _resume(pipeline.build_engine("lm", 2, MICRO_BATCHES, **UNIVERSAL), save_dir, "dense", dense=False)
    return out


def one_rank(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """The pp=2 checkpoint's universal form at 1 rank: a pp=1 pipeline (ZeRO-1) and the dense model (ZeRO-3)."""
    return {"pp1": _resume(pipeline.build_engine("lm", 1, MICRO_BATCHES, **UNIVERSAL), save_dir, "pp2", dense=False),
            "dense_z3": _resume(dense_engine(3, MICRO_BATCHES, **UNIVERSAL), save_dir, "pp2", dense=True)}


def collect(launch: Runs) -> tuple[dict, dict, str]:
    """Two ranks save (pipeline and dense), then resume at other layouts; one rank resumes at one."""
    save_dir = str(launch.root)
    two = launch(Launch(two_ranks, 2, (save_dir,), timeout=400))
    one = launch(Launch(one_rank, 1, (save_dir,), timeout=300, rank=0))
    return two[0], one, save_dir


@pytest.mark.parametrize("layout", ["pp2", "pp1xdp2", "pp1", "dense_z3"])
def test_pipeline_checkpoint_resumes_at_another_layout(runs, layout: str) -> None:
    two, one, _ = runs
    resumed = {**two, **one}[layout]
    assert resumed["steps"] == FIRST
    np.testing.assert_allclose(resumed["more"], two["more"], rtol=TOL)
    gap = np.abs(np.array(resumed["more"]) / np.array(two["more"]) - 1).max()
    print(f"universal checkpoint pp=2 ZeRO-1 -> {layout}: largest relative loss gap {gap:.2e} over {MORE} steps")


def test_dense_checkpoint_resumes_as_a_pipeline(runs) -> None:
    two, _, _ = runs
    np.testing.assert_allclose(two["dense_first"], two["first"], rtol=TOL)  # the same run, dense or pipelined
    assert two["dense_to_pp2"]["steps"] == FIRST
    np.testing.assert_allclose(two["dense_to_pp2"]["more"], two["more"], rtol=TOL)


def test_universal_folder_names_parameters_by_layer(runs) -> None:
    _, _, save_dir = runs
    from pathlib import Path

    names = {p.name for p in (Path(save_dir) / "pp2_universal" / "zero").iterdir() if p.is_dir()}
    dense = {p.name for p in (Path(save_dir) / "dense_universal" / "zero").iterdir() if p.is_dir()}
    assert "0.weight" in names and not any(n.startswith("tied_modules.") for n in names)
    assert names == dense
