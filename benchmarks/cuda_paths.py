"""The CUDA paths on one GPU: the engine (NCCL, a world of one) against plain PyTorch on the same device.

Every ZeRO stage in fp32, bf16 and fp16, gradient accumulation, clipping, optimizer offload to CPU (pinned
and not), parameter offload, a checkpoint round trip; then step time of dsrun against plain PyTorch with
torch's fused AdamW on a larger GPT. Needs a CUDA device; CI has none, so this is run by hand on a GPU
machine and its output goes into docs/cuda.md.

    python benchmarks/cuda_paths.py [--json out.json] [--perf-layers 12 --perf-width 768]

fp32 parity: TF32 is switched off, so the engine and the reference do the same fp32 arithmetic up to
reduction order; the printed figure is the largest relative loss difference over the steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

VOCAB, SEQ = 128, 32


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, width: int = 64, layers: int = 2, heads: int = 4, vocab: int = VOCAB, seq: int = SEQ) -> None:
        super().__init__()
        self.vocab = vocab
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens[:, :-1]) + self.wpe(torch.arange(tokens.shape[1] - 1, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


LR, WD, STEPS = 3e-3, 0.01, 20


def batch(step: int, size: int, device: torch.device, vocab: int = VOCAB, seq: int = SEQ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (size, seq), generator=gen).to(device)


def model() -> GPT:
    torch.manual_seed(1234)
    return GPT()


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in {id(p): p for p in m.parameters()}.values()])


def reference(size: int, clip: float = 0.0, device: str = "cuda") -> tuple[list[float], torch.Tensor]:
    net = model().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        loss = net(batch(step, size, torch.device(device)))
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, flat(net)


def config(stage: int, micro: int = 4, gas: int = 1, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 4000},
           "steps_per_print": 10_000}
    for key, value in extra.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


def engine_run(cfg: dict, ckpt_at: int | None = None) -> tuple[list[float], torch.Tensor, dict]:
    import dsrun

    engine, _, _, _ = dsrun.initialize(model=model(), config=cfg)
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    losses, info = [], {"device": str(engine.device)}
    for step in range(STEPS):
        if ckpt_at is not None and step == ckpt_at:
            with tempfile.TemporaryDirectory() as tmp:
                engine.save_checkpoint(tmp, tag="mid")
                engine2, _, _, _ = dsrun.initialize(model=model(), config=cfg)
                engine2.load_checkpoint(tmp, tag="mid")
                engine.destroy() if hasattr(engine, "destroy") else None
                engine = engine2
        b = batch(step, micro * gas, engine.device)
        total = 0.0
        for m in range(gas):
            loss = engine(b[m * micro:(m + 1) * micro])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / gas)
    params = list(engine.module.parameters())
    with dsrun.zero.GatheredParameters(params):  # ZeRO-3 keeps placeholders outside a gather
        info["param_dtype"], info["param_device"] = str(params[0].dtype), str(params[0].device)
        return losses, flat(engine.module), info


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def parity_cases() -> dict[str, tuple[dict, float, dict]]:
    """name -> (config, clip used by the reference, run options)."""
    cases: dict[str, tuple[dict, float, dict]] = {}
    for stage in (0, 1, 2, 3):
        cases[f"fp32/stage{stage}"] = (config(stage), 0.0, {})
        cases[f"bf16/stage{stage}"] = (config(stage, bf16={"enabled": True}), 0.0, {})
    for stage in (1, 3):
        cases[f"fp16/stage{stage}"] = (config(stage, fp16={"enabled": True, "initial_scale_power": 10}), 0.0, {})
        cases[f"gas2/stage{stage}"] = (config(stage, micro=2, gas=2), 0.0, {})
        cases[f"clip/stage{stage}"] = (config(stage, gradient_clipping=0.05), 0.05, {})
        cases[f"ckpt/stage{stage}"] = (config(stage), 0.0, {"ckpt_at": 10})
    for stage in (2, 3):
        for pin in (True, False):
            cases[f"offload_opt_cpu_pin{int(pin)}/stage{stage}"] = (
                config(stage, zero_optimization={"offload_optimizer": {"device": "cpu", "pin_memory": pin}}), 0.0, {})
    cases["offload_param_cpu/stage3"] = (
        config(3, zero_optimization={"offload_optimizer": {"device": "cpu", "pin_memory": True},
                                     "offload_param": {"device": "cpu", "pin_memory": True}}), 0.0, {})
    nvme = tempfile.mkdtemp(prefix="dsrun-cuda-nvme-")
    cases["offload_nvme/stage3"] = (
        config(3, zero_optimization={"offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True},
                                     "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True}}),
        0.0, {})
    return cases


def parity_row(name: str, case: tuple[dict, float, dict], refs: dict[float, tuple[list[float], torch.Tensor]],
               device: str = "cuda") -> dict:
    """One case against the plain PyTorch loop (computed once per clip value, kept in ``refs``); an exception
    becomes the row's ``error`` and ``traceback``: one failure must not hide the other cases."""
    cfg, clip, opts = case
    row: dict = {"case": name}
    try:
        if clip not in refs:
            refs[clip] = reference(4, clip, device)
        ref_losses, ref_params = refs[clip]
        t0 = time.perf_counter()
        losses, params, info = engine_run(cfg, **opts)
        row.update(info, seconds=round(time.perf_counter() - t0, 2),
                   max_rel_loss=max(rel(a, b) for a, b in zip(losses, ref_losses)),
                   max_rel_param=float((params - ref_params).abs().max() / ref_params.abs().max()),
                   first_loss=losses[0], last_loss=losses[-1], ref_last_loss=ref_losses[-1])
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc(limit=6)
    return row


