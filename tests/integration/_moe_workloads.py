"""MoE workloads for the multi-rank tests (importable by spawned ranks; ``tests.helpers.run_ranks``).

The reference for expert parallelism is the same layer with ``ep_size=1`` holding every expert, run in the
same process on each rank's tokens separately (gating is per rank in DeepSpeed, so "the same global tokens"
means the same shards routed the same way). Experts are initialised from their global id, so the ep=1 and
ep=2 layers hold the same experts.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

D, HIDDEN, EXPERTS, TOKENS = 8, 16, 4, 12


def init_expert(module: nn.Module, global_id: int) -> None:
    gen = torch.Generator().manual_seed(1000 + global_id)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.4)


def make_moe(ep: int, k: int = 1, drop_tokens: bool = True, dropless: bool = False, residual: bool = False,
             min_capacity: int = 1, capacity_factor: float = 1.0) -> nn.Module:
    from dsrun.moe.layer import MoE

    torch.manual_seed(7)  # gate, residual MLP and coefficient: the same on every rank and every ep size
    expert = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))
    layer = MoE(D, expert, num_experts=EXPERTS, ep_size=ep, k=k, capacity_factor=capacity_factor,
                min_capacity=min_capacity, use_residual=residual, drop_tokens=drop_tokens, use_rts=False,
                top2_2nd_expert_sampling=False, dropless=dropless)
    return layer


def init_experts(layer: nn.Module) -> None:
    experts = layer.deepspeed_moe.experts
    experts.reset_parameters(layer.global_expert_ids()[0], init_expert)


def shard_tokens(rank: int, skew: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(TOKENS, D, generator=gen)
    if skew and rank == 0:
        x = x.abs() * 3  # with the skewing gate below, nearly every token of rank 0 wants expert 0
    return x


def cotangent(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(90 + rank))


def skew_gate(layer: nn.Module) -> None:
    with torch.no_grad():
        w = layer.deepspeed_moe.gate.wg.weight
        w.zero_()
        w[0].fill_(1.0)  # positive inputs score expert 0 highest
        w[1:, 0] = torch.tensor([0.3, -0.2, 0.1])


def named_grads(layer: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by global name: local expert j is reported under its global id."""
    out = {}
    ids = layer.global_expert_ids()
    for name, p in layer.named_parameters():
        if p.grad is None:
            continue
        if ".deepspeed_experts." in name:
            head, rest = name.split(".deepspeed_experts.")
            local, tail = rest.split(".", 1)
            name = f"{head}.deepspeed_experts.{ids[int(local)]}.{tail}"
        out[name] = p.grad.detach().clone()
    return out


def layer_case(rank: int, world: int, k: int, drop_tokens: bool, dropless: bool, residual: bool,
               skew: bool = False) -> dict[str, Any]:
    """ep=world layer on this rank's shard vs an ep=1 layer on every shard: outputs, l_aux, gradients of
    the mean of the per-rank losses (dense gradients averaged over ranks, expert gradients divided by the
    data-parallel size: the engine's scaling)."""
    from dsrun import comm

    layer = make_moe(world, k, drop_tokens, dropless, residual)
    if skew:
        skew_gate(layer)
    init_experts(layer)
    before = comm.get_comms_stats().get("all_to_all_single", {"count": 0, "message_bytes": 0})
    x = shard_tokens(rank, skew).requires_grad_()  # as inside a model: the dispatch needs its backward too
    out, l_aux, counts = layer(x)
    loss = (out * cotangent(rank)).sum() + 0.1 * l_aux
    loss.backward()
    after = comm.get_comms_stats().get("all_to_all_single", {"count": 0, "message_bytes": 0})
    for p in layer.parameters():
        if getattr(p, "allreduce", True):
            comm.all_reduce(p.grad)
        p.grad.div_(world)
    grads = named_grads(layer)

    ref = make_moe(1, k, drop_tokens, dropless, residual)
    if skew:
        skew_gate(ref)
    init_experts(ref)
    ref_out, ref_aux = None, None
    total = 0.0
    for r in range(world):
        o, a, _ = ref(shard_tokens(r, skew))
        total = total + ((o * cotangent(r)).sum() + 0.1 * a) / world
        if r == rank:
            ref_out, ref_aux = o.detach(), a.detach()
    total.backward()
    ref_grads = {n: g for n, g in named_grads(ref).items()}
    routing = layer.deepspeed_moe.last_routing
    return {"out": out.detach().numpy(), "ref_out": ref_out.numpy(), "l_aux": float(l_aux.detach()), "ref_l_aux": float(ref_aux),
            "grads": {n: g.numpy() for n, g in grads.items() if n in ref_grads or ".deepspeed_experts." not in n},
            "ref_grads": {n: ref_grads[n].numpy() for n in grads if n in ref_grads},
            "capacity": routing.capacity, "a2a_count": after["count"] - before["count"],
            "a2a_bytes": after["message_bytes"] - before["message_bytes"], "counts": counts.tolist()}


