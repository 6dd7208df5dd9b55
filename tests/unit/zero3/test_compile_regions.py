"""``compile.enabled`` under ZeRO 0-3: graph breaks per forward, recompiles, and the same losses as eager.

Breaks are counted with the ``eager`` backend (dynamo traces and breaks exactly as with inductor, without
inductor's seconds of code generation). Stages 0-2 run in this process (a world of one); stage 3 needs two ranks,
else its parameters are kept whole and there are no hooks at all (dsrun/zero/whole_params.py).
"""
from __future__ import annotations

import pytest
import torch

import dsrun
from tests.helpers import run_ranks

STEPS = 3


def _gpt() -> torch.nn.Module:
    from dsrun.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _blockless() -> torch.nn.Module:
    """No ModuleList: compiled whole, the stage-3 hooks breaking its graph."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 64))


def _train(stage: int, compiled: bool, model_name: str = "gpt") -> dict:
    """Per step: dynamo's graph breaks, the graphs it compiled, its recompiles; the losses; what was compiled."""
    from torch._dynamo.utils import counters

    model = _gpt() if model_name == "gpt" else _blockless()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}, "compile": {"enabled": compiled, "backend": "eager"}}
    torch._dynamo.reset()
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    breaks, graphs, recompiles, losses = [], [], [], []
    for _ in range(STEPS):
        counters.clear()
        if model_name == "gpt":
            loss = engine(x, x)
        else:
            loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), x.flatten())
        engine.backward(loss)
        engine.step()
        breaks.append(int(sum(counters["graph_break"].values())))
        graphs.append(int(counters["stats"]["unique_graphs"]))
        recompiles.append(int(counters["recompiles"].get("total", 0)) if "recompiles" in counters else 0)
        losses.append(loss.item())
    compiled_modules = sorted(name or "root" for name, m in model.named_modules()
                              if getattr(m, "_compiled_call_impl", None) is not None)
    hooked = len(getattr(engine.strategy.coordinator, "_hooked", {})) if stage == 3 else 0
    engine.destroy()
    return {"breaks": breaks, "graphs": graphs, "recompiles": recompiles, "losses": losses,
            "compiled": compiled_modules, "hooked": hooked}


def _stage3_rank(rank: int, world_size: int) -> dict[str, tuple[dict, dict]]:
    return {name: (_train(3, True, name), _train(3, False, name)) for name in ("gpt", "blockless")}


@pytest.mark.usefixtures("world_of_one")  # torn down after the module: later tests start their own world
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_to_2_compile_whole_without_a_graph_break(stage: int) -> None:
    compiled, eager = _train(stage, True), _train(stage, False)
    assert compiled["compiled"] == ["root"]
    assert compiled["breaks"] == [0] * STEPS  # none caused by dsrun: the stages' hooks run in backward
    assert compiled["graphs"] == [1, 0, 0]  # one graph, compiled once, reused by the next steps
    assert compiled["losses"] == eager["losses"]  # the eager backend runs the same ops


def test_stage3_compiles_each_block_with_the_hooks_outside_the_graphs() -> None:
    runs = run_ranks(_stage3_rank, 2)[0]
    compiled, eager = runs["gpt"]
    assert compiled["compiled"] == ["transformer.h.0", "transformer.h.1"]
    assert compiled["breaks"] == [0] * STEPS  # the gathers and releases run around each block's graph
    assert compiled["graphs"] == [1, 0, 0]  # both blocks share one graph; no recompile on later steps
    assert compiled["recompiles"] == [0] * STEPS
    assert compiled["losses"] == eager["losses"]
    # a model without blocks is compiled whole: its graph ends at each hooked module's opaque hooks
    compiled, eager = runs["blockless"]
    assert compiled["compiled"] == ["root"]
    assert compiled["breaks"][0] + compiled["graphs"][0] <= compiled["hooked"]  # at most one piece per module
    assert compiled["breaks"][1:] == [0] * (STEPS - 1) and compiled["graphs"][1:] == [0] * (STEPS - 1)
    assert compiled["recompiles"] == [0] * STEPS  # no guard on the coordinator's state
    assert compiled["losses"] == eager["losses"]