def run_parity() -> list[dict]:
    rows = []
    refs: dict[float, tuple[list[float], torch.Tensor]] = {}
    for name, case in parity_cases().items():
        row = parity_row(name, case, refs)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        if "traceback" in row:
            print(row["traceback"], flush=True)
        rows.append(row)
    return rows


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, steps: int, warmup: int, device: torch.device = torch.device("cuda")) -> float:
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def perf_model(layers: int, width: int, seq: int, vocab: int = 50304) -> GPT:
    """The step-time GPT: ``layers`` blocks ``width`` wide, heads of 64, a ``seq``-token context."""
    return GPT(width=width, layers=layers, heads=max(1, width // 64), vocab=vocab, seq=seq + 1)


def torch_step(net: nn.Module, data: list[torch.Tensor], device: torch.device):
    """Plain PyTorch's step over ``data`` in turn: bf16 autocast, ``AdamW(fused=True)`` (fused on CUDA only)."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=device.type == "cuda")
    it = iter(range(10 ** 9))

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = net(data[next(it) % len(data)])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def perf_config(stage: int, micro: int, **extra) -> dict:
    """The step-time runs' DeepSpeed config: bf16, AdamW, ZeRO ``stage``; ``extra`` top-level sections."""
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage},
            "steps_per_print": 10_000, **extra}


def engine_step(engine, data: list[torch.Tensor]):
    """One engine step (forward, backward, step) over ``data`` in turn."""
    it = iter(range(10 ** 9))

    def step() -> None:
        loss = engine(data[next(it) % len(data)])
        engine.backward(loss)
        engine.step()

    return step


def run_perf(layers: int, width: int, micro: int, seq: int, steps: int) -> dict:
    """Median step time: dsrun (bf16, stages 0-3) vs plain PyTorch (bf16 autocast, fused AdamW)."""
    import dsrun

    vocab = 50304
    make = lambda: perf_model(layers, width, seq, vocab)  # noqa: E731
    device = torch.device("cuda")
    data = [batch(i, micro, device, vocab, seq + 1) for i in range(4)]
    out: dict = {"layers": layers, "width": width, "micro": micro, "seq": seq,
                 "params": sum(p.numel() for p in {id(p): p for p in make().parameters()}.values())}

    torch.manual_seed(0)
    net = make().cuda()
    out["torch_fused_adamw_autocast_s"] = timed_steps(torch_step(net, data, device), steps, 3)
    del net
    torch.cuda.empty_cache()
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        try:
            engine, _, _, _ = dsrun.initialize(model=make(), config=perf_config(stage, micro))
            out[f"dsrun_stage{stage}_s"] = timed_steps(engine_step(engine, data), steps, 3)
            out[f"dsrun_stage{stage}_ratio"] = out[f"dsrun_stage{stage}_s"] / out["torch_fused_adamw_autocast_s"]
            out[f"dsrun_stage{stage}_peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
            if hasattr(engine, "destroy"):
                engine.destroy()
            del engine
        except Exception as exc:
            out[f"dsrun_stage{stage}_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(limit=6)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--perf-layers", type=int, default=12)
    parser.add_argument("--perf-width", type=int, default=768)
    parser.add_argument("--perf-micro", type=int, default=8)
    parser.add_argument("--perf-seq", type=int, default=1024)
    parser.add_argument("--perf-steps", type=int, default=20)
    parser.add_argument("--skip-perf", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device; run this on a GPU machine")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import dsrun

    dsrun.init_distributed(verbose=False)
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
                      "backend": torch.distributed.get_backend()}), flush=True)
    result = {"parity": run_parity()}
    if not args.skip_perf:
        torch.backends.cuda.matmul.allow_tf32 = True
        result["perf"] = run_perf(args.perf_layers, args.perf_width, args.perf_micro, args.perf_seq, args.perf_steps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