def layer_suite(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for k in (1, 2, 3):
        out[f"k{k}/drop"] = layer_case(rank, world, k, True, False, residual=(k == 2))
        out[f"k{k}/nodrop"] = layer_case(rank, world, k, False, False, residual=False)
        out[f"k{k}/dropless"] = layer_case(rank, world, k, False, True, residual=False)
    out["skew/nodrop"] = layer_case(rank, world, 1, False, False, False, skew=True)
    out["skew/dropless"] = layer_case(rank, world, 1, False, True, False, skew=True)
    return out


# --- the engine -------------------------------------------------------------------------------------------
class MoENet(nn.Module):
    def __init__(self, ep: int, k: int = 2):
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        self.moe = make_moe(ep, k, residual=True)
        init_experts(self.moe)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return F.mse_loss(self.out(h), y) + 0.01 * l_aux


def engine_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + rank)
    return torch.randn(TOKENS, D, generator=gen), torch.randn(TOKENS, D, generator=gen)


def full_named_params(engine: Any, layer_name: str = "moe") -> dict[str, torch.Tensor]:
    """The model's parameters by global name (ZeRO-3: gathered)."""
    import dsrun

    module = engine.module
    moe = getattr(module, layer_name)
    ids = moe.global_expert_ids()
    params = dict(module.named_parameters())
    with dsrun.zero.GatheredParameters(list(params.values())):
        out = {}
        for name, p in params.items():
            if ".deepspeed_experts." in name:
                head, rest = name.split(".deepspeed_experts.")
                local, tail = rest.split(".", 1)
                name = f"{head}.deepspeed_experts.{ids[int(local)]}.{tail}"
            out[name] = p.detach().clone().float()
    return out


