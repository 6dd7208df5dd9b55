"""Activation checkpointing modes of dsrun's GPT, measured: memory, recompute FLOPs, step time.

For each ``model.activation_checkpointing`` mode (none, full, every_2, selective) on one GPT shape:

* ``saved_mib``: bytes autograd holds between forward and backward (saved-tensor hooks, distinct
  non-parameter storages; exact, device-independent);
* ``peak_mib`` (CUDA only): ``torch.cuda.max_memory_allocated`` during forward + backward above the memory
  held before the forward (parameters and gradients), against ``estimate_mib``, dsrun's estimate of the
  same (``dsrun.estimate.activations.gpt_activation_bytes(...).total``);
* ``recompute``: the extra FLOPs of backward over ``none`` (torch's ``FlopCounterMode``), as a fraction
  of full checkpointing's extra;
* ``step_ms``: median forward + backward time of ``--repeats`` steps, and its ratio to ``none`` measured in
  the same run.

Also checks that every mode's gradients equal ``none``'s bitwise (dropout on), and with
``--cpu-checkpointing`` on CUDA that the kept inputs are in host memory.

    python benchmarks/activation_checkpointing.py --device cuda --n-layer 12 --n-embd 768 --n-head 12 \\
        --seq 4096 --batch 4 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsrun.activation_checkpointing.settings import STATE  # noqa: E402
from dsrun.estimate.activations import gpt_activation_bytes  # noqa: E402
from dsrun.estimate.inputs import GPTShape  # noqa: E402
from dsrun.models import GPT  # noqa: E402
from dsrun.profiling.tensor_memory import SavedTensorBytes  # noqa: E402

MODES = ("none", "full", "every_2", "selective")
MIB = 2**20
_CPU_ATTENTION = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attention(query, key, *args, matmuls: int = 2, **kwargs) -> int:
    batch, heads, seq_q, head = query
    return 2 * matmuls * batch * heads * seq_q * key[-2] * head


# torch's counter has no formula for the CPU attention kernel; give it the one it uses for the CUDA ones
CPU_ATTENTION = {} if _CPU_ATTENTION is None else {
    _CPU_ATTENTION: _attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, query, key, *a, **k: _attention(query, key, matmuls=5)}


def build(args: argparse.Namespace, mode: str, device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
               n_embd=args.n_embd, dropout=args.dropout, activation_checkpointing=mode).to(device)


def step(model: GPT, idx: torch.Tensor) -> None:
    model(idx, idx).backward()


def saved_storages(model: GPT, idx: torch.Tensor) -> tuple[int, dict[str, int]]:
    with SavedTensorBytes(exclude=model.parameters()) as saved:
        loss = model(idx, idx)
    loss.backward()
    return saved.bytes, saved.bytes_by_device


def measure(args: argparse.Namespace, mode: str, device: torch.device) -> dict:
    model = build(args, mode, device)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(2)
    step(model, idx)  # gradients allocated, kernels warm
    grads = [p.grad.detach().cpu().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=False)
    saved, by_device = saved_storages(model, idx)
    out = {"mode": mode, "saved_mib": saved / MIB, "saved_by_device_mib": {k: v / MIB for k, v in by_device.items()},
           "grads": grads}
    model.zero_grad(set_to_none=False)
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        step(model, idx)
    out["flops"] = counter.get_total_flops()
    if device.type == "cuda":
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(model, idx)
        torch.cuda.synchronize()
        out["peak_mib"] = (torch.cuda.max_memory_allocated() - before) / MIB
    shape = GPTShape(args.n_layer, args.n_embd, args.n_head, args.vocab, dropout=args.dropout > 0)
    out["estimate_mib"] = gpt_activation_bytes(shape, args.batch, args.seq, "fp32", mode).total / MIB
    times = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(model, idx)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    out["step_ms"] = statistics.median(times)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-checkpointing", action="store_true", help="configure(checkpoint_in_cpu=True)")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels and the math attention (CUDA's fused attention backward and "
                             "embedding backward accumulate with atomics, so not even two runs without "
                             "checkpointing agree bitwise there)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.cpu_checkpointing:  # configure(None, checkpoint_in_cpu=True), without configure's config checks
        STATE.settings = replace(STATE.settings, cpu_checkpointing=True)
    results = [measure(args, mode, device) for mode in MODES]
    none = results[0]
    reference = none["grads"]
    # the control: a second run without checkpointing (does this device reproduce its own gradients?)
    again = measure(args, "none", device)["grads"]
    reproducible = all(torch.equal(a, b) for a, b in zip(again, reference))
    extra_full = results[1]["flops"] - none["flops"]
    rows = []
    for r in results:
        grads = r.pop("grads")
        r.update(grads_equal_none=all(torch.equal(a, b) for a, b in zip(grads, reference)),
                 recompute=(r["flops"] - none["flops"]) / extra_full, step_ratio=r["step_ms"] / none["step_ms"])
        rows.append(r)
    load = os.getloadavg()[0]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device_name}, load {load:.1f}; {args.n_layer} layers x {args.n_embd}, {args.n_head} heads, "
          f"batch {args.batch} x {args.seq}, fp32, dropout {args.dropout}; deterministic {args.deterministic}; "
          f"none's gradients reproducible: {reproducible}")
    for r in rows:
        peak = f" peak {r['peak_mib']:.1f} MiB (estimate {r['estimate_mib']:.1f})" if "peak_mib" in r else ""
        print(f"{r['mode']:>9}: saved {r['saved_mib']:8.1f} MiB {r['saved_by_device_mib']}{peak}; recompute "
              f"{r['recompute']:.3f} of full's; step {r['step_ms']:.1f} ms ({r['step_ratio']:.2f}x none); "
              f"grads equal none: {r['grads_equal_none']}")
    if args.json:
        args.json.write_text(json.dumps({"device": device_name, "load": load, "args": vars(args) | {"json": None},
                                         "none_reproducible": reproducible, "results": rows},
                                        indent=2, default=str) + "\n")
    return 0 if all(r["grads_equal_none"] for r in rows) or not reproducible else 1


if __name__ == "__main__":
    sys.exit(main())
