"""Per-rank jobs of the AutoTP training tests (importable by ``tests.helpers.run_ranks`` ranks).

Every job builds the same small Hugging Face causal LM from its config (same seed: the same weights on every
rank), trains it through ``dsrun.initialize`` with ZeRO-1 and Adam in fp32 on a fixed token dataset read through
the engine's loader, and returns what the tests compare: the per-step losses, the bytes of the split matrices
this rank holds, the batches it read.
"""
from __future__ import annotations

from typing import Any

import torch

from tests.integration._inference_models import VOCAB, hf_model

SEQ, SAMPLES = 12, 64


def causal_lm(name: str) -> torch.nn.Module:
    if name == "qwen2":
        import transformers as t

        torch.manual_seed(0)
        config = t.Qwen2Config(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               hidden_size=32, intermediate_size=64, max_position_embeddings=64, bos_token_id=0,
                               eos_token_id=0, pad_token_id=0)
        return t.Qwen2ForCausalLM(config)
    model = hf_model(name).train()
    for module in model.modules():  # GPT-2's dropout draws different numbers once its heads are split
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


class Tokens(torch.utils.data.Dataset):
    """Fixed random token rows (the same on every rank)."""

    def __init__(self) -> None:
        self.ids = torch.randint(1, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.ids[index]


def ds_config(tp: int, dp: int, micro: int = 2) -> dict[str, Any]:
    config: dict[str, Any] = {"train_batch_size": micro * dp, "train_micro_batch_size_per_gpu": micro,
                              "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 6,
                              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    return config


def _engine(name: str, tp: int, world: int, **extra: Any) -> Any:
    import dsrun

    model = causal_lm(name)
    engine, _, loader, _ = dsrun.initialize(model=model, config={**ds_config(tp, world // tp), **extra},
                                            training_data=Tokens())
    return engine, loader


def _train(engine: Any, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _batches(loader: Any, steps: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    while len(out) < steps:
        out += list(loader)
    return out[:steps]


def split_bytes(engine: Any) -> dict[str, int]:
    """Bytes of each parameter of the (possibly split) linears of the blocks, by name."""
    from dsrun.tensor_parallel import TensorParallelLinear

    held = {}
    for module_name, module in engine.module.named_modules():
        if isinstance(module, TensorParallelLinear) or module_name.split(".")[-1] in SPLIT_NAMES:
            for pname, p in module.named_parameters(recurse=False):
                held[f"{module_name}.{pname}"] = p.numel() * p.element_size()
    return held


SPLIT_NAMES = {"c_attn", "c_proj", "c_fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj", "lm_head"}


def reference_losses(name: str, dp: int, steps: int, micro: int = 2) -> list[float]:
    """The unsplit model trained in this process alone with torch's Adam and clipping (no dsrun), on the global
    batches the ``dp`` data-parallel ranks' loaders give."""
    from dsrun.engine.dataloader import DeepSpeedDataLoader

    model = causal_lm(name)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loaders = [DeepSpeedDataLoader(Tokens(), micro, data_parallel_world_size=dp, data_parallel_rank=r)
               for r in range(dp)]
    rank_batches = [_batches(loader, steps) for loader in loaders]
    losses = []
    for step in range(steps):
        ids = torch.cat([batches[step] for batches in rank_batches])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_job(rank: int, world: int, names: list[str], tp: int, steps: int) -> dict[str, Any]:
    """For each model: ``steps`` steps at TP=``tp``; the losses, the bytes of the block linears, the first batch
    this rank read, and (on rank ``index % world``) the unsplit reference's losses."""
    results = {}
    for index, name in enumerate(names):
        engine, loader = _engine(name, tp, world)
        batches = _batches(loader, steps)
        losses = _train(engine, batches)
        results[name] = {"losses": losses, "bytes": split_bytes(engine), "first_batch": batches[0],
                         "deepspeed_groups": deepspeed_groups(engine),
                         "tp_rank": engine.groups.coord("model"), "dp_rank": engine.groups.coord("data"),
                         "autotp_size": engine.autotp_size(),
                         # each model's reference on one rank, so the ranks compute them side by side
                         "reference": reference_losses(name, world // tp, steps) if rank == index % world else None,
                         "whole_bytes": split_bytes_of(causal_lm(name))}
        engine.destroy()
    return results


def deepspeed_groups(engine: Any) -> dict[str, Any]:
    """What DeepSpeed's getters (``deepspeed.utils.groups``, ``deepspeed.runtime.utils``) say of the run."""
    from dsrun.compat.runtime.utils import is_model_parallel_parameter
    from dsrun.compat.utils import groups

    module = engine.module
    block = module.model.layers[0] if hasattr(module, "model") else module.transformer.h[0]
    linear = block.self_attn.q_proj if hasattr(block, "self_attn") else block.attn.c_attn
    return {"tp": (groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank(),
                   groups.get_tensor_model_parallel_src_rank()),
            "dp": (groups.get_data_parallel_world_size(), groups.get_data_parallel_rank()),
            "split": is_model_parallel_parameter(linear.weight),
            "whole": is_model_parallel_parameter(module.get_input_embeddings().weight)}


def split_bytes_of(model: torch.nn.Module) -> dict[str, int]:
    return {f"{m}.{p}": t.numel() * t.element_size() for m, module in model.named_modules()
            if m.split(".")[-1] in SPLIT_NAMES for p, t in module.named_parameters(recurse=False)}


def two_rank_job(rank: int, world: int, names: list[str], steps: int, save_dir: str) -> dict[str, Any]:
    """One launch for the 2-rank tests: :func:`train_job`'s results, :func:`checkpoint_job`'s under
    ``"checkpoint"`` (GPT-2), Llama split by :data:`LLAMA_RULES` (``"rules"``) and the fused GQA model of
    :func:`gqa_job` (``"gqa"``)."""
    return {**train_job(rank, world, names, 2, steps), "checkpoint": checkpoint_job(rank, world, "gpt2", save_dir),
            "foreign_group": foreign_tp_group(rank, world), "stages": other_stages(rank, world),
            "given_groups": given_groups_job(rank, world), "policy": policy_job(rank, world),
            "inconsistent": inconsistent_batch(rank, world),
            "rules": rules_job(world, steps), "gqa": gqa_job(rank, steps, save_dir), "vocab": vocab_job(world)}


def vocab_job(world: int, steps: int = 6) -> dict[str, Any]:
    """Llama (untied head) and GPT-2 (head tied to its embedding) at TP=2 with ``vocab_parallel_lm_head``: the
    first ``steps`` losses, the rows of the embedding and the LM head this rank holds, the logits' shape."""
    out = {}
    for name in ("llama", "gpt2"):
        engine, loader = _engine(name, 2, world, tensor_parallel={"autotp_size": 2, "vocab_parallel_lm_head": True,
                                                                  "vocab_parallel_ce_backend": "torch"})
        batches = _batches(loader, steps)
        losses = _train(engine, batches)
        module = engine.module
        with torch.no_grad():
            logits = module(input_ids=batches[0]).logits
        out[name] = {"losses": losses, "logits": tuple(logits.shape),
                     "rows": (module.get_input_embeddings().weight.shape[0], module.lm_head.weight.shape[0]),
                     "tied": module.get_input_embeddings().weight is module.lm_head.weight}
        engine.destroy()
    return out


class FusedGQA(torch.nn.Module):
    """Grouped-query attention with one fused ``qkv_proj`` (q|k|v of unequal widths: ``heads`` query heads and
    ``kv_heads`` key/value heads of ``head_dim``), causal; its forward reads its own head counts (which the split
    divides)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_proj = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim)
        self.o_proj = torch.nn.Linear(heads * head_dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q_width, kv_width = self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_width, kv_width, kv_width], dim=-1)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        group = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class GatedMLP(torch.nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(hidden, width), torch.nn.Linear(hidden, width)
        self.down_proj = torch.nn.Linear(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedGQAModel(torch.nn.Module):
    """A one-block causal LM: 4 query heads and 2 key/value heads of 4 in a fused q|k|v (widths 16, 8, 8), an MLP
    of 48 (cut in grains of 32: 32 and 16), untied head; ``forward(ids)`` is the next-token loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.norm1, self.norm2 = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)
        self.attn, self.mlp = FusedGQA(16, 4, 2, 4), GatedMLP(16, 48)
        self.lm_head = torch.nn.Linear(16, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        logits = self.lm_head(x)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


# the fused q|k|v as three sub-parameters of unequal widths, each cut on whole heads; the MLP in grains of 32
GQA_TP = {"autotp_size": 2, "tp": {"tp_grain_size": 32}, "partition_config": {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.qkv_proj\.weight$"], "partition_type": "column", "shape": [[16, 8, 8], -1],
     "partition_dim": 0},
    {"patterns": [r".*\.(o_proj|down_proj)\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.(gate_proj|up_proj)\.weight$"], "partition_type": "column"}]}}


def gqa_job(rank: int, steps: int, save_dir: str) -> dict[str, Any]:
    """:class:`FusedGQAModel` at TP=2 split by :data:`GQA_TP` (ZeRO-1, Adam): ``steps`` losses, the split
    parameters' shapes, a checkpoint's merge (rank 0: ``merge_checkpoint`` and ``zero_to_fp32``) against the
    weights all-gathered live (``_consolidated_16bit_state_dict``); rank 0 also trains the unsplit model with
    torch's Adam (the reference)."""
    import dsrun
    from dsrun.checkpoint.tensor_parallel import merge_checkpoint
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    config = {**ds_config(2, 1), "tensor_parallel": GQA_TP, "gradient_clipping": 1.0}
    engine, _, loader, _ = dsrun.initialize(model=FusedGQAModel(), config=config, training_data=Tokens())
    batches = _batches(loader, steps)
    losses = []
    for ids in batches:
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    shapes = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    engine.save_checkpoint(save_dir, tag="gqa")
    live = engine._consolidated_16bit_state_dict()
    engine.destroy()
    out: dict[str, Any] = {"losses": losses, "shapes": shapes, "reference": None}
    if rank == 0:
        out.update(live=live, merged=merge_checkpoint(save_dir, "gqa"),
                   fp32=get_fp32_state_dict_from_zero_checkpoint(save_dir, "gqa"))
        model = FusedGQAModel()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        out["reference"] = []
        for ids in batches:
            loss = model(ids)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            out["reference"].append(loss.item())
    return out


# tensor_parallel.partition_config: attention split by name, the MLP's gate and up projections column-parallel
# with their outputs gathered (every rank then holds the whole MLP activation), down_proj matched by no spec (whole)
LLAMA_RULES = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.mlp\.(gate|up)_proj\.weight$"], "partition_type": "column", "gather_output": True},
    {"patterns": [r".*\.input_layernorm\.weight$"], "partition_type": "skip"}]}


def rules_job(world: int, steps: int) -> dict[str, Any]:
    """Llama at TP=2 split by :data:`LLAMA_RULES`: ``steps`` steps' losses and the bytes of the block linears.
    (``preset_model: llama`` cuts exactly the automatic split's slices: tests/unit/tensor_parallel.)"""
    engine, loader = _engine("llama", 2, world, tensor_parallel={"autotp_size": 2, "partition_config": LLAMA_RULES})
    losses = _train(engine, _batches(loader, steps))
    held = split_bytes(engine)
    engine.destroy()
    return {"losses": losses, "bytes": held}


def other_stages(rank: int, world: int, steps: int = 4) -> dict[int, list[float]]:
    """GPT-2 at TP=2 under ZeRO stages 0 and 2 (and bf16 at stage 2): the first ``steps`` losses."""
    out: dict[Any, list[float]] = {}
    for key, extra in ((0, {}), (2, {}),
                       ("bf16", {"bf16": {"enabled": True}, "tensor_parallel": {"autotp_size": 2, "dtype": "bf16"}}),
                       ("overlap", {"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True,
                                                        "keep_module_on_host": True}})):
        stage = key if isinstance(key, int) else 2 if key == "bf16" else 1
        engine, loader = _engine("gpt2", 2, world, zero_optimization={"stage": stage}, **extra)
        out[key] = _train(engine, _batches(loader, steps))
        engine.destroy()
    return out


def inconsistent_batch(rank: int, world: int) -> str:
    """What the first forward of a TP=2 engine says when the two ranks of its group are given different batches."""
    engine, loader = _engine("gpt2", 2, world)
    ids = next(iter(loader))
    try:
        engine(input_ids=ids + rank, labels=ids)
    except AssertionError as err:
        return str(err)
    finally:
        engine.destroy()
    return "accepted"


def foreign_tp_group(rank: int, world: int) -> dict[str, str]:
    """What ``initialize`` says of a tensor-parallel group that is not the topology's: given by
    ``tp_model_init(tp_group=...)``, by ``tensor_parallel.tp.tp_group``, and an mpu whose data-parallel group is
    not the layout's (``tensor_parallel.tp.mpu``)."""
    from dsrun import comm
    from dsrun.tensor_parallel import reset_tp_model_init, tp_model_init
    from dsrun.utils.errors import ConfigError

    alone = [comm.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    both = comm.new_group(list(range(world)))
    said = {}
    for key, extra in (("tp_model_init", {}), ("tp_group", {"tp": {"tp_group": alone}}),
                       ("mpu", {"tp": {"mpu": GivenMpu(both, both)}})):
        if key == "tp_model_init":
            tp_model_init(causal_lm("gpt2"), tp_size=2, dtype=torch.float32, tp_group=alone)
        try:
            _engine("gpt2", 1 if key == "tp_model_init" else 2, world,
                    **({"tensor_parallel": {"autotp_size": 2, **extra}} if extra else {}))
            said[key] = "accepted"
        except ConfigError as err:
            said[key] = str(err)
        finally:
            reset_tp_model_init()
    return said


class GivenMpu:
    """A model-parallel unit (DeepSpeed's mpu getters) over groups the script made."""

    def __init__(self, model_group: Any, data_group: Any) -> None:
        self.model_group, self.data_group = model_group, data_group

    def get_model_parallel_group(self) -> Any:
        return self.model_group

    def get_data_parallel_group(self) -> Any:
        return self.data_group


def given_groups_job(rank: int, world: int, steps: int = 4) -> dict[str, Any]:
    """GPT-2 at TP=2 given its tensor-parallel group by the script: as ``tensor_parallel.tp.tp_group``, and as the
    model-parallel group of a ``tensor_parallel.tp.mpu``; the first ``steps`` losses, and whether the split layers
    and the feature communicate over that very group."""
    from dsrun import comm
    from dsrun.tensor_parallel import AutoTPFeature, TensorParallelLinear

    model_group = comm.new_group(list(range(world)))
    data_group = [comm.new_group([r]) for r in range(world)][rank]
    out = {}
    for key, tp in (("tp_group", {"tp_group": model_group}), ("mpu", {"mpu": GivenMpu(model_group, data_group)})):
        engine, loader = _engine("gpt2", 2, world, tensor_parallel={"autotp_size": 2, "tp": tp})
        layers = [m for m in engine.module.modules() if isinstance(m, TensorParallelLinear)]
        feature = engine.features.get(AutoTPFeature)
        out[key] = {"losses": _train(engine, _batches(loader, steps)),
                    "uses_it": bool(layers) and all(m.group is model_group for m in layers)
                    and feature._group is model_group}
        engine.destroy()
    return out


def policy_job(rank: int, world: int, steps: int = 4) -> dict[str, Any]:
    """GPT-J (whose Hugging Face plan also cuts and gathers its LM head) at TP=2 split by
    ``tensor_parallel.injection_policy_tuple``: out_proj and fc_out row-parallel, the blocks' other linears
    column-parallel, the rest (the LM head) whole. The losses, the unsplit reference's (rank 0), each block-0 and
    head parameter's bytes held and whole."""
    from dsrun.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    policy = ["attn.out_proj", "mlp.fc_out"]
    engine, loader = _engine("gptj", 2, world, tensor_parallel={"autotp_size": 2, "injection_policy_tuple": policy})
    losses = _train(engine, _batches(loader, steps))
    block = engine.module.transformer.h[0]
    kinds = {name: ("row" if isinstance(m, RowParallelLinear) else "column" if isinstance(m, ColumnParallelLinear)
                    else "whole") for name, m in list(block.named_modules()) + [("lm_head", engine.module.lm_head)]
             if name.endswith(("proj", "fc_in", "fc_out", "lm_head"))}
    held = {f"{n}.{p}": t.numel() * t.element_size() for n, m in list(block.named_modules()) +
            [("lm_head", engine.module.lm_head)] if n in kinds for p, t in m.named_parameters(recurse=False)}
    engine.destroy()
    whole_model = causal_lm("gptj")
    whole_block = whole_model.transformer.h[0]
    whole = {f"{n}.{p}": t.numel() * t.element_size() for n, m in list(whole_block.named_modules()) +
             [("lm_head", whole_model.lm_head)] if n in kinds for p, t in m.named_parameters(recurse=False)}
    return {"losses": losses, "kinds": kinds, "held": held, "whole": whole,
            "reference": reference_losses("gptj", 1, steps) if rank == 0 else None}


def checkpoint_job(rank: int, world: int, name: str, save_dir: str) -> dict[str, Any]:
    """TP=2: 4 steps, save, 4 more; a new engine loads the save and runs the same 4. Then an unsplit engine
    (TP=1) loads the weights, and the conversion merges them."""
    from dsrun.checkpoint.tensor_parallel import merge_checkpoint
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine, loader = _engine(name, 2, world)
    batches = _batches(loader, 8)
    _train(engine, batches[:4])
    engine.save_checkpoint(save_dir, tag="step4")
    with torch.no_grad():
        logits = engine.module(input_ids=batches[4]).logits.detach().clone()
    tail = _train(engine, batches[4:])
    engine.destroy()
    again, _ = _engine(name, 2, world)
    again.load_checkpoint(save_dir, tag="step4")
    resumed = _train(again, batches[4:])
    again.destroy()
    whole, _ = _engine(name, 1, world)
    whole.load_checkpoint(save_dir, tag="step4", load_module_only=True)
    with torch.no_grad():
        whole_logits = whole.module(input_ids=batches[4]).logits.detach().clone()
    loaded = {k: v.detach().clone() for k, v in whole.module.state_dict().items()}
    whole_tail = _train(whole, batches[4:5])
    whole.destroy()
    return {"tail": tail, "resumed": resumed, "logits": logits, "whole_logits": whole_logits, "loaded": loaded,
            "merged": merge_checkpoint(save_dir, "step4") if rank == 0 else None, "whole_tail": whole_tail,
            "fp32": get_fp32_state_dict_from_zero_checkpoint(save_dir, "step4") if rank == 0 else None,
            **universal_job(rank, name, save_dir, batches[4:])}


def universal_job(rank: int, name: str, save_dir: str, tail_batches: list[torch.Tensor]) -> dict[str, Any]:
    """Rank 0 converts the TP=2 checkpoint ``step4`` to a universal folder; then both ranks load it at TP=1 x
    DP=2 (``checkpoint.load_universal``) and run the tail's batches, a row each. Returns those losses, and (rank
    0) the universal folder's per-parameter fp32 files and the checkpoint's splits."""
    from dsrun import comm
    from dsrun.checkpoint import UNIVERSAL_CHECKPOINT_INFO, DeepSpeedCheckpoint
    from dsrun.checkpoint.ds_to_universal import ds_to_universal
    from dsrun.checkpoint.safe_load import load_file
    from dsrun.checkpoint.tensor_parallel import splits_of

    files = None
    if rank == 0:
        out = ds_to_universal(f"{save_dir}/step4", f"{save_dir}/step4_universal", verbose=False)
        saved = load_file(f"{save_dir}/step4/mp_rank_00_model_states.pt")
        files = {"fp32": {p.name: load_file(p / "fp32.pt") for p in (out / "zero").iterdir() if p.is_dir()},
                 "splits": splits_of(saved), "uc_info": saved[UNIVERSAL_CHECKPOINT_INFO],
                 "degrees": [(c.pp_degree, c.tp_degree, c.dp_degree)
                             for c in [DeepSpeedCheckpoint(f"{save_dir}/step4")]]}
    comm.barrier()
    return {"universal": files, "universal_tp1": universal_tail(name, 1, 2, save_dir, tail_batches)}


def universal_tail(name: str, tp: int, world: int, save_dir: str, tail_batches: list[torch.Tensor]) -> list[float]:
    """An engine at TP=``tp`` on ``world`` ranks loads the universal checkpoint under ``save_dir`` and trains on
    ``tail_batches``, each data-parallel rank on its row (the global batch stays the 2 rows the save trained on)."""
    engine, _ = _engine(name, tp, world, train_batch_size=2, train_micro_batch_size_per_gpu=1,
                        checkpoint={"load_universal": True})
    engine.load_checkpoint(save_dir)
    dp = engine.groups.coord("data")
    losses = _train(engine, [ids[dp:dp + 1] for ids in tail_batches])
    engine.destroy()
    return losses


def tp2_tail_batches(name: str) -> list[torch.Tensor]:
    """The batches :func:`checkpoint_job`'s TP=2 run trains after its save (its loader's 5th to 8th)."""
    from dsrun.engine.dataloader import DeepSpeedDataLoader

    return _batches(DeepSpeedDataLoader(Tokens(), 2, data_parallel_world_size=1, data_parallel_rank=0), 8)[4:]


def four_rank_job(rank: int, world: int, names: list[str], tp: int, steps: int, save_dir: str) -> dict[str, Any]:
    """:func:`train_job`'s results, the universal checkpoint of :func:`universal_job` loaded at TP=2 x DP=2 and
    trained on the TP=2 run's tail (``"universal_tp2"``), and :func:`zero3_job` at TP=2 x DP=2 (``"zero3"``)."""
    return {**train_job(rank, world, names, tp, steps),
            "universal_tp2": universal_tail("gpt2", 2, world, save_dir, tp2_tail_batches("gpt2")),
            "zero3": zero3_job(rank, world, steps, f"{save_dir}/zero3")}


def zero3_universal_tp1(rank: int, world: int, steps: int, save_dir: str) -> list[float]:
    """The TP=2 x DP=2 ZeRO-3 save converted to a universal folder (rank 0), loaded at TP=1 x DP=``world`` (ZeRO-3)
    and trained on the save's last 2 global batches, each data rank on one row of them: this rank's losses."""
    from dsrun import comm
    from dsrun.checkpoint.ds_to_universal import ds_to_universal
    from dsrun.engine.dataloader import DeepSpeedDataLoader

    if rank == 0:
        ds_to_universal(f"{save_dir}/zero3", f"{save_dir}/zero3_universal", verbose=False)
    comm.barrier()
    dp = world // 2  # the saved run's data ranks, each with 2 rows a step
    rows = [torch.cat(step) for step in zip(*[_batches(DeepSpeedDataLoader(
        Tokens(), 2, data_parallel_world_size=dp, data_parallel_rank=r), steps)[-2:] for r in range(dp)])]
    engine, _ = _engine("llama", 1, world, zero_optimization={"stage": 3}, train_batch_size=world,
                        train_micro_batch_size_per_gpu=1, checkpoint={"load_universal": True})
    engine.load_checkpoint(save_dir)
    losses = _train(engine, [ids[rank:rank + 1] for ids in rows])
    engine.destroy()
    return losses


def zero3_job(rank: int, world: int, steps: int, save_dir: str) -> dict[str, Any]:
    """Llama at TP=2 with ZeRO-3 over the data ranks: ``steps`` losses and the first step's global norm, the bytes
    of each parameter's ZeRO-3 shard this rank holds (of its tensor-parallel slice), the losses of the last 2 steps
    again after a save at ``steps - 2`` is loaded into a new engine, and (rank 0) the unsplit reference's losses and
    first norm."""
    engine, loader = _engine("llama", 2, world, zero_optimization={"stage": 3})
    batches = _batches(loader, steps)
    losses = _train(engine, batches[:1])
    norm = engine.get_global_grad_norm()
    losses += _train(engine, batches[1:-2])
    engine.save_checkpoint(save_dir, tag="zero3")
    losses += _train(engine, batches[-2:])
    shards = {n: p.ds_tensor.numel() * p.ds_tensor.element_size() for n, p in engine.module.named_parameters()}
    engine.destroy()
    again, _ = _engine("llama", 2, world, zero_optimization={"stage": 3})
    again.load_checkpoint(save_dir, tag="zero3")
    resumed = _train(again, batches[-2:])
    again.destroy()
    out = {"losses": losses, "norm": norm, "shards": shards, "resumed": resumed, "reference": None,
           "universal_tp1": zero3_universal_tp1(rank, world, steps, save_dir)}
    if rank == 0:
        out["reference"] = reference_losses("llama", world // 2, steps)
        model = causal_lm("llama")  # the unsplit model's first norm, on the global batch of the data ranks
        from dsrun.engine.dataloader import DeepSpeedDataLoader

        ids = torch.cat([next(iter(DeepSpeedDataLoader(Tokens(), 2, data_parallel_world_size=world // 2,
                                                       data_parallel_rank=r))) for r in range(world // 2)])
        model(input_ids=ids, labels=ids).loss.backward()
        out["reference_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    return out
