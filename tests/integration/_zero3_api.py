"""Rank entry points for the ZeRO-3 API tests: zero.Init memory, GatheredParameters, external parameters,
16-bit export, and peak RSS of a 100M-parameter GPT (importable by spawned ranks)."""
from __future__ import annotations

import os
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsrun.estimate.measure import reset_peak_rss
from tests.harness.models import build_model, global_batch, slice_batch
from tests.harness.runs import LR, WEIGHT_DECAY
from tests.harness.runs import zero3_config as ds_config


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


class Tower(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def init_memory(rank: int, world: int, layers: int, width: int) -> dict[str, Any]:
    """Build a ``layers`` x ``width``^2 tower under zero.Init; measure the parameter bytes alive at every
    parameter registration (the moments full tensors exist) and the peak RSS growth."""
    import dsrun
    from dsrun import comm

    comm.init_distributed(verbose=False)
    with dsrun.zero.Init():
        Tower(1, 64)  # warm-up: first-use allocations of torch and gloo are not the model's
    tracked: list[weakref.ref] = []

    def live_bytes() -> int:
        total = 0
        for ref in tracked:
            p = ref()
            if p is None:
                continue
            total += p.data.untyped_storage().nbytes()
            if hasattr(p, "ds_tensor"):
                total += p.ds_tensor.untyped_storage().nbytes()
        return total

    peak = {"live": 0}

    def on_register(module: nn.Module, name: str, param: Any) -> None:
        if param is not None:
            tracked.append(weakref.ref(param))
            peak["live"] = max(peak["live"], live_bytes())

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(on_register)
    rss_before = _vm_kib("VmRSS")
    assert reset_peak_rss()  # VmHWM (peak RSS) back to the current RSS
    with dsrun.zero.Init():
        model = Tower(layers, width)
    rss_growth = (_vm_kib("VmHWM") - rss_before) * 1024
    handle.remove()
    after = live_bytes()
    shards = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    full_data = sum(p.data.numel() for p in model.parameters())
    return {"peak_live": peak["live"], "after": after, "shards": shards, "full_data_elems": full_data,
            "rss_growth": rss_growth, "total": layers * width * width * 4, "module": width * width * 4}


class Gatherable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.lin(x.to(self.lin.weight.dtype)))).float().mean()


def gathered_modifier(rank: int, world: int, precision: str) -> dict[str, Any]:
    """Rank 0 changes a weight inside GatheredParameters(modifier_rank=0): every rank sees it afterwards, in
    the gathered value, in the forward, and in the optimizer's fp32 copy (the next step starts from it)."""
    import dsrun
    from dsrun.engine.initialize import initialize

    torch.manual_seed(0)
    cfg = ds_config(3, 2, 1, **({"bf16": {"enabled": True}} if precision == "bf16" else {}))
    cfg["optimizer"]["params"]["lr"] = 0.0
    cfg["optimizer"]["params"]["weight_decay"] = 0.0
    engine, _, _, _ = initialize(model=Gatherable(), config=cfg)
    module = engine.module
    before_empty = module.lin.weight.numel()
    with dsrun.zero.GatheredParameters(module.lin.weight, modifier_rank=0):
        inside_shape = tuple(module.lin.weight.shape)
        if rank == 0:
            with torch.no_grad():
                module.lin.weight.fill_(0.25)
        elif world > 1:
            with torch.no_grad():
                module.lin.weight.fill_(-7.0)  # a non-modifier rank's change is discarded
    after_empty = module.lin.weight.numel()
    value = dsrun.zero.full_state_dict(module)["lin.weight"]
    x = torch.ones(2, 6)
    loss = engine(x)
    engine.backward(loss)
    engine.step()  # lr 0: the fp32 master is written back to the model as is
    after_step = dsrun.zero.full_state_dict(module)["lin.weight"]
    with dsrun.zero.GatheredParameters(list(module.parameters())):  # read-only gather of everything
        reference = Gatherable()
        reference.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
    return {"before_empty": before_empty, "inside_shape": inside_shape, "after_empty": after_empty,
            "value": value.float().numpy(), "after_step": after_step.float().numpy(), "loss": loss.item(),
            "ref_loss": reference(x).item()}


