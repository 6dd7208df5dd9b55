"""The rank side of tests/integration/test_hybrid_engine.py: DeepSpeed-Chat's loop (generate, train on the answers,
generate again) on a hybrid engine at ZeRO-3, beside the references it must equal, every case in one launch."""
from __future__ import annotations

import copy
from typing import Any

import torch

from tests.integration._inference_models import hf_model, prompt

NEW_TOKENS, PROMPT, BATCH, STEPS = 6, 5, 2, 2


def _config(**hybrid: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            **({"hybrid_engine": {"enabled": True, **hybrid}} if hybrid else {})}


def _all_gathers(fn: Any) -> tuple[Any, int]:
    from dsrun import comm

    before = comm.get_comms_stats().get("all_gather", {}).get("count", 0)
    out = fn()
    return out, comm.get_comms_stats()["all_gather"]["count"] - before


def _loss(engine: Any, ids: torch.Tensor) -> float:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def _whole_generate(engine: Any, ids: torch.Tensor) -> torch.Tensor:
    """The plain engine's model, gathered whole, generating with Hugging Face's generate."""
    from dsrun.zero import unwrap_model_for_generation

    with torch.no_grad(), unwrap_model_for_generation(engine):
        return type(engine.module).generate(engine.module, ids, max_new_tokens=NEW_TOKENS, do_sample=False)


def rlhf_loop(rank: int, world: int, name: str, hybrid: dict[str, Any],
              references: dict[str, list[tuple[torch.Tensor, float]]]) -> dict[str, Any]:
    """Generate, train on the answers, generate again: the hybrid engine beside a plain ZeRO-3 engine (the same
    steps on the same sequences) and the whole model's generate. The plain engine's generations and losses are
    the same for every case of one model (same weights, seeds and prompts; the test checks each case's tokens
    against them): ``references`` keeps them per model, computed by its first case."""
    import dsrun

    torch.manual_seed(0)
    model = hf_model(name).train()
    ids = prompt(BATCH, PROMPT) + rank  # each rank its own prompts
    plain = None
    if name not in references:
        plain, *_ = dsrun.initialize(model=copy.deepcopy(model), config=_config())
        references[name] = []
    engine, *_ = dsrun.initialize(model=model, config=_config(**hybrid))
    out: dict[str, Any] = {"engine": type(engine).__name__, "generated": [], "whole": [], "gathers": [],
                           "groups": [], "workspace": [], "losses": [], "plain_losses": []}
    for step in range(STEPS):
        engine.eval()
        generated, gathers = _all_gathers(lambda: engine.module.generate(ids, max_new_tokens=NEW_TOKENS,
                                                                          do_sample=False))
        if plain is not None:  # the plain engine's generate, then its step on the same sequences
            whole = _whole_generate(plain, ids)
            plain.train()
            torch.manual_seed(1)
            references[name].append((whole, _loss(plain, generated)))
        out["generated"].append(generated)
        out["whole"].append(references[name][step][0])
        out["plain_losses"].append(references[name][step][1])
        out["gathers"].append(gathers)
        out["groups"].append(list(engine.hybrid.gather_groups))
        out["workspace"].append(engine.hybrid.workspace_bytes())
        engine.train()
        torch.manual_seed(1)
        out["losses"].append(_loss(engine, generated))
    out["workspace_after_training"] = engine.hybrid.workspace_bytes()
    out["parameters"] = sum(1 for _ in model.parameters())
    out["layers"] = model.config.num_hidden_layers
    out["shape"] = {k: getattr(model.config, k) for k in ("num_attention_heads", "hidden_size")}
    out["shape"]["num_key_value_heads"] = getattr(model.config, "num_key_value_heads", None) or \
        model.config.num_attention_heads
    try:  # more than max_out_tokens positions: refused before anything runs
        engine.module.generate(ids, max_new_tokens=int(engine._config.hybrid_engine.max_out_tokens), do_sample=False)
        out["over_budget"] = None
    except Exception as err:  # noqa: BLE001 - the test reads the error's type and text
        out["over_budget"] = f"{type(err).__name__}: {err}"
    engine.destroy()
    if plain is not None:
        plain.destroy()
    return out


def cases(rank: int, world: int, runs: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    references: dict[str, list[tuple[torch.Tensor, float]]] = {}
    return {case: rlhf_loop(rank, world, name, hybrid, references) for case, (name, hybrid) in runs.items()}