def engine_case(rank: int, world: int, stage: int) -> dict[str, Any]:
    """One SGD step (lr 1) of the ep=world engine vs the ep=1 model stepped on the mean of the per-rank
    losses: the new weights differ by the gradients' difference (plus one rounding of w - g)."""
    import dsrun

    net = MoENet(world)
    cfg = {"train_micro_batch_size_per_gpu": TOKENS, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64,
                                 "stage3_param_persistence_threshold": 0},
           "zero_allow_untested_optimizer": True, "steps_per_print": 1000,
           "gradient_clipping": 0.0}  # the reference steps by the raw mean gradient
    engine, _, _, _ = dsrun.initialize(model=net, config=cfg, optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    loss = engine(engine_batch(rank))
    engine.backward(loss)
    engine.step()
    got = full_named_params(engine)
    engine.destroy()

    ref = MoENet(1)
    total = sum(ref(engine_batch(r)) for r in range(world)) / world
    total.backward()
    ref_after = {}
    ids = list(range(EXPERTS))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            ref_after[name] = (p - p.grad).detach().clone()
    del ids
    return {"got": {n: t.numpy() for n, t in got.items()}, "ref": {n: ref_after[n].numpy() for n in got}}


def engine_suite(rank: int, world: int) -> dict[str, Any]:
    return {f"zero{stage}": engine_case(rank, world, stage) for stage in (0, 1, 2, 3)}


def moe_suite(rank: int, world: int) -> dict[str, Any]:
    from dsrun import comm

    torch.set_num_threads(1)
    comm.init_distributed()
    return {"layer": layer_suite(rank, world), "engine": engine_suite(rank, world)}


def fp32_bound(n_terms: int, magnitude: float) -> float:
    """Rounding of a sum of ``n_terms`` fp32 values whose absolute values add to ``magnitude`` (|error| <=
    (n - 1) u sum|x|), doubled for the two different summation orders compared, plus 1e-7 for the final
    rounding of w - g."""
    u = 2.0 ** -24
    return 2 * max(1, n_terms - 1) * u * magnitude + 1e-7


def analytic_a2a_bytes(tokens: int, k: int, ep: int, capacity_factor: float = 1.0, min_capacity: int = 1) -> int:
    """Message bytes of one MoE layer's forward and backward with drop_tokens: four all-to-alls of the
    (E, C, M) fp32 buffer."""
    cap = max(0, min(max(math.ceil(tokens * k * capacity_factor / EXPERTS), min_capacity), tokens))
    return 4 * EXPERTS * cap * D * 4


# --- checkpoints: save with one expert-parallel size, load with another ------------------------------------
def ckpt_engine(world: int, stage: int = 0) -> Any:
    import dsrun

    dsrun.init_distributed()
    cfg = {"train_micro_batch_size_per_gpu": TOKENS, "gradient_accumulation_steps": 2 // world,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage},
           "steps_per_print": 1000}
    engine, _, _, _ = dsrun.initialize(model=MoENet(world), config=cfg)
    return engine


def ckpt_step(engine: Any, rank: int, world: int, step: int) -> float:
    """One optimizer step on the two shards of step ``step`` (2 ranks: one each; 1 rank: both, accumulated);
    returns the mean loss."""
    from dsrun import comm

    total = torch.zeros(1, dtype=torch.float64)
    for shard in range(rank, 2, world):
        x, y = engine_batch(shard)
        loss = engine((x + step, y))
        engine.backward(loss)
        engine.step()
        total += loss.item()
    if world > 1:
        comm.all_reduce(total)
    return float(total) / 2


def expert_state(engine: Any) -> dict[str, Any]:
    """Every expert parameter of this rank by global name: weight and Adam moments, whole (any stage;
    collective within each expert-data group)."""
    from dsrun.checkpoint import experts

    return {name: {key: state[key].float().numpy() for key in ("weight", "exp_avg", "exp_avg_sq")}
            for name, state in experts.expert_states(engine).items()}


def ckpt_save_first(rank: int, world: int, root: str) -> dict[str, Any]:
    """At ZeRO 0, 2 and 3 with ep=2: two steps, save (tags a, z2, z3), a third step; every expert's state
    when saved and the third step's loss."""
    out: dict[str, Any] = {}
    for stage, tag in ((0, "a"), (2, "z2"), (3, "z3")):
        engine = ckpt_engine(world, stage)
        for step in range(2):
            ckpt_step(engine, rank, world, step)
        engine.save_checkpoint(root, tag=tag)
        shared = {n: engine.strategy.full_param_value(p).numpy() for n, p in engine.module.named_parameters()
                  if ".deepspeed_experts." not in n}
        out[tag] = {"experts": expert_state(engine), "shared": shared, "next_loss": ckpt_step(engine, rank, world, 2)}
        engine.destroy()
    return out


def ckpt_load(rank: int, world: int, root: str, loads: list[tuple[str, int, str | None]]) -> dict[str, Any]:
    """For each (tag, stage, save_tag): an ep=world engine at ``stage`` loads ``tag`` (saving it again as
    ``save_tag``), then takes the third step: its experts when loaded, shared weights, loss, step count."""
    out = {}
    for tag, stage, save_tag in loads:
        engine = ckpt_engine(world, stage)
        engine.load_checkpoint(root, tag=tag)
        loaded = expert_state(engine)
        shared = {n: engine.strategy.full_param_value(p).numpy() for n, p in engine.module.named_parameters()
                  if ".deepspeed_experts." not in n}
        if save_tag is not None:
            engine.save_checkpoint(root, tag=save_tag)
        next_loss = ckpt_step(engine, rank, world, 2)
        out[f"{tag}->zero{stage}"] = {"experts": loaded, "shared": shared, "next_loss": next_loss,
                                      "global_steps": engine.global_steps}
        engine.destroy()
    return out


def resume_same_topology(rank: int, world: int, root: str) -> dict[str, float]:
    """At ZeRO 1, 2 and 3: train 2 steps, save, take a third; a fresh engine loads and takes the third step
    again: the same loss, bit for bit (each rank reads its own files back); and ZeRO-2 loaded with the expert
    groups laid out data-first, which goes through the expert files."""
    import dsrun

    dsrun.init_distributed()
    out = {}
    for stage in (1, 2, 3):
        cfg = {"train_micro_batch_size_per_gpu": TOKENS, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
               "steps_per_print": 1000}
        engine, _, _, _ = dsrun.initialize(model=MoENet(world), config=cfg)
        for step in range(2):
            ckpt_step(engine, rank, world, step)
        engine.save_checkpoint(root, tag=f"s{stage}")
        first = ckpt_step(engine, rank, world, 2)
        engine.destroy()
        engine, _, _, _ = dsrun.initialize(model=MoENet(world), config=cfg)
        with _counting_expert_loads() as routed:
            engine.load_checkpoint(root, tag=f"s{stage}")
        out[f"s{stage}"] = (first, ckpt_step(engine, rank, world, 2))
        out[f"s{stage}/routed"] = routed[0]
        engine.destroy()
    # ZeRO-2 loaded with the expert groups laid out data-first: the own-file shortcut would give a rank another
    # rank's experts (with 4+ ranks), so the load goes by global id through the expert files
    engine, _, _, _ = dsrun.initialize(model=MoENet(world), config={**cfg, "zero_optimization": {"stage": 2},
                                                                    "use_data_before_expert_parallelism": True})
    with _counting_expert_loads() as routed:
        engine.load_checkpoint(root, tag="s2")
    out["s2/data_first"] = (out["s2"][0], ckpt_step(engine, rank, world, 2))
    out["s2/data_first/routed"] = routed[0]
    engine.destroy()
    return out


class _counting_expert_loads:
    """Counts the loads that place experts by global id from their files (``experts.optimizer_state``)."""

    def __enter__(self) -> list[int]:
        from dsrun.checkpoint import experts

        self.count, self.original = [0], experts.optimizer_state

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count[0] += 1
            return self.original(*args, **kwargs)

        experts.optimizer_state = counted
        return self.count

    def __exit__(self, *exc: Any) -> None:
        from dsrun.checkpoint import experts

        experts.optimizer_state = self.original


def load_weights_only(rank: int, world: int, root: str) -> dict[str, Any]:
    """At ZeRO 0, 2 and 3: train a step, save; a fresh engine loads with ``load_optimizer_states=False`` and
    another with ``load_module_only=True``: the module holds the saved weights, the fp32 masters equal them
    (every slot of every group, experts included), and the optimizer state is the fresh engine's (empty)."""
    from dsrun.checkpoint import experts

    out: dict[str, Any] = {}
    for stage in (0, 2, 3):
        engine = ckpt_engine(world, stage)
        ckpt_step(engine, rank, world, 0)
        engine.save_checkpoint(root, tag=f"w{stage}")
        saved = full_named_params(engine)
        engine.destroy()
        from dsrun.utils import zero_to_fp32 as z2f  # the whole fp32 state dict, experts by global id

        whole = z2f.get_fp32_state_dict_from_zero_checkpoint(root, f"w{stage}")
        out[f"zero{stage}/zero_to_fp32"] = {"weights": max(float((whole[k] - saved[k]).abs().max()) for k in saved),
                                            "masters": 0.0,
                                            # this rank's experts and the shared weights, plus the other rank's
                                            "same_names": set(saved) <= set(whole) and len(whole) == len(
                                                [k for k in saved if ".deepspeed_experts." not in k]) + 4 * EXPERTS,
                                            "optimizer_state": 0}
        for how in ({"load_optimizer_states": False}, {"load_module_only": True}):
            engine = ckpt_engine(world, stage)
            engine.load_checkpoint(root, tag=f"w{stage}", **how)
            got = full_named_params(engine)
            masters = {}
            for mi in range(len(engine.strategy.masters)):  # every master tensor, whole, by local name
                masters.update(experts.whole_master_state(engine, mi)[0])
            master_diff = 0.0
            for name, p in engine.module.named_parameters():
                value = engine.strategy.full_param_value(p).float().reshape(-1)
                master_diff = max(master_diff, float((masters[name] - value).abs().max()))
            key = f"zero{stage}/{next(iter(how))}"
            out[key] = {"weights": max(float((got[k] - saved[k]).abs().max()) for k in saved),
                        "same_names": set(got) == set(saved), "masters": master_diff,
                        "optimizer_state": sum(len(s) for s in engine.strategy.optimizer.state.values())}
            engine.destroy()
    return out


# --- MoE inside a pipeline: what its checkpoints support -----------------------------------------------------
class PipeMoEBlock(nn.Module):
    """A residual MoE block for a PipelineModule (the aux loss stays out: a pipeline passes activations)."""

    def __init__(self, ep: int):
        super().__init__()
        from dsrun.moe.layer import MoE
        from tests.harness import pipeline as pw

        expert = nn.Sequential(nn.Linear(pw.WIDTH, 2 * pw.WIDTH), nn.Tanh(), nn.Linear(2 * pw.WIDTH, pw.WIDTH))
        self.moe = MoE(pw.WIDTH, expert, num_experts=EXPERTS, ep_size=ep, k=2, min_capacity=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)[0]


def pipe_moe_engine(stages: int, ep: int, zero: int) -> Any:
    import dsrun
    from dsrun.pipe import LayerSpec, PipelineModule
    from tests.harness import pipeline as pw

    specs = [LayerSpec(nn.Embedding, pw.VOCAB, pw.WIDTH), LayerSpec(pw.Block), LayerSpec(PipeMoEBlock, ep),
             LayerSpec(pw.Block), LayerSpec(nn.Linear, pw.WIDTH, pw.VOCAB)]
    net = PipelineModule(specs, num_stages=stages, loss_fn=pw.lm_loss, seed_layers=True, base_seed=pw.BASE_SEED)
    engine, _, _, _ = dsrun.initialize(model=net, config=pw.pipe_config(2, zero), optimizer=pw.torch_adamw)
    return engine


def pipe_moe_state(engine: Any) -> dict[str, Any]:
    """This rank's parameters by name with their Adam moments (ZeRO 1-2: whole, by local name)."""
    from dsrun.checkpoint import experts

    out: dict[str, Any] = {}
    for mi in range(len(engine.strategy.masters)):
        fp32, moments, _ = experts.whole_master_state(engine, mi)
        for name, value in fp32.items():
            out[name] = {"fp32": value.numpy(), **{k: v.numpy() for k, v in moments[name].items()}}
    for name, p in engine.module.named_parameters():
        out[name]["weight"] = p.detach().float().numpy().copy()
    return out


def _refusal(action: Any) -> str | None:
    try:
        action()
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        return f"{type(err).__name__}: {err}"
    return None


def pipe_moe_checkpoints(rank: int, world: int, root: str) -> dict[str, Any]:
    """One stage x 2 data-parallel ranks with ep=2 at ZeRO-1: two steps, save, a third step; a fresh engine
    loads (each rank's experts back, the same third step); a weights-only load and a ZeRO-2 engine are refused,
    and so is saving at ZeRO-0. Two stages with ep=1 (experts on every rank, like dense layers) save and load
    into one stage x 2 ranks with every parameter as saved."""
    from tests.harness import pipeline as pw

    out: dict[str, Any] = {}
    engine = pipe_moe_engine(1, 2, 1)
    pw.train(engine, 2)
    engine.save_checkpoint(root, tag="ep2")
    out["saved"] = pipe_moe_state(engine)
    out["next"] = pw.train(engine, 1, first_step=2)
    engine.destroy()
    engine = pipe_moe_engine(1, 2, 1)
    engine.load_checkpoint(root, tag="ep2")
    out["loaded"] = pipe_moe_state(engine)
    out["loaded_next"] = pw.train(engine, 1, first_step=2)
    out["weights_only"] = _refusal(lambda: engine.load_checkpoint(root, tag="ep2", load_optimizer_states=False))
    engine.destroy()
    engine = pipe_moe_engine(1, 2, 2)
    out["zero2"] = _refusal(lambda: engine.load_checkpoint(root, tag="ep2"))
    engine.destroy()
    engine = pipe_moe_engine(1, 2, 0)
    out["save_zero0"] = _refusal(lambda: engine.save_checkpoint(root, tag="ep2z0"))
    engine.destroy()

    engine = pipe_moe_engine(2, 1, 1)  # dp=1: ep=1, every expert on each stage's one rank
    pw.train(engine, 2)
    engine.save_checkpoint(root, tag="ep1")
    out["ep1_saved"] = pw.named_params(engine)
    engine.destroy()
    engine = pipe_moe_engine(1, 1, 1)
    engine.load_checkpoint(root, tag="ep1")
    out["ep1_loaded"] = pw.named_params(engine)
    engine.destroy()
    return out


# --- MoE with the optimizer (and ZeRO-3's parameters) offloaded to host memory -------------------------------
def offload_engine(world: int, stage: int, offload: bool, offload_param: bool = False) -> Any:
    import dsrun

    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": TOKENS, "gradient_accumulation_steps": 2 // world,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": zero, "steps_per_print": 1000}
    engine, _, _, _ = dsrun.initialize(model=MoENet(world), config=cfg)
    return engine


