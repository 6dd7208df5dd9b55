"""Convert checkpoints.

Examples:
  dsrun convert zero-to-fp32 runs/exp/checkpoints pytorch_model.bin
  dsrun convert zero-to-fp32 runs/exp/checkpoints model.safetensors --tag global_step100 --safe-serialization

zero-to-fp32 consolidates a ZeRO checkpoint (stages 0-3, any number of ranks) into one fp32 state dict:
CHECKPOINT_DIR is the folder holding 'latest' and the global_step* folders. With --safe-serialization the
output is safetensors; a tied weight is stored once and its alias is listed in the file's metadata
(dsrun_shared_params).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dsrun.utils.errors import Problem, UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    kinds = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    z2f = kinds.add_parser("zero-to-fp32", help="consolidate a ZeRO checkpoint into one fp32 state dict")
    z2f.add_argument("checkpoint_dir", type=Path, help="folder holding 'latest' and the tag folders")
    z2f.add_argument("output", type=Path, help="file to write (e.g. pytorch_model.bin or model.safetensors)")
    z2f.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    z2f.add_argument("--safe-serialization", action="store_true", help="write safetensors instead of torch.save")
    z2f.add_argument("--exclude-frozen-parameters", action="store_true", help="leave frozen parameters out")


def run(args: argparse.Namespace) -> int:
    from dsrun.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    if not args.checkpoint_dir.is_dir():
        raise UserError(Problem("CHECKPOINT_DIR", f"{args.checkpoint_dir} is not a folder",
                                "pass the folder that holds 'latest' and the global_step* folders"))
    try:
        convert_zero_checkpoint_to_fp32_state_dict(str(args.checkpoint_dir), str(args.output), tag=args.tag,
                                                   exclude_frozen_parameters=args.exclude_frozen_parameters,
                                                   safe_serialization=args.safe_serialization, verbose=True)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(Problem(str(args.checkpoint_dir), str(exc), "check the folder and --tag")) from None
    return 0