class ParentUsesChildWeight(nn.Module):
    """The parent reads its child's weight in its own forward (an 'external' parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mix = nn.Linear(8, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.mix(self.emb(idx))
        return F.cross_entropy(h @ self.emb.weight.t(), idx.reshape(-1)[: h.shape[0]].clamp(max=9))


def external_parameter(rank: int, world: int, register: bool) -> dict[str, Any]:
    import dsrun
    from dsrun.engine.initialize import initialize

    torch.manual_seed(0)
    model = ParentUsesChildWeight()
    ref_model = ParentUsesChildWeight()
    ref_model.load_state_dict(model.state_dict())
    engine, _, _, _ = initialize(model=model, config=ds_config(3, 2, 1))
    if register:
        dsrun.zero.register_external_parameter(engine.module, engine.module.emb.weight)
    idx = torch.arange(8) % 10
    try:
        losses = _engine_losses(engine, idx)
    except RuntimeError as exc:
        return {"error": str(exc).splitlines()[0]}
    return {"losses": losses, "ref": _reference_losses(ref_model, idx)}


def _engine_losses(engine: Any, idx: torch.Tensor, steps: int = 3) -> list[float]:
    """The engine's losses over ``steps`` steps on the batch ``idx``."""
    losses = []
    for _ in range(steps):
        loss = engine(idx)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _reference_losses(ref_model: nn.Module, idx: torch.Tensor, steps: int = 3) -> list[float]:
    """torch's AdamW on the whole model over the same steps (every rank uses the same batch, so the average
    gradient is this one)."""
    opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    ref = []
    for _ in range(steps):
        loss = ref_model(idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    return ref


class AppliedInit(nn.Module):
    """Initialised by its owner's ``model.apply(fn)`` that writes ``param.data`` (Hugging Face's older
    ``_init_weights`` style): nothing ``torch.nn.init`` could intercept."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.norm(self.emb(idx)))))
        return F.cross_entropy(logits, (idx + 1) % 10)


def custom_init(module: nn.Module, seen: list[int] | None = None) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        if seen is not None:
            seen.append(module.weight.numel())  # what fn sees of the weight: whole, or the empty partitioned data
        module.weight.data.normal_(mean=0.0, std=0.3)
    if isinstance(module, nn.Linear):
        module.bias.data.fill_(0.05)
    if isinstance(module, nn.LayerNorm):
        module.weight.data.fill_(1.5)


def module_apply(rank: int, world: int, override: bool) -> dict[str, Any]:
    """``model.apply(custom_init)`` inside ``zero.Init`` (``zero_optimization.override_module_apply``
    ``override``), then 3 ZeRO-3 steps on the same batch on every rank; beside it the model built whole with the
    same seed (``custom_init`` applied when ``override``, as the partitioned build should then equal it; not
    applied otherwise, as DeepSpeed then loses what ``fn`` writes) and trained with torch's AdamW."""
    import dsrun
    from dsrun.engine.initialize import initialize

    cfg = ds_config(3, 2, 1, zero={"override_module_apply": override})
    seen: list[int] = []
    torch_apply = nn.Module.apply
    torch.manual_seed(0)
    with dsrun.zero.Init(config_dict_or_path=cfg):
        model = AppliedInit()
        model.apply(lambda m: custom_init(m, seen))
        patched = nn.Module.apply is not torch_apply
    torch.manual_seed(0)
    ref_model = AppliedInit()
    if override:
        ref_model.apply(custom_init)
    initial = {k: v.numpy() for k, v in dsrun.zero.full_state_dict(model).items()}
    engine, _, _, _ = initialize(model=model, config=cfg)
    idx = torch.arange(12) % 10
    losses = _engine_losses(engine, idx)
    ref_initial = {k: v.detach().numpy().copy() for k, v in ref_model.state_dict().items()}
    ref = _reference_losses(ref_model, idx)
    return {"seen": seen, "initial": initial, "ref_initial": ref_initial, "losses": losses, "ref": ref,
            "patched": patched, "restored": nn.Module.apply is torch_apply}


def export_16bit(rank: int, world: int, save_dir: str, gather: bool) -> dict[str, Any]:
    import dsrun
    from dsrun.engine.initialize import initialize

    cfg = ds_config(3, 2, 1, bf16={"enabled": True},
                    zero={"stage3_gather_16bit_weights_on_model_save": gather,
                          "stage3_param_persistence_threshold": 100})  # LayerNorms and biases persist
    engine, _, _, _ = initialize(model=build_model("nanogpt"), config=cfg)
    batch = global_batch("nanogpt", 0, 2 * world)
    loss = engine(slice_batch(batch, 2 * rank, 2 * rank + 2))
    engine.backward(loss)
    engine.step()
    placeholder_numels = {k: v.numel() for k, v in engine.module.state_dict().items()}
    saved = engine.save_16bit_model(save_dir, "model.bin")
    full = dsrun.zero.full_state_dict(engine.module)
    with torch.no_grad():
        engine(slice_batch(batch, 2 * rank, 2 * rank + 2))
    kept = sorted(n for n, p in engine.module.named_parameters() if p.numel())
    engine.empty_partition_cache()
    kept_after = sorted(n for n, p in engine.module.named_parameters() if p.numel())
    return {"saved": saved, "placeholders": placeholder_numels, "kept": kept, "kept_after": kept_after,
            "full": {k: v.float().numpy() for k, v in full.items()}}


def peak_rss_100m(rank: int, world: int, load_dir: str | None = None, save_dir: str | None = None,
                  step: bool = True) -> dict[str, Any]:
    """One training step of a ~100M-parameter GPT built under zero.Init; this rank's peak RSS. ``load_dir``:
    then a ZeRO-3 Adam checkpoint is loaded (resharded when saved at another world size): the load's own peak
    (VmHWM reset before it, less the RSS before it), this rank's share of the optimizer state (fp32 master and
    two moments of its own elements) and the bytes it read by range; ``save_dir``: then saved there."""
    import dsrun
    from dsrun import comm
    from dsrun.checkpoint import tensor_file
    from dsrun.models.gpt import GPT
    from dsrun.engine.initialize import initialize
    from dsrun.utils.zero_to_fp32 import master_slots

    comm.init_distributed(verbose=False)
    cfg = ds_config(3, 1, 1, zero={"reduce_bucket_size": 5_000_000, "stage3_prefetch_bucket_size": 5_000_000})
    if save_dir is not None:  # the fast writer: its 1.2 GB files in a few seconds (this disk's page cache is slow)
        cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "writer": {"type": "fast"}}
    torch.manual_seed(0)
    with dsrun.zero.Init(config_dict_or_path=cfg):
        model = GPT(vocab_size=256, block_size=16, n_layer=12, n_head=8, n_embd=832)
    numel = sum(p.ds_numel for p in model.parameters())
    engine, _, _, _ = initialize(model=model, config=cfg)
    out: dict[str, Any] = {"numel": numel}
    if step:
        tokens = torch.randint(0, 256, (1, 17))
        loss = engine((tokens[:, :-1], tokens[:, 1:]))
        engine.backward(loss)
        engine.step()
        out.update(peak_rss=_vm_kib("VmHWM") * 1024, loss=loss.item(), memory=engine.memory_breakdown().as_dict())
    if load_dir is not None:
        strategy = engine.strategy
        shapes = strategy.checkpoint_param_shapes()
        elements = sum(slot.length for mi, (size, place, _) in enumerate(strategy.master_partitions())
                       for group in master_slots(3, size, place, [shapes[mi]])[0] for slot in group)
        stats = tensor_file.reset_read_stats()
        rss_before = _vm_kib("VmRSS")
        assert reset_peak_rss()
        engine.load_checkpoint(load_dir)
        out.update(load_peak=(_vm_kib("VmHWM") - rss_before) * 1024, share=elements * 12, read=stats.range_bytes)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    return out


