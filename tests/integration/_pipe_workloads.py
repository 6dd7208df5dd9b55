"""Models, data and per-rank runs for the pipeline engine's multi-process tests (tests/integration/test_pipe.py).

The reference for every pipeline run is the same layers run one after the other in one process, on the same
micro-batches: every data-parallel replica's micro-batch losses, divided by micro-batches x replicas, are
backpropagated into one set of gradients, and torch's AdamW steps. Layers are built with ``seed_layers``
(layer ``i`` from seed ``1234 + i``), so the pipeline's stages and the reference start from the same weights
whatever the partition.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQ, MICRO = 32, 16, 6, 2
LR, WEIGHT_DECAY, BASE_SEED = 3e-3, 0.01, 1234


class Block(nn.Module):
    """A residual MLP block on a hidden state ``[B, T, W]``."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(self.ln(x))))


def tied_head(embed: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, embed.weight)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def lm_specs(blocks: int = 4) -> list[Any]:
    """A language model whose output head is its input embedding, tied across the first and last stage."""
    from dsrun.pipe import LayerSpec, TiedLayerSpec

    return ([TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH)] + [LayerSpec(Block) for _ in range(blocks)]
            + [LayerSpec(nn.LayerNorm, WIDTH), TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=tied_head)])


# --- regression models: what travels between stages -----------------------------------------------------------
class EmbedWithMask(nn.Module):
    """tokens -> (hidden, mask): the mask is a float tensor that needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed(tokens), (tokens % 3 == 0).float().unsqueeze(-1)


class MaskedBlock(Block):
    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask = inputs
        return super().forward(x) * (1.0 + 0.5 * mask), mask


class MaskedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, VOCAB)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, mask = inputs
        return self.proj(x) + mask


def masked_specs() -> list[Any]:
    from dsrun.pipe import LayerSpec

    return [LayerSpec(EmbedWithMask), LayerSpec(MaskedBlock), LayerSpec(MaskedBlock), LayerSpec(MaskedBlock),
            LayerSpec(MaskedHead)]


class EmbedKeepTokens(nn.Module):
    """tokens -> (hidden, tokens): the int64 token ids travel with the hidden state through every stage."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed(tokens), tokens


class TokenBlock(Block):
    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, tokens = inputs
        assert tokens.dtype == torch.int64
        return super().forward(x) + (tokens % 5).unsqueeze(-1).to(x.dtype) * 0.01, tokens


class TokenHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, VOCAB)
        self.bias = nn.Embedding(VOCAB, VOCAB)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, tokens = inputs
        return self.proj(x) + self.bias(tokens)


def token_specs() -> list[Any]:
    from dsrun.pipe import LayerSpec

    return [LayerSpec(EmbedKeepTokens)] + [LayerSpec(TokenBlock) for _ in range(4)] + [LayerSpec(TokenHead)]


MODELS: dict[str, Callable[[], list[Any]]] = {"lm": lm_specs, "masked": masked_specs, "tokens": token_specs}


