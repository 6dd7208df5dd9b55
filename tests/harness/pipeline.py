"""The pipeline engine's runs (tests/integration/test_pipe*.py, MoE in a pipeline): the layer-spec models by name
(``PIPE_MODELS``; ``moe/ep<E>``: an MoE block of expert-parallel size ``E`` among dense ones), their
micro-batches, the single-process reference, the config and engine, and the runs as records (``PipeCase``), one
launch per world size running every case of that size (``pipe_suite``).

The reference for every pipeline run is the same layers run one after the other in one process, on the same
micro-batches: every data-parallel replica's micro-batch losses, divided by micro-batches x replicas, are
backpropagated into one set of gradients, and torch's AdamW steps (``LR``, ``WEIGHT_DECAY`` of
tests/harness/runs.py). Layers are built with ``seed_layers`` (layer ``i`` from seed ``1234 + i``), so the
pipeline's stages and the reference start from the same weights whatever the partition.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tests.harness.models import MOE_EXPERTS
from tests.harness.runs import LR, WEIGHT_DECAY

VOCAB, WIDTH, SEQ, MICRO = 32, 16, 6, 2
BASE_SEED = 1234


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


class PipeMoEBlock(nn.Module):
    """A residual MoE block for a PipelineModule (the aux loss stays out: a pipeline passes activations)."""

    def __init__(self, ep: int):
        super().__init__()
        from dsrun.moe.layer import MoE

        expert = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
        self.moe = MoE(WIDTH, expert, num_experts=MOE_EXPERTS, ep_size=ep, k=2, min_capacity=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)[0]


def moe_specs(ep: int) -> list[Any]:
    """An embedding, a block, an MoE block with expert-parallel size ``ep``, a block and an output head."""
    from dsrun.pipe import LayerSpec

    return [LayerSpec(nn.Embedding, VOCAB, WIDTH), LayerSpec(Block), LayerSpec(PipeMoEBlock, ep), LayerSpec(Block),
            LayerSpec(nn.Linear, WIDTH, VOCAB)]


PIPE_MODELS: dict[str, Callable[[], list[Any]]] = {"lm": lm_specs, "masked": masked_specs, "tokens": token_specs,
                                                   **{f"moe/ep{ep}": functools.partial(moe_specs, ep) for ep in (1, 2)}}


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
    layers, named = build_reference(PIPE_MODELS[model]())
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
    net = PipelineModule(PIPE_MODELS[model](), num_stages=stages, topology=topology, loss_fn=lm_loss, seed_layers=True,
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


@dataclass(frozen=True)
class PipeCase:
    """One pipeline run: ``model`` (a name of ``PIPE_MODELS``) cut into ``stages`` (x ``model_parallel``, the
    rest data-parallel), ``micro_batches`` per step, trained ``steps`` steps at ``zero_stage`` on each world
    size of ``worlds``; ``varying_seq``: each micro-batch's sequence length varies (``varying_seq``);
    ``config``: more top-level sections (``pipeline``, ``checkpoint``)."""

    key: str
    model: str
    stages: int
    micro_batches: int
    steps: int
    worlds: tuple[int, ...] = (2,)
    zero_stage: int = 1
    model_parallel: int = 1
    varying_seq: bool = False
    config: dict = field(default_factory=dict)


def pipe_run(case: PipeCase) -> dict[str, Any]:
    """Train the case on this rank: the losses, this stage's parameters, the last batch's timing, the
    counters, the stage and its cut, and the bytes this rank sent in the last step."""
    engine = build_engine(case.model, case.stages, case.micro_batches, case.zero_stage,
                          model_parallel=case.model_parallel, **case.config)
    losses = train(engine, case.steps, seq_of=varying_seq if case.varying_seq else None)
    sent = engine.comm_stats_last_step().get("send", {})
    out = {"losses": losses, "params": named_params(engine), "timing": engine.last_batch_timing,
           "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
           "global_samples": engine.global_samples, "stage": engine.stage_id, "parts": list(engine.module.parts),
           "sent_bytes": sent.get("message_bytes", 0)}
    engine.destroy()
    return out


def pipe_suite(rank: int, world: int, cases: Sequence[PipeCase]) -> dict[str, dict[str, Any]]:
    """Rank entry point: every case of this world size, one after another, in one process."""
    return {case.key: pipe_run(case) for case in cases if world in case.worlds}
