"""Convert checkpoints.

Examples:
  dsrun convert zero-to-fp32 runs/exp/checkpoints pytorch_model.bin
  dsrun convert zero-to-fp32 runs/exp/checkpoints fp32_model/ --max-shard-size 2GB
  dsrun convert zero-to-fp32 runs/exp/checkpoints model.safetensors --tag global_step100 --safe-serialization
  dsrun convert ds-to-universal runs/exp/checkpoints/global_step100 runs/exp/checkpoints/global_step100_universal
  dsrun convert to-hf outputs/2026-12-06/10-00-00 hf_model/
  dsrun convert to-hf out/checkpoint-4 hf_model/ --max-shard-size 2GB   # a Hugging Face model trained with the alias

zero-to-fp32 consolidates a ZeRO checkpoint (stages 0-3, any number of ranks) into one fp32 state dict:
CHECKPOINT_DIR is the folder holding 'latest' and the global_step* folders. OUTPUT is a folder, as DeepSpeed
writes it: pytorch_model.bin (model.safetensors), or past --max-shard-size (default 5GB) numbered shards and
their index pytorch_model.bin.index.json; an OUTPUT ending in .bin, .pt, .pth or .safetensors is that one file.
With --safe-serialization the output is safetensors; a tied weight is stored once and its alias is listed in
the file's metadata (dsrun_shared_params).

ds-to-universal writes a universal checkpoint (one folder per parameter with its fp32 master and optimizer
states) from one tag's folder of a ZeRO checkpoint, and points 'latest_universal' at it: an engine with
"checkpoint": {"load_universal": true} then loads it at any world size and ZeRO stage.

to-hf writes a Hugging Face model folder that transformers.AutoModelForCausalLM.from_pretrained(OUT) loads:
config.json and model.safetensors, or past --max-shard-size numbered shards and model.safetensors.index.json.
RUN_OR_CHECKPOINT is a run directory (its newest checkpoint, the model of its resolved.yaml), a checkpoint folder
or one tag's folder (ZeRO 0-3, any number of ranks). dsrun's GPT becomes a GPT2LMHeadModel, with rotary positions
a GPTNeoXForCausalLM (sparse attention and pipeline stages are refused); a Hugging Face model trained through the
deepspeed alias keeps its names and its config.json (beside 'latest', as the Trainer's checkpoint-N has it, or
--config).
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
    z2f.add_argument("output", type=Path, help="folder to write (DeepSpeed's form), or one file (a name ending in "
                     ".bin, .pt, .pth or .safetensors)")
    z2f.add_argument("--max-shard-size", default="5GB", help="in a folder, the largest shard before the next one "
                     "(digits and KB, MB, GB or TB; default 5GB)")
    z2f.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    z2f.add_argument("--safe-serialization", action="store_true", help="write safetensors instead of torch.save")
    z2f.add_argument("--exclude-frozen-parameters", action="store_true", help="leave frozen parameters out")
    uni = kinds.add_parser("ds-to-universal", help="convert a ZeRO checkpoint tag folder to a universal checkpoint")
    uni.add_argument("input_folder", type=Path, help="one tag's folder, e.g. checkpoints/global_step100")
    uni.add_argument("output_folder", type=Path, help="the universal folder to write, e.g. "
                     "checkpoints/global_step100_universal ('latest_universal' beside it names it)")
    hf = kinds.add_parser("to-hf", help="write a Hugging Face model folder (config.json, model.safetensors)")
    hf.add_argument("source", type=Path, metavar="RUN_OR_CHECKPOINT",
                    help="a run directory, a checkpoint folder (holding 'latest') or one tag's folder")
    hf.add_argument("output", type=Path, metavar="OUT", help="the folder to write")
    hf.add_argument("--max-shard-size", default="5GB", help="the largest weight file before the next one (digits "
                    "and KB, MB, GB or TB; default 5GB)")
    hf.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    hf.add_argument("--config", default=None, help="the model, when the source does not say: a Hugging Face "
                    "config.json (or its folder), a model YAML or a model name such as gpt-small")


def run(args: argparse.Namespace) -> int:
    if args.kind == "ds-to-universal":
        return _to_universal(args)
    if args.kind == "to-hf":
        return _to_hf(args)
    from dsrun.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    if not args.checkpoint_dir.is_dir():
        raise UserError(Problem("CHECKPOINT_DIR", f"{args.checkpoint_dir} is not a folder",
                                "pass the folder that holds 'latest' and the global_step* folders"))
    try:
        convert_zero_checkpoint_to_fp32_state_dict(str(args.checkpoint_dir), str(args.output),
                                                   max_shard_size=args.max_shard_size, tag=args.tag,
                                                   exclude_frozen_parameters=args.exclude_frozen_parameters,
                                                   safe_serialization=args.safe_serialization, verbose=True)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(Problem(str(args.checkpoint_dir), str(exc), "check the folder and --tag")) from None
    return 0


def _to_universal(args: argparse.Namespace) -> int:
    from dsrun.checkpoint.ds_to_universal import ds_to_universal

    if not args.input_folder.is_dir():
        raise UserError(Problem("INPUT_FOLDER", f"{args.input_folder} is not a folder",
                                "pass one checkpoint tag's folder, e.g. checkpoints/global_step100"))
    try:
        ds_to_universal(str(args.input_folder), str(args.output_folder))
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(Problem(str(args.input_folder), str(exc), "pass one checkpoint tag's folder")) from None
    return 0


def _to_hf(args: argparse.Namespace) -> int:
    from dsrun.cli.to_hf import export

    done = export(args.source, args.output, config=args.config, tag=args.tag, max_shard_size=args.max_shard_size)
    print(f"[dsrun] wrote {args.output} ({done.layout}): {done.tensors} tensors, {done.parameters:,} parameters in "
          f"{len(done.files)} file(s){' + index' if len(done.files) > 1 else ''}, {done.seconds:.1f} s")
    return 0
