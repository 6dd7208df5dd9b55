"""DeepSpeedTransformerLayer's memory flags: saved activations and step time of one layer, per flag.

    PYTHONPATH=. python benchmarks/transformer_kernel.py [--device cpu|cuda] [--batch 8] [--seq 512]
                                                        [--hidden 1024] [--heads 16] [--repeats 3]

The default shape is one BERT-large layer (hidden 1024, 16 heads, intermediate 4096) at sequence 512, in
training mode with DeepSpeed's dropout (0.1 on attention probabilities and hidden states), fp32, Pre-LN.
For no flag, each flag alone and all three: the bytes autograd keeps for backward (distinct storages,
parameters excluded, counted with saved-tensor hooks: exact) and the forward + backward time, as the median
of per-round ratios to the no-flag layer (the cases run back to back in each round, after a warm-up round).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsrun.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer  # noqa: E402
from dsrun.profiling.tensor_memory import SavedTensorBytes  # noqa: E402

FLAGS = {"none": {}, "attn_dropout_checkpoint": {"attn_dropout_checkpoint": True},
         "gelu_checkpoint": {"gelu_checkpoint": True}, "normalize_invertible": {"normalize_invertible": True},
         "all three": {"attn_dropout_checkpoint": True, "gelu_checkpoint": True, "normalize_invertible": True}}


def saved_bytes(layer: torch.nn.Module, x: torch.Tensor) -> int:
    with SavedTensorBytes(exclude=layer.parameters()) as saved:
        layer(x)
    return saved.bytes


def step_seconds(layer: torch.nn.Module, x: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    layer(x).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--pre-layer-norm", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {device}, batch {args.batch}, seq {args.seq}, hidden {args.hidden}, heads {args.heads}, "
          f"{'Pre' if args.pre_layer_norm else 'Post'}-LN, fp32, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.1f}")
    x = torch.randn(args.batch, args.seq, args.hidden, device=device, requires_grad=True)
    layers = {}
    for name, flags in FLAGS.items():
        torch.manual_seed(0)
        config = DeepSpeedTransformerConfig(hidden_size=args.hidden, heads=args.heads, attn_dropout_ratio=0.1,
                                            hidden_dropout_ratio=0.1, num_hidden_layers=24, initializer_range=0.02,
                                            pre_layer_norm=bool(args.pre_layer_norm), **flags)
        layers[name] = DeepSpeedTransformerLayer(config).to(device)
    nbytes = {name: saved_bytes(layer, x) for name, layer in layers.items()}
    times: dict[str, list[float]] = {name: [] for name in layers}
    for round_ in range(args.repeats + 1):
        for name, layer in layers.items():
            seconds = step_seconds(layer, x, device)
            if round_:
                times[name].append(seconds)
    base = nbytes["none"]
    print(f"{'flags':>24} {'saved MiB':>10} {'saved vs none':>14} {'time ms':>9} {'time vs none':>13}")
    for name in layers:
        ratio = statistics.median(t / b for t, b in zip(times[name], times["none"]))
        print(f"{name:>24} {nbytes[name] / 2**20:>10.1f} {nbytes[name] / base:>13.1%} "
              f"{statistics.median(times[name]) * 1000:>9.1f} {ratio:>12.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
