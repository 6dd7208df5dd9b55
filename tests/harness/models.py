"""The models and data every multi-rank test trains, by name: one registry (``MODELS``).

Each model is built with the same seed, so every rank and the single-process reference start equal; the global
batch of optimizer step ``step`` is the same everywhere, and each rank trains its slice of it.

- ``gpt``: a two-layer GPT with tied input/output embeddings (the tie exercises parameter de-duplication);
- ``mlp``: a three-layer tanh MLP;
- ``nanogpt`` (``nanogpt_frozen``: first block and position table frozen): dsrun's own GPT (``GPT_KW``);
- ``frozen_gpt/<mode>``: dsrun's GPT with its token embedding and first block frozen, its blocks checkpointed in
  ``<mode>`` (none, full, every_2, selective; ``reentrant``: full, by DeepSpeed's reentrant checkpoint);
- ``twice_mlp`` (``twice_mlp_frozen``: first layer frozen): an MLP that applies its middle layer twice;
- ``small_mlp``: the 8-16-4 MLP of the gradient-path tests (seed 3);
- ``surface_mlp``: the 6-10-3 MLP of the engine-surface tests (safe_get, deferred reduction; seed 5);
- ``zeropp_mlp`` (``zeropp_mlp_frozen``: first Linear frozen): the 64-256-4 tanh MLP of the ZeRO++ tests (seed 0;
  their batches are per rank: ``rank_batch``).
- ``data_efficiency_gpt``: dsrun's GPT of the data-efficiency resume tests (4 layers, blocks of 16, dropout 0.1;
  their batches come from their own dataset, which the sampler and curriculum read).

- ``readers``: modules that read a child's parameters in their own forward (``nn.MultiheadAttention``, a
  TransformerEncoderLayer, a parent multiplying by its child's weight, a head tied by ``F.linear``; seed 11);
- ``gan``: DeepSpeedExamples' GAN as one module of two nets, ``d`` (discriminator) and ``g`` (generator), each
  trained by an engine of its own (seed 7; a batch is real samples and noise);
- ``moe_net/ep<E>``: a net around one MoE layer (top-2, a residual MLP) with expert-parallel size ``E``, its
  experts drawn from their global ids, so every ``E`` holds the same experts (``MoENet``; each rank's tokens
  are its own shard: ``moe_shard``).

``checkpoint_gpt(dropout, frozen)`` is the checkpoint tests' GPT (their batches come from a resumable stream).

``named`` models are compared through their named (gathered) state, sorted by name (``flat_named``); the others
through ``parameters()`` in order, each shared tensor once (``flat_params``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 64, 8, 32, 2, 2
MLP_IN, MLP_OUT = 16, 4
GPT_KW = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
NANOGPT_SEQ = 16
ZEROPP_IN, ZEROPP_HIDDEN, ZEROPP_OUT = 64, 256, 4


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """The loss is computed in fp32 for 16-bit models, and stays float64 in the float64 reference."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)  # a key bias has an exactly-zero true gradient that Adam would amplify from rounding noise
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A two-layer GPT with tied input/output embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens[:, :-1]) + self.wpe(torch.arange(tokens.shape[1] - 1))
        for block in self.blocks:
            x = block(x)
        logits = at_least_fp32(self.head(self.ln_f(x)))
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(MLP_IN, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, MLP_OUT))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = at_least_fp32(self.net(x.to(self.net[0].weight.dtype)))
        return F.mse_loss(out, y.to(out.dtype))