# --- data ---------------------------------------------------------------------------------------------------
def micro_batch(step: int, index: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch ``index`` of optimizer step ``step``: tokens and the next token as labels."""
    gen = torch.Generator().manual_seed(100_000 + 1000 * step + index)
    tokens = torch.randint(0, VOCAB, (MICRO, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def varying_seq(step: int, index: int) -> int:
    return 3 + (step + 2 * index) % 5


def replica_batches(step: int, micro_batches: int, replica: int, seq_of: Callable[[int, int], int] | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Data-parallel replica ``replica``'s micro-batches of step ``step`` (global index = replica * m + j)."""
    out = []
    for j in range(micro_batches):
        index = replica * micro_batches + j
        out.append(micro_batch(step, index, seq_of(step, index) if seq_of else SEQ))
    return out


# --- the reference ------------------------------------------------------------------------------------------
def build_reference(specs: list[Any]) -> tuple[list[Callable], dict[str, torch.Tensor]]:
    """The layers in one process (tied ones shared), and their parameters by the PipelineModule's names."""
    from dsrun.pipe import TiedLayerSpec
    from dsrun.pipe.module import set_random_seed

    layers, tied, named = [], {}, {}
    for i, spec in enumerate(specs):
        set_random_seed(BASE_SEED + i)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
                named.update({f"tied_modules.{spec.key}.{n}": p for n, p in tied[spec.key].named_parameters()})
            module, fn = tied[spec.key], spec.forward_fn
            layers.append((lambda m, f: (lambda x: f(m, x)))(module, fn) if fn else module)
        else:
            module = spec.build()
            named.update({f"{i}.{n}": p for n, p in module.named_parameters()})
            layers.append(module)
    return layers, named


def run_layers(layers: list[Callable], x: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x


def reference_run(model: str, steps: int, micro_batches: int, replicas: int, seq_of: Any = None) -> dict[str, Any]:
    """Per-step mean loss, per-step micro-batch losses, and the final parameters by name."""
    layers, named = build_reference(MODELS[model]())
    opt = torch.optim.AdamW(list(named.values()), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, per_micro = [], []
    for step in range(steps):
        opt.zero_grad()
        step_losses = []
        for d in range(replicas):
            for inputs, labels in replica_batches(step, micro_batches, d, seq_of):
                loss = lm_loss(run_layers(layers, inputs), labels)
                (loss / (micro_batches * replicas)).backward()
                step_losses.append(loss.item())
        opt.step()
        losses.append(sum(step_losses) / len(step_losses))
        per_micro.append(step_losses)
    return {"losses": losses, "per_micro": per_micro, "params": {k: v.detach().clone() for k, v in named.items()}}


# --- pipeline runs (inside rank processes) -----------------------------------------------------------------------
def pipe_config(micro_batches: int, zero_stage: int = 1, **extra: Any) -> dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": micro_batches,
           "steps_per_print": 10_000, "zero_optimization": {"stage": zero_stage},
           "gradient_clipping": 0.0}  # the references are torch's unclipped AdamW
    cfg.update(extra)
    return cfg


def torch_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def build_engine(model: str, stages: int, micro_batches: int, zero_stage: int = 1, partition: str = "uniform",
                 model_parallel: int = 1, **extra: Any) -> Any:
    import dsrun
    from dsrun import comm
    from dsrun.pipe import PipeModelDataParallelTopology, PipelineModule

    topology = None
    if model_parallel > 1:  # layers replicated over the model axis: each model rank computes the same
        topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=model_parallel,
                                                 num_dp=comm.get_world_size() // (stages * model_parallel))
    net = PipelineModule(MODELS[model](), num_stages=stages, topology=topology, loss_fn=lm_loss, seed_layers=True,
                         base_seed=BASE_SEED, partition_method=partition)
    engine, _, _, _ = dsrun.initialize(model=net, config=pipe_config(micro_batches, zero_stage, **extra),
                                       optimizer=torch_adamw)
    return engine


def named_params(engine: Any) -> dict[str, Any]:
    """This stage's parameters by name, as numpy (tensors cannot outlive a rank process in a queue)."""
    return {n: p.detach().float().numpy().copy() for n, p in engine.module.named_parameters()}


def train(engine: Any, steps: int, first_step: int = 0, seq_of: Any = None) -> list[float]:
    d, m = engine.grid.get_data_parallel_id(), engine.micro_batches
    losses = []
    for step in range(first_step, first_step + steps):
        losses.append(float(engine.train_batch(iter(replica_batches(step, m, d, seq_of)))))
    return losses


def parity_case(model: str, stages: int, micro_batches: int, steps: int, seq_of: Any = None, zero_stage: int = 1,
                **extra: Any) -> dict[str, Any]:
    engine = build_engine(model, stages, micro_batches, zero_stage, **extra)
    losses = train(engine, steps, seq_of=seq_of)
    sent = engine.comm_stats_last_step().get("send", {})
    out = {"losses": losses, "params": named_params(engine), "timing": engine.last_batch_timing,
           "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
           "global_samples": engine.global_samples, "stage": engine.stage_id, "parts": list(engine.module.parts),
           "sent_bytes": sent.get("message_bytes", 0)}
    engine.destroy()
    return out


def eval_case(stages: int, micro_batches: int) -> dict[str, Any]:
    """Per-micro-batch losses of eval_batch at the initial weights (each micro-batch with its own labels)."""
    engine = build_engine("lm", stages, micro_batches)
    d = engine.grid.get_data_parallel_id()
    per_micro = engine.eval_batch(iter(replica_batches(0, micro_batches, d)), reduce_output=None)
    mean = engine.eval_batch(iter(replica_batches(0, micro_batches, d)))
    engine.destroy()
    return {"per_micro": [float(x) for x in per_micro], "mean": float(mean)}


def checkpoint_case(save_dir: str, world: int, micro_batches: int = 4) -> dict[str, Any]:
    """2 stages (x world/2 data) -> save -> 1 stage (x world data) loads and continues -> save -> 2 stages
    load and continue; against the run that never stopped."""
    first, more = 3, 3
    out: dict[str, Any] = {}
    two_stage_gas = micro_batches * 2 // world  # the same micro-batches per step, however they are spread
    one_stage_gas = micro_batches // world
    a = build_engine("lm", 2, two_stage_gas)
    out["a_first"] = train(a, first)
    a.save_checkpoint(save_dir, tag="two_stages")
    out["a_saved"] = named_params(a)
    out["a_files"] = sorted(a.last_checkpoint_files)
    out["a_more"] = train(a, 2 * more, first_step=first)
    a.destroy()

    b = build_engine("lm", 1, one_stage_gas)
    b.load_checkpoint(save_dir, tag="two_stages")
    out["b_loaded"] = named_params(b)
    out["b_steps"] = b.global_steps
    out["b_more"] = train(b, more, first_step=first)
    b.save_checkpoint(save_dir, tag="one_stage")
    out["b_saved"] = named_params(b)
    b.destroy()

    c = build_engine("lm", 2, two_stage_gas)
    c.load_checkpoint(save_dir, tag="one_stage")
    out["c_loaded"] = named_params(c)
    out["c_more"] = train(c, more, first_step=first + more)
    c.destroy()
    return out


PARITY_STEPS = 50


def suite(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """Every pipeline run one launch makes for world size ``world`` (one launch per world size)."""
    out: dict[str, Any] = {}
    if world == 2:
        out["lm/1f1b"] = parity_case("lm", 2, 4, PARITY_STEPS)
        for schedule in ("gpipe", "zero_bubble", "interleaved"):
            virtual = {"virtual_stages": 2} if schedule == "interleaved" else {}
            out[f"lm/{schedule}"] = parity_case("lm", 2, 4, 8, pipeline={"schedule": schedule, **virtual})
        out["masked/zero2"] = parity_case("masked", 2, 4, 6, zero_stage=2)
        out["masked/zero0"] = parity_case("masked", 2, 4, 6, zero_stage=0)
        out["lm/varlen"] = parity_case("lm", 2, 4, 6, seq_of=varying_seq)
        out["eval"] = eval_case(2, 4)
        out["ckpt"] = checkpoint_case(f"{save_dir}/ckpt", world)
    if world == 3:
        out["tokens/3"] = parity_case("tokens", 3, 3, 6)
        out["lm/3"] = parity_case("lm", 3, 6, 6, pipeline={"schedule": "zero_bubble"})
    if world == 4:
        out["lm/2x2"] = parity_case("lm", 2, 4, PARITY_STEPS)
        for on in (True, False):  # a model axis: each model-parallel rank sends half of every message, or all
            out[f"lm/mp/{on}"] = parity_case("lm", 2, 4, 4, model_parallel=2,
                                              pipeline={"pipe_partitioned": on, "grad_partitioned": on})
        out["ckpt"] = checkpoint_case(f"{save_dir}/ckpt", world)
        out["write"] = parallel_write_case(f"{save_dir}/parallel")
    return out


def parallel_write_case(save_dir: str) -> dict[str, Any]:
    """Which files each rank writes, with and without checkpoint.parallel_write.pipeline_stage."""
    out = {}
    for flag in (False, True):
        engine = build_engine("lm", 2, 2, checkpoint={"parallel_write": {"pipeline_stage": flag}})
        engine.save_checkpoint(save_dir, tag=f"parallel_{flag}")
        out[flag] = sorted(f for f in engine.last_checkpoint_files if f.startswith("layer_"))
        engine.destroy()
    return out
