"""Models and per-rank jobs for the inference tests (importable by ``tests.helpers.run_ranks`` ranks).

Hugging Face architectures are built from small configs with random weights (no hub is reachable); every
rank builds the same weights from the same seed. Each job computes the single-process reference first (the
whole model), then splits the model over the ranks with ``dsrun.init_inference`` and runs the same inputs.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

VOCAB = 97
HF_NAMES = ("gpt2", "llama", "mistral", "opt", "bert", "t5")
GENERATES = {"gpt2", "llama", "mistral", "opt", "t5"}  # BERT is a masked LM: logits only


def hf_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    import transformers as t

    small = dict(vocab_size=VOCAB)
    decoder = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    configs = {
        "gpt2": (t.GPT2Config, t.GPT2LMHeadModel, dict(n_layer=2, n_head=4, n_embd=32, n_positions=64, **decoder)),
        "llama": (t.LlamaConfig, t.LlamaForCausalLM, dict(num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, hidden_size=32, intermediate_size=64,
                                                          max_position_embeddings=64, **decoder)),
        "gptj": (t.GPTJConfig, t.GPTJForCausalLM, dict(n_layer=2, n_head=4, n_embd=32, n_positions=64, rotary_dim=4,
                                                       **decoder)),
        "mistral": (t.MistralConfig, t.MistralForCausalLM, dict(num_hidden_layers=2, num_attention_heads=4,
                                                                num_key_value_heads=2, hidden_size=32,
                                                                intermediate_size=64, max_position_embeddings=64,
                                                                sliding_window=8, **decoder)),
        "opt": (t.OPTConfig, t.OPTForCausalLM, dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                                                    ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32,
                                                    **decoder)),
        "bert": (t.BertConfig, t.BertForMaskedLM, dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                                                       intermediate_size=64, max_position_embeddings=64)),
        "t5": (t.T5Config, t.T5ForConditionalGeneration, dict(num_layers=2, num_decoder_layers=2, num_heads=4,
                                                              d_model=32, d_kv=8, d_ff=64, decoder_start_token_id=0,
                                                              pad_token_id=0, eos_token_id=1)),
    }
    config_class, model_class, kwargs = configs[name]
    torch.manual_seed(0)
    return model_class(config_class(**small, **kwargs)).to(dtype).eval()


def dsrun_gpt(dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    from dsrun.models.gpt import GPT

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, block_size=48, n_layer=2, n_head=4, n_embd=32, **overrides)
    return GPT(**shape).to(dtype).eval()


def build(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    if name == "dsrun-gpt":
        return dsrun_gpt(dtype)
    if name == "dsrun-gpt-rotary":
        return dsrun_gpt(dtype, positions="rotary", tie_embeddings=False)
    return hf_model(name, dtype)


def prompt(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def _logits(model: Any, name: str, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if name.startswith("dsrun-gpt"):
            return model(ids)
        extra = {"decoder_input_ids": ids[:, :5]} if name == "t5" else {}
        return model(input_ids=ids, **extra).logits


def _generate(model: Any, name: str, ids: torch.Tensor, new: int) -> torch.Tensor:
    if name.startswith("dsrun-gpt"):
        return model.generate(ids, new, temperature=0)
    return model.generate(ids, max_new_tokens=new, do_sample=False)


def compare_split(rank: int, world: int, names: list[str], new_tokens: int = 6) -> dict[str, Any]:
    """Per architecture: logits of the whole model and of the split one (fp32 and float64), greedy
    generations of both (fp32), and the plan's shape for the tolerance (sequential matmuls, longest sum)."""
    import dsrun
    from dsrun.inference.layers import is_linear, linear_parts

    out: dict[str, Any] = {}
    ids = prompt()
    for name in names:
        entry: dict[str, Any] = {}
        for dtype in (torch.float32, torch.float64):
            model = build(name, dtype)
            entry["longest_sum"] = max(linear_parts(m)[0].shape[1] for m in model.modules() if is_linear(m))
            reference = _logits(model, name, ids)
            generated = _generate(model, name, ids, new_tokens) if name in GENERATES | {"dsrun-gpt",
                                                                                          "dsrun-gpt-rotary"} else None
            engine = dsrun.init_inference(model, tensor_parallel={"tp_size": world}, dtype=dtype)
            key = str(dtype).removeprefix("torch.")
            entry[key] = {"reference": reference.numpy(), "split": _logits(engine, name, ids).numpy()}
            if generated is not None and dtype == torch.float32:
                entry["generated"] = generated.numpy()
                entry["generated_split"] = _generate(engine, name, ids, new_tokens).numpy()
            entry["sequential"] = 2 * sum(len(p.pairs) for p in engine.block_plans) + 1
        out[name] = entry
    return out


def fp32_bound(entry: dict[str, Any], dtype: str) -> float:
    """How far two evaluations of the same logits in ``dtype`` may differ when they sum in different orders.

    Each dot product of length n carries at most n·u relative rounding (u: the unit roundoff), and the
    logits come out of ``sequential`` such products in a row (two per linear pair, plus the head); norms
    renormalise the residual stream to order 1, so the bound is taken relative to max(1, |logit|)."""
    unit = float(np.finfo(np.float32 if dtype == "float32" else np.float64).eps) / 2
    scale = max(1.0, float(np.abs(entry[dtype]["reference"]).max()))
    return 2 * entry["sequential"] * entry["longest_sum"] * unit * scale