class TwiceMLP(nn.Module):
    """An MLP whose middle layer is applied twice in one forward, with an optional frozen first layer."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 20)
        self.mid = nn.Linear(20, 20)
        self.out = nn.Linear(20, 3)
        if frozen:
            self.inp.requires_grad_(False)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        h = torch.tanh(self.inp(x.to(self.out.weight.dtype)))
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.mid(h))  # the same module (and parameters) again
        out = at_least_fp32(self.out(h))
        return F.mse_loss(out, y.to(out.dtype))


def nanogpt(frozen: bool = False) -> nn.Module:
    from dsrun.models.gpt import GPT

    model = GPT(**GPT_KW)
    if frozen:  # freeze the first block and the position table
        model.transformer["h"][0].requires_grad_(False)
        model.transformer["wpe"].requires_grad_(False)
    return model


def frozen_gpt(mode: str = "none", reentrant: bool = False) -> nn.Module:
    """dsrun's GPT (``GPT_KW``) with the token embedding (hence the tied head) and the first block frozen, its
    blocks checkpointed in ``mode`` (the model's ``activation_checkpointing``); ``reentrant``: every block
    checkpointed by DeepSpeed's reentrant ``checkpointing.checkpoint``."""
    import dsrun.activation_checkpointing.api as ckpt
    from dsrun.models.gpt import GPT

    model = GPT(**GPT_KW, activation_checkpointing="full" if reentrant else mode)
    model.transformer["wte"].requires_grad_(False)
    model.transformer["h"][0].requires_grad_(False)
    if reentrant:
        model.enable_activation_checkpointing(True, ckpt.checkpoint)
    return model


def checkpoint_gpt(dropout: float = 0.1, frozen: bool = False) -> nn.Module:
    """dsrun's GPT of the checkpoint tests (vocabulary ``VOCAB``, blocks of ``SEQ``), dropout on by default
    (a resumed run must then restore the RNG states too); ``frozen`` freezes the position table."""
    from dsrun.models.gpt import GPT

    torch.manual_seed(1234)
    model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32, dropout=dropout)
    if frozen:
        model.transformer["wpe"].weight.requires_grad_(False)
    return model


def _tokens(gen: torch.Generator, size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, SEQ), generator=gen)


def _mlp_pairs(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, MLP_IN, generator=gen), torch.randn(size, MLP_OUT, generator=gen)