def zero_inference(rank: int, world: int, variant: str) -> dict[str, Any]:
    """ZeRO-Inference's flow: dsrun's GPT built under zero.Init (``variant``: plain, ``offload_param`` cpu, or
    ``quantized_initialization``), ``initialize`` with no optimizer; its logits through ``engine(...)`` and
    ``engine.module(...)`` and a greedy ``generate`` beside the unpartitioned model holding the same (for quantized
    weights: the dequantized) values, this rank's share of the elements, and what stays gathered after a pass."""
    import dsrun
    from dsrun.models.gpt import GPT
    from dsrun.ops.groupwise_quant import dequantized
    from tests.harness.models import GPT_KW

    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    if variant == "offload":
        zero["offload_param"] = {"device": "cpu"}
    if variant == "quantized":
        cfg["weight_quantization"] = {"quantized_initialization": {"num_bits": 8, "group_size": 16, "group_dim": 1}}
    torch.manual_seed(0)
    with dsrun.zero.Init(config_dict_or_path=cfg):
        model = GPT(**GPT_KW)
    engine, optimizer, _, _ = dsrun.initialize(model=model, config=cfg)
    params = list(engine.module.parameters())
    with dsrun.zero.GatheredParameters(params):
        values = [dequantized(p) if getattr(p, "weight_quantized", False) else p for p in params]
        state = {n: v.detach().clone() for n, v in zip((n for n, _ in engine.module.named_parameters()), values)}
    reference = GPT(**GPT_KW)
    reference.load_state_dict(state, strict=False)  # lm_head is wte's (tied)
    idx = torch.randint(0, GPT_KW["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(idx)
        out = {"optimizer": type(optimizer).__name__, "engine": torch.equal(engine(idx), expected),
               "module": torch.equal(engine.module(idx), expected),
               "generate": torch.equal(engine.module.generate(idx, 4, temperature=0.0),
                                       reference.generate(idx, 4, temperature=0.0))}
    out.update(shard=sum(p.ds_tensor.numel() for p in params if p.ds_tensor.is_floating_point()),
               numel=sum(p.ds_numel for p in params), count=len(params), gathered_after=sum(p.numel() for p in params),
               quantized=sum(bool(getattr(p, "weight_quantized", False)) for p in params))
    engine.destroy()
    return out


def unwrap_training(rank: int, world: int) -> dict[str, Any]:
    """TRL's loop on a ZeRO-3 training engine without offload (at two ranks the coordinator gathers): a step, then
    inside ``unwrap_model_for_generation`` the engine's logits and a greedy generate beside the unpartitioned model,
    then a step; the losses beside a twin engine that never entered the block."""
    import dsrun
    from dsrun.models.gpt import GPT
    from tests.harness.models import GPT_KW

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    idx, targets = torch.randint(0, GPT_KW["vocab_size"], (2, 2, 8), generator=torch.Generator().manual_seed(3))
    engines = []
    for _ in range(2):
        torch.manual_seed(0)
        engines.append(dsrun.initialize(model=GPT(**GPT_KW), config=cfg)[0])
    engine, twin = engines

    def step(e: Any) -> float:
        loss = e(idx, targets)
        e.backward(loss)
        e.step()
        return loss.item()

    losses = [step(engine)]
    reference = GPT(**GPT_KW)
    reference.load_state_dict(dsrun.zero.full_state_dict(engine.module), strict=False)  # lm_head is wte's (tied)
    with torch.no_grad():
        expected, tokens = reference(idx), reference.generate(idx, 4, temperature=0.0)
        with dsrun.zero.unwrap_model_for_generation(engine):
            out: dict[str, Any] = {"logits": torch.equal(engine(idx), expected),
                                   "generate": torch.equal(engine.module.generate(idx, 4, temperature=0.0), tokens)}
    losses.append(step(engine))
    out.update(losses=losses, twin=[step(twin) for _ in range(2)])
    engine.destroy()
    twin.destroy()
    return out


def _env_threads() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def api_suite(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """Every API check that can share one launch."""
    _env_threads()
    return {"gathered/fp32": gathered_modifier(rank, world, "fp32"),
            "gathered/bf16": gathered_modifier(rank, world, "bf16"),
            "external/unregistered": external_parameter(rank, world, register=False),
            "external/registered": external_parameter(rank, world, register=True),
            "apply/on": module_apply(rank, world, override=True),
            "apply/off": module_apply(rank, world, override=False),
            "export/off": export_16bit(rank, world, os.path.join(save_dir, "off"), gather=False),
            "export/on": export_16bit(rank, world, os.path.join(save_dir, "on"), gather=True),
            **{f"inference/{v}": zero_inference(rank, world, v) for v in ("plain", "offload", "quantized")},
            "unwrap/training": unwrap_training(rank, world)}
