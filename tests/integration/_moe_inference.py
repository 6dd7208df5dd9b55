"""MoE inference workloads (importable by spawned ranks): a training checkpoint of an expert-parallel MoEGPT,
served by ``init_inference`` with expert parallelism and by a whole single-process model."""
from __future__ import annotations

from typing import Any

import torch

N_LAYER, N_EMBD, EXPERTS, VOCAB, LENGTH = 2, 16, 4, 256, 12  # VOCAB: the bytes tokenizer's


def spec(ep: int) -> dict[str, Any]:
    """The model's ``_target_`` mapping (what a run directory's resolved.yaml holds)."""
    return {"_target_": "dsrun.models.moe_gpt.MoEGPT", "vocab_size": VOCAB, "block_size": LENGTH,
            "n_layer": N_LAYER, "n_head": 2, "n_embd": N_EMBD, "dropout": 0.0,
            "moe": {"num_experts": EXPERTS, "k": 2, "ep_size": ep, "eval_capacity_factor": 1.0, "min_capacity": 2}}


def moe_gpt(ep: int) -> torch.nn.Module:
    from dsrun.models.moe_gpt import MoEGPT

    torch.manual_seed(0)  # shared weights: the same on every rank; experts are drawn from their global ids
    return MoEGPT(**{k: v for k, v in spec(ep).items() if k != "_target_"})


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(40 + rank)
    ids = torch.randint(0, VOCAB, (2, LENGTH + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def train_and_save(root: str, rank: int, stage: int = 2, tag: str = "t") -> dict[str, torch.Tensor]:
    """Two Adam steps of the ep=2 model at ZeRO ``stage``, saved (one file per expert); returns this rank's
    weights when saved by global name (its experts and the shared weights, whole)."""
    import dsrun
    from dsrun.checkpoint import experts

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 3e-2}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    engine, _, _, _ = dsrun.initialize(model=moe_gpt(2), config=cfg)
    for _ in range(2):
        engine.backward(engine(batch(rank)))
        engine.step()
    engine.save_checkpoint(root, tag=tag)
    weights = {name: state["weight"].float() for name, state in experts.expert_states(engine).items()}
    weights.update({name: engine.strategy.full_param_value(p).float() for name, p in engine.module.named_parameters()
                    if experts.MARK not in name})
    engine.destroy()
    return weights


def serve(rank: int, world: int, root: str) -> dict[str, Any]:
    """Logits of this rank's prompt from: the whole model on this process alone (reference), the whole model
    spread by ``moe={"ep_size": 2}``, and a model built with ep_size=2 (its experts localised at load), in
    fp32 and float64; plus the experts each rank keeps and the comms logger's all-to-all bytes."""
    import dsrun
    from dsrun import comm
    from dsrun.moe.layer import moe_layers

    dsrun.init_distributed()
    torch.set_num_threads(1)
    train_and_save(root, rank)
    prompt = batch(rank)[0]
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.float64):
        key = str(dtype).removeprefix("torch.")
        reference = dsrun.init_inference(moe_gpt(1), checkpoint=root, dtype=dtype)(prompt)
        spread = dsrun.init_inference(moe_gpt(1), checkpoint=root, dtype=dtype, moe={"ep_size": world})
        before = comm.get_comms_stats().get("all_to_all_single", {"message_bytes": 0})["message_bytes"]
        got = spread(prompt)
        after = comm.get_comms_stats().get("all_to_all_single", {"message_bytes": 0})["message_bytes"]
        built = dsrun.init_inference(moe_gpt(world), checkpoint=root, dtype=dtype, ep_size=world,
                                     moe_experts=[EXPERTS], moe_type="standard")
        out[key] = {"reference": reference.numpy(), "spread": got.numpy(), "built": built(prompt).numpy(),
                    "a2a_bytes": after - before}
        out["kept"] = [len(layer.deepspeed_moe.experts.deepspeed_experts) for layer in moe_layers(spread.module)]
        out["ids"] = [layer.global_expert_ids() for layer in moe_layers(spread.module)]
        out["ep_size"] = spread.ep_size
    out["generate"] = generate(root)
    # ZeRO-3 with ep=2: its per-expert files serve as the others do (whole model, and spread over the ranks)
    trained = train_and_save(root, rank, stage=3, tag="z3")
    whole = dsrun.init_inference(moe_gpt(1), checkpoint=f"{root}/z3", dtype=torch.float32)
    served = dict(whole.module.named_parameters())
    spread = dsrun.init_inference(moe_gpt(1), checkpoint=f"{root}/z3", dtype=torch.float32, moe={"ep_size": world})
    out["z3"] = {"weights": max(float((served[name].detach() - value).abs().max()) for name, value in trained.items()),
                 "expert_ids": sorted({int(n.split(".deepspeed_experts.")[1].split(".")[0]) for n in trained
                                       if ".deepspeed_experts." in n}),
                 "reference": whole(prompt).numpy(), "spread": spread(prompt).numpy()}
    return out



def analytic_a2a_bytes(itemsize: int) -> int:
    """One forward: two all-to-alls (dispatch, combine) of the (E, C, M) buffer per MoE layer, C the eval
    capacity ceil(tokens k / E) of this rank's 2 x 12 tokens."""
    capacity = -(-2 * LENGTH * 2 // EXPERTS)
    return N_LAYER * 2 * EXPERTS * capacity * N_EMBD * itemsize


def generate(root: str) -> dict[str, Any]:
    """``dsrun generate``'s rank work on an MoE run (experts spread over both ranks) against the whole model
    greedily generating on this process alone; and its pre-launch check for 2 and 3 ranks."""
    import dsrun
    from dsrun.data.tokenizers import get_tokenizer
    from dsrun.inference.textgen import GenerationRequest, check_request, run_request

    request = GenerationRequest(model={**spec(1)}, tokenizer="bytes", checkpoint=root, prompt="dsrun",
                                max_new_tokens=6, temperature=0.0, kernel_inject=False)
    check_request(request, 2)
    try:
        check_request(request, 3)
        refused = None
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        refused = str(err)
    result = run_request(request)
    tokenizer = get_tokenizer("bytes")
    ids = torch.as_tensor(tokenizer.encode(b"dsrun").astype("int64"))[None, :]
    whole = dsrun.init_inference(moe_gpt(1), checkpoint=root, dtype=torch.float32).generate(ids, 6, temperature=0.0)
    return {"completion": result["completion"], "ep_size": result["ep_size"], "refused_3": refused,
            "whole": tokenizer.decode(whole[0, ids.shape[1]:].tolist())}