def offload_moe(rank: int, world: int, root: str) -> dict[str, Any]:
    """ep=2 at ZeRO 1, 2 and 3 with ``offload_optimizer: cpu`` (stage 3 also with ``offload_param: cpu``) and
    the same run in memory: three steps each, then every parameter and expert moment; the offloaded ZeRO-3
    run saves (tag off3) and a fresh in-memory ZeRO-2 engine loads it, an offloaded ZeRO-2 engine loads the
    in-memory ZeRO-3 save (tag mem3)."""
    import dsrun

    dsrun.init_distributed()
    out: dict[str, Any] = {}
    for key, stage, offload, offload_param in (("z1", 1, False, False), ("z1/cpu", 1, True, False),
                                               ("z2", 2, False, False), ("z2/cpu", 2, True, False),
                                               ("z3", 3, False, False), ("z3/cpu", 3, True, False),
                                               ("z3/cpu+param", 3, True, True)):
        engine = offload_engine(world, stage, offload, offload_param)
        losses = [ckpt_step(engine, rank, world, step) for step in range(3)]
        if key in ("z3", "z3/cpu"):
            engine.save_checkpoint(root, tag="off3" if offload else "mem3")
        out[key] = {"losses": losses, "experts": expert_state(engine),
                    "params": {n: engine.strategy.full_param_value(p).numpy()
                               for n, p in engine.module.named_parameters()}}
        engine.destroy()
    for key, stage, offload, tag in (("off3->z2", 2, False, "off3"), ("mem3->z2/cpu", 2, True, "mem3")):
        engine = offload_engine(world, stage, offload)
        engine.load_checkpoint(root, tag=tag)
        out[key] = {"experts": expert_state(engine)}
        engine.destroy()
    return out
