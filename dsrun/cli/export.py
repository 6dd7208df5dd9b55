"""Export a trained run as a really smaller model: packed integer weights, their scales, pruned tensors gone.

Examples:
  dsrun export --compressed outputs/2026-11-22/09-37-12 model_int4/   # the run's compression, made real
  dsrun export --w8a8 outputs/2026-11-22/09-37-12 model_w8a8/         # zero-cost W8A8 of any trained run
  dsrun export outputs/2026-11-22/09-37-12 out/ --tag global_step200

RUN_DIR is a dsrun run directory with checkpoints (train.save_interval > 0). --compressed (the default)
applies the run's compression_training as training left it (masks, learned scores, bit schedule) and
cleans the model (redundancy_clean); a MoQ run (quantize_training) keeps each weight's last bit width.
--w8a8 quantizes an uncompressed run after training: 8-bit weights in --groups groups per matrix and
per-token dynamic 8-bit activations. Load the result with
dsrun.compression.export.load_compressed("OUT"); docs/compression.md has the format.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dsrun.utils.errors import Problem, UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--compressed", action="store_true",
                      help="apply the run's own compression_training / quantize_training (the default)")
    mode.add_argument("--w8a8", action="store_true", help="post-training W8A8 of the trained weights (no training)")
    parser.add_argument("run_dir", type=Path, help="a run directory with checkpoints")
    parser.add_argument("output", type=Path, help="folder to write manifest.json and weights.bin to")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--groups", type=int, default=1, help="--w8a8: quantization groups per weight matrix")


def run(args: argparse.Namespace) -> int:
    from dsrun.compression.from_run import export_run

    if args.groups < 1:
        raise UserError(Problem("--groups", f"got {args.groups}; must be >= 1"))
    summary = export_run(args.run_dir, args.output, tag=args.tag, w8a8=args.w8a8, groups=args.groups)
    print(f"[dsrun] exported {summary['parameters_before']:,} -> {summary['parameters_after']:,} parameters; "
          f"{summary['fp32_bytes']:,} fp32 bytes -> {summary['bytes']:,} bytes on disk "
          f"({summary['ratio']:.3f}x) in {args.output}")
    return 0