def allreduce_per_token(rank: int, world: int, batch: int, length: int, new_tokens: int) -> dict[str, Any]:
    """The comms logger's all-reduce totals of a greedy generation, fused (KV cache) and plain."""
    import dsrun
    from dsrun import comm

    out: dict[str, Any] = {}
    for fused in (True, False):
        engine = dsrun.init_inference(dsrun_gpt(), tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                      replace_with_kernel_inject=fused)
        comm.reset_comms_stats()
        tokens = engine.generate(prompt(batch, length), new_tokens, temperature=0)
        out["fused" if fused else "plain"] = {"stats": comm.get_comms_stats(), "tokens": tokens.numpy()}
    config = engine.module.config
    out["shape"] = {"n_layer": config.n_layer, "n_embd": config.n_embd}
    return out


class UserBlock(torch.nn.Module):
    """A block whose linears have names automatic TP does not know: it needs an injection_policy."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.n_head, self.head_size = heads, width // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.to_qkv = torch.nn.Linear(width, 3 * width)
        self.mix = torch.nn.Linear(width, width)
        self.expand = torch.nn.Linear(width, 3 * width)
        self.shrink = torch.nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        width = self.n_head * self.head_size
        q, k, v = (z.view(b, t, self.n_head, self.head_size).transpose(1, 2)
                   for z in self.to_qkv(self.norm1(x)).split(width, dim=2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.mix(y.transpose(1, 2).reshape(b, t, width))
        return x + self.shrink(torch.relu(self.expand(self.norm2(x))))


class UserModel(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.layers = torch.nn.ModuleList(UserBlock() for _ in range(2))
        self.head = torch.nn.Linear(32, VOCAB)
        self.to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


USER_POLICY_NAMES = ("mix", "shrink")


def user_model_split(rank: int, world: int) -> dict[str, Any]:
    """The user model with ``injection_policy={UserBlock: ("mix", "shrink")}``: reference and split logits."""
    import dsrun

    ids = prompt()
    model = UserModel()
    with torch.no_grad():
        reference = model(ids)
    engine = dsrun.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                  injection_policy={UserBlock: USER_POLICY_NAMES})
    return {"reference": reference.numpy(), "split": engine(ids).numpy(),
            "plan": [plan.describe() for plan in engine.block_plans],
            "heads": [layer.n_head for layer in engine.module.layers]}


def load_split(rank: int, world: int, sources: dict[str, Any]) -> dict[str, Any]:
    """For each named checkpoint source: the logits of a fresh model loaded from it at TP=``world``."""
    import dsrun
    from tests.harness.models import VOCAB as CKPT_VOCAB
    from tests.harness.models import checkpoint_gpt

    ids = torch.randint(0, CKPT_VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    out: dict[str, Any] = {"ids": ids.numpy()}
    for name, source in sources.items():
        engine = dsrun.init_inference(checkpoint_gpt(0.0), checkpoint=source, tensor_parallel={"tp_size": world},
                                      dtype=torch.float32)
        out[name] = engine(ids).numpy()
    return out


class PairMPU:
    """A Megatron-style mpu: ranks (0, 1), (2, 3), ... are model-parallel pairs."""

    def __init__(self, group: Any):
        self.group = group

    def get_model_parallel_group(self) -> Any:
        return self.group

    def get_model_parallel_rank(self) -> int:
        from dsrun import comm

        return comm.get_rank(self.group)

    def get_model_parallel_world_size(self) -> int:
        from dsrun import comm

        return comm.get_world_size(self.group)


def group_sources(rank: int, world: int) -> dict[str, Any]:
    """TP=2 inside a bigger world, with the group made by dsrun, passed as tp_group, or from an mpu."""
    import dsrun
    from dsrun import comm

    comm.init_distributed(verbose=False)
    ids = prompt()
    with torch.no_grad():
        out: dict[str, Any] = {"reference": dsrun_gpt()(ids).numpy()}
    pairs = [comm.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank makes every group
    mine = pairs[rank // 2]
    settings = {"consecutive": {"tensor_parallel": {"tp_size": 2}},
                "tp_group": {"tensor_parallel": {"tp_size": 2, "tp_group": mine}},
                "mpu": {"mpu": PairMPU(mine)}, "tp.mpu": {"tensor_parallel": {"mpu": PairMPU(mine)}}}
    for name, kwargs in settings.items():
        comm.reset_comms_stats()
        engine = dsrun.init_inference(dsrun_gpt(), dtype=torch.float32, **kwargs)
        out[name] = {"logits": engine(ids).numpy(), "tp": (engine.tp.rank, engine.tp.size),
                     "all_reduce": comm.get_comms_stats()["all_reduce"]["count"]}
    return out


def injected_split(rank: int, world: int, names: list[str], new_tokens: int = 6) -> dict[str, Any]:
    """Kernel injection over the ranks (``replace_with_kernel_inject`` with ``tp_size=world``): per architecture,
    the whole model's fp32 logits and greedy generation, the injected split model's, and each injected layer's
    share of the query/key/value columns."""
    import dsrun
    from dsrun.inference.injection import DeepSpeedTransformerInference

    out: dict[str, Any] = {}
    ids = prompt()
    for name in names:
        model = build(name)
        entry: dict[str, Any] = {"longest_sum": max(max(p.shape) for p in model.parameters()
                                                    if p.dim() == 2 and max(p.shape) < VOCAB)}
        entry["reference"] = _logits(model, name, ids).numpy()
        entry["generated"] = _generate(model, name, ids, new_tokens).numpy()
        engine = dsrun.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                      replace_with_kernel_inject=True)
        layers = [m for m in engine.module.modules() if isinstance(m, DeepSpeedTransformerInference)]
        entry["qkv_columns"] = [tuple(layer.attention.attn_qkvw.shape) for layer in layers]
        entry["split"] = _logits(engine, name, ids).numpy()
        entry["generated_split"] = _generate(engine, name, ids, new_tokens).numpy()
        out[name] = entry
    return out