def _nanogpt_pairs(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, GPT_KW["vocab_size"], (size, NANOGPT_SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _twice_pairs(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 12, generator=gen), torch.randn(size, 3, generator=gen)


def _surface_pairs(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 6, generator=gen), torch.randn(size, 3, generator=gen)


def _small_pairs(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 8, generator=gen), torch.randn(size, 4, generator=gen)


def _zeropp_pairs(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, ZEROPP_IN, generator=gen), torch.randn(size, ZEROPP_OUT, generator=gen)


def zeropp_mlp(frozen: bool = False) -> nn.Module:
    model = nn.Sequential(nn.Linear(ZEROPP_IN, ZEROPP_HIDDEN), nn.Tanh(), nn.Linear(ZEROPP_HIDDEN, ZEROPP_OUT))
    if frozen:
        model[0].requires_grad_(False)
    return model


def data_efficiency_gpt() -> nn.Module:
    from dsrun.models.gpt import GPT

    return GPT(vocab_size=VOCAB, block_size=2 * SEQ, n_layer=4, n_head=2, n_embd=WIDTH, dropout=0.1)


def _data_efficiency_pairs(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (size, 2 * SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


# --- models that read a child's parameters in their own forward (ZeRO-3 must gather them) ---------------------
READERS_VOCAB, READERS_WIDTH, READERS_SEQ = 11, 8, 5


class ProjectionHead(nn.Module):
    """A parameterless parent that multiplies by its child's weight instead of calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(READERS_WIDTH, READERS_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj.weight.t() + self.proj.bias


class ChildReaders(nn.Module):
    """``nn.MultiheadAttention`` (reads ``out_proj.weight`` in its own forward), a TransformerEncoderLayer
    (an MHA inside), a parameterless parent reading its child's weight, and a tied output head written as
    ``F.linear(h, self.emb.weight)`` in the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        width = READERS_WIDTH
        self.emb = nn.Embedding(READERS_VOCAB, width)
        # no attention biases: a key bias has an exactly-zero true gradient, which Adam would turn from
        # rounding noise into full-size steps that differ between any two summation orders
        self.mha = nn.MultiheadAttention(width, 2, batch_first=True, bias=False)
        self.enc = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True, bias=False)
        self.head = ProjectionHead()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        y, _ = self.mha(x, x, x, need_weights=False)
        h = self.head(self.enc(x + y))
        logits = F.linear(h, self.emb.weight)
        return F.cross_entropy(logits.reshape(-1, READERS_VOCAB), tokens.reshape(-1))


def _reader_tokens(gen: torch.Generator, size: int) -> torch.Tensor:
    return torch.randint(0, READERS_VOCAB, (size, READERS_SEQ), generator=gen)


# --- DeepSpeedExamples' GAN (training/gan/gan_deepspeed_train.py) ----------------------------------------------
GAN_NOISE, GAN_FEATURES, GAN_HIDDEN = 4, 6, 12


class GAN(nn.Module):
    """The discriminator ``d`` and the generator ``g`` (built in that order from one seed)."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.Sequential(nn.Linear(GAN_FEATURES, GAN_HIDDEN), nn.LeakyReLU(0.2), nn.Linear(GAN_HIDDEN, 1))
        self.g = nn.Sequential(nn.Linear(GAN_NOISE, GAN_HIDDEN), nn.ReLU(), nn.Linear(GAN_HIDDEN, GAN_FEATURES))


def _gan_batch(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Real samples (around 1) and the generator's noise."""
    real = torch.randn(size, GAN_FEATURES, generator=gen) * 0.5 + 1.0
    return real, torch.randn(size, GAN_NOISE, generator=gen)


# --- an MoE layer and a net around it ---------------------------------------------------------------------------
MOE_D, MOE_HIDDEN, MOE_EXPERTS, MOE_TOKENS = 8, 16, 4, 12


def init_expert(module: nn.Module, global_id: int) -> None:
    gen = torch.Generator().manual_seed(1000 + global_id)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.4)


def make_moe(ep: int, k: int = 1, drop_tokens: bool = True, dropless: bool = False, residual: bool = False,
             min_capacity: int = 1, capacity_factor: float = 1.0) -> nn.Module:
    """dsrun's ``MoE`` of ``MOE_EXPERTS`` two-layer experts over ``ep`` ranks (no random token selection, no
    sampled second expert: routing is a function of the tokens)."""
    from dsrun.moe.layer import MoE

    torch.manual_seed(7)  # gate, residual MLP and coefficient: the same on every rank and every ep size
    expert = nn.Sequential(nn.Linear(MOE_D, MOE_HIDDEN), nn.GELU(), nn.Linear(MOE_HIDDEN, MOE_D))
    return MoE(MOE_D, expert, num_experts=MOE_EXPERTS, ep_size=ep, k=k, capacity_factor=capacity_factor,
               min_capacity=min_capacity, use_residual=residual, drop_tokens=drop_tokens, use_rts=False,
               top2_2nd_expert_sampling=False, dropless=dropless)


def init_experts(layer: nn.Module) -> None:
    """Each local expert drawn from its global id (``init_expert``)."""
    layer.deepspeed_moe.experts.reset_parameters(layer.global_expert_ids()[0], init_expert)


def global_expert_name(name: str, ids: list[int]) -> str:
    """A parameter's name with its local expert index replaced by the expert's global id (``ids``: the layer's
    ``global_expert_ids()``)."""
    if ".deepspeed_experts." not in name:
        return name
    head, rest = name.split(".deepspeed_experts.")
    local, tail = rest.split(".", 1)
    return f"{head}.deepspeed_experts.{ids[int(local)]}.{tail}"


class MoENet(nn.Module):
    def __init__(self, ep: int, k: int = 2):
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(MOE_D, MOE_D)
        self.out = nn.Linear(MOE_D, MOE_D)
        self.moe = make_moe(ep, k, residual=True)
        init_experts(self.moe)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return F.mse_loss(self.out(h), y) + 0.01 * l_aux


def _moe_pairs(gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, MOE_D, generator=gen), torch.randn(size, MOE_D, generator=gen)


def moe_shard(shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard ``shard`` of the MoE tests' tokens (``MOE_TOKENS`` of them, seed 300 + ``shard``): gating is per
    rank, so each rank trains on a shard of its own and a reference routes each shard separately."""
    return _moe_pairs(torch.Generator().manual_seed(300 + shard), MOE_TOKENS)


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model, draw its batches (``batch(generator, size)``; step ``k``'s global batch from seed
    ``step_seed + k``) and count its loss terms."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], Any]
    terms_per_sample: int
    named: bool = False
    seed: int = 1234
    step_seed: int = 1000


MODELS: dict[str, ModelSpec] = {
    "gpt": ModelSpec(TinyGPT, _tokens, SEQ - 1),
    "mlp": ModelSpec(MLP, _mlp_pairs, MLP_OUT),
    "nanogpt": ModelSpec(nanogpt, _nanogpt_pairs, NANOGPT_SEQ, named=True),
    "nanogpt_frozen": ModelSpec(lambda: nanogpt(frozen=True), _nanogpt_pairs, NANOGPT_SEQ, named=True),
    **{f"frozen_gpt/{mode}": ModelSpec(functools.partial(frozen_gpt, mode), _nanogpt_pairs, NANOGPT_SEQ, named=True)
       for mode in ("none", "full", "every_2", "selective")},
    "frozen_gpt/reentrant": ModelSpec(functools.partial(frozen_gpt, reentrant=True), _nanogpt_pairs, NANOGPT_SEQ,
                                      named=True),
    "twice_mlp": ModelSpec(TwiceMLP, _twice_pairs, 3, named=True),
    "twice_mlp_frozen": ModelSpec(lambda: TwiceMLP(frozen=True), _twice_pairs, 3, named=True),
    "small_mlp": ModelSpec(lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), _small_pairs, 4,
                           seed=3),
    "surface_mlp": ModelSpec(lambda: nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)), _surface_pairs, 3,
                             seed=5),
    "data_efficiency_gpt": ModelSpec(data_efficiency_gpt, _data_efficiency_pairs, 2 * SEQ, named=True),
    "zeropp_mlp": ModelSpec(zeropp_mlp, _zeropp_pairs, ZEROPP_OUT, seed=0),
    "zeropp_mlp_frozen": ModelSpec(lambda: zeropp_mlp(frozen=True), _zeropp_pairs, ZEROPP_OUT, seed=0),
    "readers": ModelSpec(ChildReaders, _reader_tokens, READERS_SEQ, named=True, seed=11, step_seed=900),
    "gan": ModelSpec(GAN, _gan_batch, 1, seed=7, step_seed=500),
    **{f"moe_net/ep{ep}": ModelSpec(functools.partial(MoENet, ep), _moe_pairs, MOE_D, named=True, seed=3)
       for ep in (1, 2)},
}


def surface_batch(step: int, dtype: torch.dtype = torch.float32, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine-surface tests' global batch of step ``step`` for ``surface_mlp`` (its own seeds, 100 +
    ``step``), in ``dtype``."""
    x, y = MODELS["surface_mlp"].batch(torch.Generator().manual_seed(100 + step), size)
    return x.to(dtype), y.to(dtype)


def as_numpy(t: torch.Tensor) -> Any:
    """A float64 numpy copy (a float64 tensor's ``numpy()`` would share its memory)."""
    return t.detach().double().cpu().numpy().copy()


def build_model(name: str) -> nn.Module:
    spec = MODELS[name]
    torch.manual_seed(spec.seed)
    return spec.build()


def global_batch(name: str, step: int, size: int) -> Any:
    """The global batch of optimizer step ``step`` (the same on every rank and in the reference)."""
    spec = MODELS[name]
    return spec.batch(torch.Generator().manual_seed(spec.step_seed + step), size)


def rank_batch(name: str, step: int, rank: int, size: int) -> Any:
    """A batch of ``size`` samples of its own for each rank at each step (seed ``1000 * step + rank``), for
    the tests whose ranks train on different data rather than slices of one global batch."""
    return MODELS[name].batch(torch.Generator().manual_seed(1000 * step + rank), size)


def loss_terms(name: str, size: int) -> int:
    """How many terms a loss of ``size`` samples averages (tokens predicted, or outputs)."""
    return size * MODELS[name].terms_per_sample


def slice_batch(batch: Any, start: int, end: int) -> Any:
    if isinstance(batch, tuple):
        return tuple(t[start:end] for t in batch)
    return batch[start:end]


def cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, tuple):
        return tuple(cast_floats(t, dtype) for t in batch)
    return batch.to(dtype) if batch.is_floating_point() else batch


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter (each shared tensor once) as one float64 vector, in ``parameters()`` order."""
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p.detach().double().reshape(-1))
    return torch.cat(out)


def flat_named(named: dict[str, torch.Tensor]) -> torch.Tensor:
    """Named tensors as one float64 vector, sorted by name."""
    return torch.cat([v.detach().double().reshape(-1) for _, v in sorted(named.items())])


def flatten(name: str, model: nn.Module) -> Any:
    """A model's parameters the way its tests compare them (``ModelSpec.named``)."""
    if MODELS[name].named:
        return flat_named(dict(model.named_parameters())).numpy()
    return flat_params(model)
